"""The disks a figure's stores go on, and their fio ceilings."""

from __future__ import annotations

import dataclasses

from tools import _testbed


@dataclasses.dataclass
class Disks:
    """Where the stores go.

    Attributes:
        paths: device or file paths (None: ``files`` file disks in the store dir).
        files: number of file disks when ``paths`` is None.
        testbed: the testbed state (profile, limits, cgroup) or None.
    """
    paths: list | None
    files: int = 0
    testbed: dict | None = None

    @property
    def count(self) -> int:
        return len(self.paths) if self.paths is not None else self.files

    def first(self, n: int) -> Disks:
        if n > self.count:
            raise SystemExit(f"{n} disks wanted, {self.count} available")
        if self.paths is None:
            return Disks(None, n, self.testbed)
        return Disks(self.paths[:n], 0, self.testbed)

    def spec(self):
        return self.paths if self.paths is not None else self.files

    def describe(self) -> dict:
        tb = self.testbed or {}
        return {"kind": "testbed" if self.testbed else "files", "count": self.count,
                "paths": self.paths, "testbed": tb.get("name"),
                "profile": tb.get("profile"), "scale": tb.get("scale"),
                "limits_per_device": tb.get("limits")}


def resolve_disks(spec: str) -> Disks:
    """``testbed`` / ``testbed:NAME`` (devices of an up testbed), ``files:N``
    (N file disks inside each store directory) or a comma list of paths."""
    if spec.startswith("testbed"):
        name = spec.split(":", 1)[1] if ":" in spec else _testbed.DEFAULT_NAME
        st = _testbed.load_state(name)
        if not st or not st.get("complete"):
            raise SystemExit(f"testbed {name!r} is not up: run tools/testbed up first "
                             f"(or pass --disks files:N)")
        return Disks(list(st["devices"]), 0, st)
    if spec.startswith("files:"):
        return Disks(None, int(spec.split(":", 1)[1]))
    return Disks([p for p in spec.split(",") if p])


def fio_ceiling(disks: Disks, *, bs="128k", qd: int = 32, runtime_s: float = 3) -> dict | None:
    """fio randread on all devices at once inside the testbed's cgroup
    (``tools/_testbed.ceiling``); None for file disks (smoke runs)."""
    if disks.testbed is None or disks.paths is None:
        return None
    r = _testbed.ceiling(disks.paths, bs, qd, runtime_s=runtime_s,
                         cgroup=disks.testbed["cgroup"]["path"])
    return {k: r[k] for k in ("bs", "qd", "ndevices", "gb_per_s", "iops", "limit_gb_per_s",
                              "fraction_of_limit", "split")}


def ceilings(disks: Disks, smoke: bool) -> dict:
    """The bandwidth (128 KiB) and IOPS (4 KiB) ceilings, qd 32 per device."""
    if smoke or disks.testbed is None:
        return {}
    return {"bw_128k": fio_ceiling(disks, bs="128k"), "iops_4k": fio_ceiling(disks, bs="4k")}
