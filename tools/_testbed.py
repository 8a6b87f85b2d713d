"""Emulated multi-SSD testbed: N loop devices, each throttled by blk-throttle.

SWARM (FAST 2026) gets its bandwidth from reading up to 8 NVMe SSDs in
parallel (§8.1: Samsung PM9A3 at 6.9 GB/s and 1.1M IOPS, Intel Optane 900P at
2.5 GB/s and 0.55M IOPS).  This machine has one virtual disk and 2 cores, so
each SSD is emulated by a loop device (``losetup --direct-io=on``: the loop
device does O_DIRECT to its backing file) and each loop device gets its own
read limit in one dedicated cgroup: cgroup v1 ``blkio.throttle.*_device`` or
cgroup v2 ``io.max``.  Only processes inside that cgroup are throttled, so
benchmarks run under ``tools/testbed run -- CMD`` (or call :func:`enter`).

The profiles keep the paper's devices' bandwidth/IOPS ratio and divide both by
one scale factor, :data:`DEFAULT_SCALE`, chosen so that 8 throttled devices
together stay well below what 2 cores can drive (the throttle, not the CPU, is
the bottleneck); see docs/benchmarks.md for the measurement.

Everything the testbed creates is recorded in a JSON state file
(``/run/<name>.json``) as it is created, and is also recognisable by name (the
cgroup ``<name>``, backing files ``<name>-disk<i>.img``), so :func:`down` can
clean up after a crash even without the state file.

Only throughput is emulated: latency is whatever queueing in blk-throttle
gives (Little's law: queue depth x request size / limit), i.e. stretched by
the scale factor too.  On Linux 6.18 a request that the loop device has to
split (larger than :func:`split_bytes`, 512 KiB for buffers of scattered
4 KiB pages) gets only about half the bps limit, so keep requests <= 512 KiB.

Units: sizes in bytes, bandwidth in bytes/s (GB/s and MB/s are decimal:
1e9 and 1e6 bytes/s), IOPS in requests/s, latency in microseconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import fcntl
import glob
import json
import os
import re
import shutil
import subprocess
import time

__all__ = [
    "DEFAULT_NAME", "DEFAULT_SCALE", "PROFILES", "Limits", "TestbedError",
    "ceiling", "down", "enter", "limits_for", "load_state", "parse_size", "read_limits",
    "split_bytes", "state_path", "status", "up",
]

DEFAULT_NAME = "swarmfs-testbed"
#: Seconds `down` waits for a detached loop device that is still open elsewhere
#: (udev probing) to go away before reporting it busy.
DETACH_WAIT_S = 3.0

# Both profile figures are divided by this.  Measured on the 2-core dev VM
# (Linux 6.18, tmpfs backing, fio io_uring O_DIRECT randread qd 32; commands and
# numbers in docs/benchmarks.md): unthrottled loop devices top out at 0.35-0.53M
# IOPS (4 KiB) and 11.5-15 GB/s (128 KiB) with both cores saturated.  The paper's
# SSDs are far richer in IOPS than this machine (PM9A3 turns bandwidth-bound
# above 6.3 KB requests, the machine above ~30 KB), so IOPS sets the scale.
# With 8 x PM9A3: /16 is CPU-bound (77% of the limit at 4 KiB); /24, /32, /48
# all reach 100%, but fio alone then keeps 72%, 56%, 37% of the CPU busy.  /48
# (8 x 143.75 MB/s = 1.15 GB/s, 8 x 22917 = 183k IOPS) leaves more than a core
# for the code under test.
DEFAULT_SCALE = 48.0


class TestbedError(RuntimeError):
    """The testbed cannot do what was asked (not root, no cgroup blkio/io
    controller, no losetup/fio, already up, backing file system without
    O_DIRECT, ...).  The message says what to do."""

    __test__ = False  # not a pytest test class


@dataclasses.dataclass(frozen=True)
class Limits:
    """Per-device throttle limits; None means unlimited.

    Attributes:
        read_bps: read bandwidth (bytes/s).
        read_iops: read requests/s.
        write_bps: write bandwidth (bytes/s).
        write_iops: write requests/s.
    """
    read_bps: int | None = None
    read_iops: int | None = None
    write_bps: int | None = None
    write_iops: int | None = None

    def scaled(self, scale: float) -> Limits:
        """These limits divided by ``scale`` (rounded to integers)."""
        return Limits(*(None if v is None else max(1, round(v / scale))
                        for v in dataclasses.astuple(self)))

    def read_ceiling(self, bs: int) -> float | None:
        """Read bytes/s one device can deliver with ``bs``-byte requests."""
        caps = []
        if self.read_bps is not None:
            caps.append(float(self.read_bps))
        if self.read_iops is not None:
            caps.append(float(self.read_iops) * bs)
        return min(caps) if caps else None


# SWARM §8.1.  Read figures only: the paper gives no write figures.
PROFILES = {
    "pm9a3": Limits(read_bps=6_900_000_000, read_iops=1_100_000),
    "900p": Limits(read_bps=2_500_000_000, read_iops=550_000),
    "none": Limits(),
}

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text) -> int:
    """``"64M"``, ``"1GiB"``, ``"128k"`` or an int -> bytes (binary units)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+)\s*([kmgtb]?)(?:i?b)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise TestbedError(f"cannot parse size {text!r} (use e.g. 4096, 128k, 64M, 1G)")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def limits_for(profile: str | None = None, *, scale: float = DEFAULT_SCALE,
               read_mbps: float | None = None, read_iops: int | None = None,
               write_mbps: float | None = None, write_iops: int | None = None) -> Limits:
    """Per-device limits: a paper profile divided by ``scale``, or explicit
    values (MB/s = 1e6 bytes/s, not scaled).  Explicit values override the
    profile's; write limits are only ever explicit."""
    if profile is not None and profile not in PROFILES:
        raise TestbedError(f"unknown profile {profile!r} (choose from {', '.join(PROFILES)})")
    if scale <= 0:
        raise TestbedError("scale must be > 0")
    base = PROFILES[profile].scaled(scale) if profile else Limits()
    def mb(v):
        return None if v is None else round(v * 1e6)

    return Limits(read_bps=mb(read_mbps) if read_mbps is not None else base.read_bps,
                  read_iops=read_iops if read_iops is not None else base.read_iops,
                  write_bps=mb(write_mbps), write_iops=write_iops)


# ---------------------------------------------------------------------------
# naming and state

def state_path(name: str = DEFAULT_NAME) -> str:
    """The state file of testbed ``name``."""
    return os.path.join(os.environ.get("SWARMFS_TESTBED_STATE_DIR", "/run"), f"{name}.json")


def _check_name(name: str) -> None:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
        raise TestbedError(f"bad testbed name {name!r} (letters, digits, _ . -)")


def _backing_name(name: str, i: int) -> str:
    return f"{name}-disk{i}.img"


def _is_ours(name: str, path: str) -> bool:
    """Does a backing-file path follow this testbed's naming pattern?"""
    base = os.path.basename(path.removesuffix(" (deleted)"))
    return re.fullmatch(re.escape(name) + r"-disk\d+\.img", base) is not None


def load_state(name: str = DEFAULT_NAME) -> dict | None:
    """The state file's content, or None if absent or unreadable."""
    try:
        with open(state_path(name)) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None


def _save_state(state: dict) -> None:
    path = state_path(state["name"])
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(state, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@contextlib.contextmanager
def _lock():
    """Serialise up/down of all testbeds (flock on the state directory)."""
    d = os.path.dirname(state_path())
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _require_root() -> None:
    if os.geteuid() != 0:
        raise TestbedError("the testbed needs root (loop devices and cgroups)")


def _require(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise TestbedError(f"{tool} not found in PATH")
    return path


# ---------------------------------------------------------------------------
# cgroups

def _mounts():
    with open("/proc/self/mounts") as f:
        for line in f:
            dev, mnt, fstype, opts = line.split()[:4]
            yield dev, mnt.replace("\\040", " "), fstype, opts.split(",")


def cgroup_backend() -> tuple[int, str]:
    """(version, mount point) of the hierarchy that has block throttling.

    cgroup v1 ``blkio`` when mounted (the io controller then cannot be in v2),
    else cgroup v2 when its root lists ``io`` in ``cgroup.controllers``.

    Raises:
        TestbedError: neither is available.
    """
    v2 = None
    for _, mnt, fstype, opts in _mounts():
        if fstype == "cgroup" and "blkio" in opts:
            if os.path.exists(os.path.join(mnt, "blkio.throttle.read_bps_device")):
                return 1, mnt
        elif fstype == "cgroup2" and v2 is None:
            try:
                with open(os.path.join(mnt, "cgroup.controllers")) as f:
                    if "io" in f.read().split():
                        v2 = mnt
            except OSError:
                pass
    if v2 is not None:
        return 2, v2
    raise TestbedError("no block throttling: neither cgroup v1 blkio (with "
                       "blkio.throttle.*) nor a cgroup v2 hierarchy with the io controller")


def _candidate_cgroups(name: str) -> list[str]:
    """Where a cgroup of this testbed could be, on any hierarchy."""
    out = []
    for _, mnt, fstype, opts in _mounts():
        if (fstype == "cgroup" and "blkio" in opts) or fstype == "cgroup2":
            out.append(os.path.join(mnt, name))
    return out


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _create_cgroup(version: int, mnt: str, name: str) -> str:
    path = os.path.join(mnt, name)
    if version == 2:
        with open(os.path.join(mnt, "cgroup.subtree_control")) as f:
            enabled = f.read().split()
        if "io" not in enabled:
            _write(os.path.join(mnt, "cgroup.subtree_control"), "+io")
    os.mkdir(path)
    return path


def _cgroup_version(path: str) -> int:
    return 1 if os.path.exists(os.path.join(path, "blkio.throttle.read_bps_device")) else 2


_V1_FILES = {"read_bps": "blkio.throttle.read_bps_device",
             "read_iops": "blkio.throttle.read_iops_device",
             "write_bps": "blkio.throttle.write_bps_device",
             "write_iops": "blkio.throttle.write_iops_device"}
_V2_KEYS = {"read_bps": "rbps", "read_iops": "riops", "write_bps": "wbps", "write_iops": "wiops"}


def _set_limits(cgroup: str, majmin: str, limits: Limits) -> None:
    if _cgroup_version(cgroup) == 1:
        for field, fname in _V1_FILES.items():
            value = getattr(limits, field)
            if value is not None:
                _write(os.path.join(cgroup, fname), f"{majmin} {value}\n")
    else:
        kv = " ".join(f"{key}={'max' if getattr(limits, f) is None else getattr(limits, f)}"
                      for f, key in _V2_KEYS.items())
        _write(os.path.join(cgroup, "io.max"), f"{majmin} {kv}\n")


def read_limits(cgroup: str) -> dict[str, Limits]:
    """The limits the kernel holds for a cgroup: ``{"MAJ:MIN": Limits}``."""
    found: dict[str, dict] = {}
    if _cgroup_version(cgroup) == 1:
        for field, fname in _V1_FILES.items():
            with open(os.path.join(cgroup, fname)) as f:
                for line in f:
                    dev, value = line.split()
                    found.setdefault(dev, {})[field] = int(value)
    else:
        inv = {v: k for k, v in _V2_KEYS.items()}
        with open(os.path.join(cgroup, "io.max")) as f:
            for line in f:
                dev, *pairs = line.split()
                for pair in pairs:
                    key, value = pair.split("=")
                    if key in inv and value != "max":
                        found.setdefault(dev, {})[inv[key]] = int(value)
    return {dev: Limits(**fields) for dev, fields in found.items()}


def _procs(cgroup: str) -> list[int]:
    try:
        with open(os.path.join(cgroup, "cgroup.procs")) as f:
            return [int(x) for x in f.read().split()]
    except FileNotFoundError:
        return []


def enter(pid: int | None = None, *, name: str = DEFAULT_NAME, cgroup: str | None = None) -> str:
    """Move a process (default: this one, all its threads) into the throttled
    cgroup; its children inherit it.  Returns the cgroup path.

    Raises:
        TestbedError: the testbed is not up.
    """
    if cgroup is None:
        state = load_state(name)
        if not state or not state.get("complete"):
            raise TestbedError(f"testbed {name!r} is not up (run `tools/testbed up` first)")
        cgroup = state["cgroup"]["path"]
    if not os.path.isdir(cgroup):
        raise TestbedError(f"cgroup {cgroup} does not exist (run `tools/testbed up` again)")
    _write(os.path.join(cgroup, "cgroup.procs"), f"{os.getpid() if pid is None else pid}\n")
    return cgroup


def _remove_cgroup(path: str, report: dict) -> None:
    """Move whatever still runs in ``path`` to the parent group, then rmdir."""
    parent = os.path.join(os.path.dirname(path), "cgroup.procs")
    deadline = time.monotonic() + 5.0
    while True:
        for pid in _procs(path):
            with contextlib.suppress(ProcessLookupError, FileNotFoundError):
                _write(parent, f"{pid}\n")
                report["procs_moved"].append(pid)
        try:
            os.rmdir(path)
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                raise TestbedError(f"cannot remove cgroup {path}: {exc.strerror}") from exc
            time.sleep(0.05)  # a task was exiting or forking while we moved it
            continue
        report["cgroups_removed"].append(path)
        return


# ---------------------------------------------------------------------------
# loop devices

def _loop_devices() -> dict[str, str]:
    """Attached loop devices: ``{"/dev/loopN": backing file}`` (from sysfs;
    a deleted backing file ends in ``" (deleted)"``)."""
    out = {}
    for d in glob.glob("/sys/block/loop*/loop/backing_file"):
        with contextlib.suppress(OSError), open(d) as f:
            out["/dev/" + d.split("/")[3]] = f.read().rstrip("\n")
    return out


def _sysfs(dev: str, *rel: str) -> str:
    with open(os.path.join("/sys/block", os.path.basename(dev), *rel)) as f:
        return f.read().strip()


def _attach(path: str, sector_size: int | None) -> str:
    cmd = [_require("losetup"), "--direct-io=on", "--find", "--show"]
    if sector_size:
        cmd += ["--sector-size", str(sector_size)]
    res = subprocess.run(cmd + [path], check=False, capture_output=True, text=True)
    if res.returncode != 0:
        raise TestbedError(f"losetup {path} failed: {res.stderr.strip()}")
    return res.stdout.strip()


def _detach(dev: str) -> None:
    res = subprocess.run([_require("losetup"), "--detach", dev], check=False,
                         capture_output=True, text=True)
    if res.returncode != 0 and os.path.exists(f"/sys/block/{os.path.basename(dev)}/loop"):
        raise TestbedError(f"losetup --detach {dev} failed: {res.stderr.strip()}")


def _fs_of(path: str) -> str:
    """File system type holding ``path`` (longest mount-point prefix)."""
    real = os.path.realpath(path)
    best, fstype = "", "?"
    for _, mnt, fs, _ in _mounts():
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
            best, fstype = mnt, fs
    return fstype


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


# ---------------------------------------------------------------------------
# up / down / status

def up(ndisks: int, size, backing: str, *, limits: Limits, profile: str | None = None,
       scale: float | None = None, name: str = DEFAULT_NAME, preallocate: bool = False,
       sector_size: int | None = None) -> dict:
    """Create ``ndisks`` throttled loop devices over files in ``backing``.

    Args:
        ndisks: number of emulated SSDs.
        size: bytes per device (int, or a string such as ``"1G"``).
        backing: directory for the backing files (created if missing); its file
            system must support O_DIRECT (tmpfs on Linux >= 6.6, ext4, xfs).
        limits: per-device limits (:func:`limits_for`).
        profile, scale: recorded in the state for reporting only.
        name: testbed name: cgroup ``<name>``, files ``<name>-disk<i>.img``,
            state ``/run/<name>.json``.
        preallocate: ``fallocate`` the files (on tmpfs this takes the RAM now)
            instead of leaving them sparse.
        sector_size: logical block size of the loop devices (default: losetup's, 512).

    Returns:
        The state dict (also written to the state file); ``state["devices"]``
        lists the device paths in disk order.

    Raises:
        TestbedError: not root, already up or left over, no space, no O_DIRECT, ...
    """
    _require_root()
    _check_name(name)
    _require("losetup")
    size = parse_size(size)
    if ndisks < 1:
        raise TestbedError("need at least one disk")
    if size < 1 << 20 or size % 4096:
        raise TestbedError("size must be a multiple of 4 KiB and at least 1 MiB")
    version, mnt = cgroup_backend()
    backing = os.path.abspath(backing)
    with _lock():
        leftovers = [p for p in [state_path(name)] + _candidate_cgroups(name) if os.path.exists(p)]
        leftovers += [d for d, f in _loop_devices().items() if _is_ours(name, f)]
        if leftovers:
            raise TestbedError(f"testbed {name!r} is already up or left over "
                               f"({', '.join(leftovers)}); run `tools/testbed down` first")
        created_dir = not os.path.isdir(backing)
        os.makedirs(backing, exist_ok=True)
        state = {
            "version": 1, "name": name, "complete": False,
            "created": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "backing": backing, "backing_fs": _fs_of(backing), "created_backing_dir": created_dir,
            "size_bytes": size, "profile": profile, "scale": scale,
            "limits": dataclasses.asdict(limits),
            "cgroup": {"version": version, "path": os.path.join(mnt, name)},
            "disks": [], "devices": [],
        }
        _save_state(state)  # before creating anything, so a crash leaves a trail
        try:
            fstype, need = state["backing_fs"], ndisks * size
            st = os.statvfs(backing)
            if st.f_bavail * st.f_frsize < need:
                raise TestbedError(f"{backing} has {st.f_bavail * st.f_frsize / 2**30:.1f} GiB "
                                   f"free, need {need / 2**30:.1f} GiB")
            if fstype == "tmpfs" and need > _mem_available():
                raise TestbedError(f"{ndisks} x {size / 2**30:.2f} GiB on tmpfs exceeds "
                                   f"available RAM ({_mem_available() / 2**30:.1f} GiB)")
            cg = _create_cgroup(version, mnt, name)
            for i in range(ndisks):
                path = os.path.join(backing, _backing_name(name, i))
                with open(path, "wb") as f:
                    f.truncate(size)
                    if preallocate:
                        os.posix_fallocate(f.fileno(), 0, size)
                state["disks"].append({"index": i, "backing_file": path, "device": None})
                _save_state(state)
                dev = _attach(path, sector_size)
                majmin = _sysfs(dev, "dev")
                state["disks"][i].update(device=dev, majmin=majmin)
                state["devices"].append(dev)
                _save_state(state)
                if _sysfs(dev, "loop", "dio") != "1":
                    raise TestbedError(f"{dev}: direct I/O could not be enabled on {path} "
                                       f"({fstype} lacks O_DIRECT?); use a backing dir on "
                                       f"ext4/xfs, e.g. under /work")
                _set_limits(cg, majmin, limits)
            state["complete"] = True
            _save_state(state)
        except BaseException:
            with contextlib.suppress(Exception):
                _down_locked(name, None)
            raise
    return state


def down(name: str = DEFAULT_NAME, backing: str | None = None) -> dict:
    """Remove everything testbed ``name`` created; idempotent, crash-safe.

    Uses the state file when there is one, and also finds leftovers by name:
    the cgroup ``<name>`` on every hierarchy, loop devices whose backing file
    is called ``<name>-disk<i>.img`` (sysfs), and such files in ``backing``.
    Processes still in the cgroup are moved to its parent (they keep running,
    unthrottled); a loop device still held open detaches when closed.

    Returns:
        What was done: ``cgroups_removed``, ``procs_moved``, ``devices_detached``,
        ``devices_busy``, ``files_removed``, ``dirs_removed``, ``state_removed``.
    """
    _require_root()
    _check_name(name)
    with _lock():
        return _down_locked(name, backing)


def _down_locked(name: str, backing: str | None) -> dict:
    report = {k: [] for k in ("cgroups_removed", "procs_moved", "devices_detached",
                              "devices_busy", "files_removed", "dirs_removed")}
    state = load_state(name) or {}
    cgroups = set(_candidate_cgroups(name))
    if state.get("cgroup"):
        cgroups.add(state["cgroup"]["path"])
    for cg in sorted(cgroups):
        if os.path.isdir(cg):
            _remove_cgroup(cg, report)

    files = {d["backing_file"] for d in state.get("disks", [])}
    for dev, bf in sorted(_loop_devices().items()):
        plain = bf.removesuffix(" (deleted)")
        if plain in files or _is_ours(name, plain):
            files.add(plain)
            _detach(dev)
            report["devices_detached"].append(dev)
    # a device still open elsewhere (udev's probe after our writes holds it for
    # milliseconds) is only marked autoclear and goes when closed: wait for that,
    # bounded, so that `down` then `up` of one name does not see it left over
    deadline = time.monotonic() + DETACH_WAIT_S
    while True:
        busy = [d for d in report["devices_detached"]
                if os.path.exists(f"/sys/block/{os.path.basename(d)}/loop")]
        if not busy or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    report["devices_busy"] = busy                  # open elsewhere: autoclear on close
    dirs = [d for d in (state.get("backing"), backing) if d]
    for d in dirs:
        files.update(p for p in glob.glob(os.path.join(glob.escape(d), f"{name}-disk*.img"))
                     if _is_ours(name, p))
    for path in sorted(files):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            report["files_removed"].append(path)
    # the directory up created, or (state lost) one named like the default /dev/shm/<name>
    made = set()
    if state.get("created_backing_dir") and state.get("backing"):
        made.add(state["backing"])
    made.update(os.path.dirname(p) for p in files
                if os.path.basename(os.path.dirname(p)) == name)
    for d in sorted(made):
        with contextlib.suppress(OSError):  # not empty: not only ours, keep it
            os.rmdir(d)
            report["dirs_removed"].append(d)
    try:
        os.unlink(state_path(name))
        report["state_removed"] = state_path(name)
    except FileNotFoundError:
        report["state_removed"] = None
    return report


def status(name: str = DEFAULT_NAME) -> dict:
    """State plus what the kernel says now.

    Returns:
        ``{"up": bool, "name", "state_file", "state" (or None), "cgroup",
        "cgroup_exists", "procs", "disks": [{"index", "device", "backing_file",
        "attached", "majmin", "limits" (kernel's, as a dict)}], "leftover_devices"}``.
        ``up`` is True when the state is complete, the cgroup exists and every
        device is still attached to its backing file.
    """
    state = load_state(name)
    loops = _loop_devices()
    out = {"name": name, "state_file": state_path(name), "state": state, "up": False,
           "cgroup": None, "cgroup_exists": False, "procs": [], "disks": [],
           "leftover_devices": sorted(d for d, f in loops.items() if _is_ours(name, f))}
    if not state:
        return out
    cg = state["cgroup"]["path"]
    out["cgroup"] = cg
    out["cgroup_exists"] = os.path.isdir(cg)
    kernel = {}
    if out["cgroup_exists"]:
        out["procs"] = _procs(cg)
        with contextlib.suppress(OSError):
            kernel = read_limits(cg)
    for d in state.get("disks", []):
        attached = d.get("device") is not None and \
            loops.get(d["device"], "").removesuffix(" (deleted)") == d["backing_file"]
        lim = kernel.get(d.get("majmin"))
        out["disks"].append({"index": d["index"], "device": d.get("device"),
                             "backing_file": d["backing_file"], "majmin": d.get("majmin"),
                             "attached": attached,
                             "limits": dataclasses.asdict(lim) if lim else None})
    out["up"] = bool(state.get("complete") and out["cgroup_exists"] and out["disks"]
                     and all(d["attached"] for d in out["disks"]))
    return out


# ---------------------------------------------------------------------------
# the ceiling

_AUTO = object()


def ceiling(devices, bs, qd: int, runtime_s: float = 5, *, ramp_s: float | None = None,
            cgroup=_AUTO, name: str = DEFAULT_NAME, fio: str = "fio") -> dict:
    """What the (throttled) devices deliver together: fio randread on all at once.

    One fio job per device, all running concurrently (``ioengine=io_uring``,
    ``direct=1``, ``rw=randread``, ``iomem=mmap``, ``--readonly``), time-based, no
    group_reporting, so per-device figures come back too.  Benchmarks report
    their bandwidth as a fraction of ``result["gb_per_s"]``.

    Args:
        devices: device (or file) paths.
        bs: request size, bytes or ``"128k"``.
        qd: queue depth per device.
        runtime_s: measured seconds (after ``ramp_s``).
        ramp_s: seconds run before measuring; default ``min(1, runtime_s / 4)``.
        cgroup: cgroup directory to run fio in; default: testbed ``name``'s
            (from its state file); None: the caller's own (unthrottled unless
            the caller is in the group).
        fio: fio executable.

    Returns:
        ``{"bs", "qd", "runtime_s", "ramp_s", "cgroup", "ndevices",
        "bytes_per_s", "gb_per_s", "iops", "limit_gb_per_s", "fraction_of_limit",
        "devices": [{"device", "bytes_per_s", "gb_per_s", "mb_per_s", "iops",
        "lat_mean_us", "lat_p99_us", "limit_mb_per_s", "limit_iops",
        "fraction_of_limit", "split_bytes"}], "split"}``.  ``limit_*`` come
        from the cgroup's limits (what a device can deliver with ``bs``:
        min(bps, iops x bs)); they and the fractions are None when a device
        has no limit.  ``split`` is True when ``bs`` exceeds a device's
        :func:`split_bytes` (the throttle then under-delivers; keep requests
        at or below it).

    Raises:
        TestbedError: fio missing or failed, or the testbed is not up.
    """
    devices = [str(d) for d in devices]
    if not devices:
        raise TestbedError("ceiling needs at least one device")
    bs = parse_size(bs)
    if qd < 1 or runtime_s <= 0:
        raise TestbedError("qd must be >= 1 and runtime_s > 0")
    if ramp_s is None:
        ramp_s = min(1.0, runtime_s / 4)
    if cgroup is _AUTO:
        state = load_state(name)
        if not state or not state.get("complete"):
            raise TestbedError(f"testbed {name!r} is not up; start it or pass cgroup=None")
        cgroup = state["cgroup"]["path"]
    exe = _require(fio)
    args = [exe, "--output-format=json", "--readonly", "--ioengine=io_uring", "--direct=1",
            "--rw=randread", f"--bs={bs}", f"--iodepth={qd}", "--time_based=1",
            f"--runtime={int(runtime_s * 1000)}ms", f"--ramp_time={int(ramp_s * 1000)}ms",
            "--norandommap=1", "--randrepeat=0",
            # anonymous mmap buffers, like swarmfs's AlignedBuffer: fio's malloc
            # buffers are sometimes physically contiguous by chance, which
            # changes how large requests are split (see split_bytes)
            "--iomem=mmap"]
    for i, dev in enumerate(devices):
        args += [f"--name=dev{i}", f"--filename={dev}"]
    limits = {}
    if cgroup is not None:
        if not os.path.isdir(cgroup):
            raise TestbedError(f"cgroup {cgroup} does not exist")
        limits = read_limits(cgroup)
        # the shell joins the group, then becomes fio: fio and its job
        # processes are all inside it from their first I/O on
        args = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"',
                os.path.join(cgroup, "cgroup.procs")] + args
    res = subprocess.run(args, check=False, capture_output=True, text=True,
                         timeout=runtime_s + ramp_s + 60)
    start = res.stdout.find("{")
    if res.returncode != 0 or start < 0:
        detail = res.stderr.strip() or res.stdout[:500]
        raise TestbedError(f"fio failed ({res.returncode}): {detail}")
    jobs = json.loads(res.stdout[start:])["jobs"]
    if len(jobs) != len(devices):
        raise TestbedError(f"fio reported {len(jobs)} jobs for {len(devices)} devices")
    per = []
    for dev, job in zip(devices, jobs, strict=True):
        if job.get("error"):
            raise TestbedError(f"fio on {dev}: error {job['error']}")
        rd = job["read"]
        lim = limits.get(_majmin(dev)) if limits else None
        cap = lim.read_ceiling(bs) if lim else None
        pct = rd["clat_ns"].get("percentile", {})
        split = split_bytes(dev)
        per.append({
            "device": dev, "bytes_per_s": float(rd["bw_bytes"]),
            "gb_per_s": rd["bw_bytes"] / 1e9, "mb_per_s": rd["bw_bytes"] / 1e6,
            "iops": float(rd["iops"]), "lat_mean_us": rd["lat_ns"]["mean"] / 1e3,
            "lat_p99_us": pct.get("99.000000", 0.0) / 1e3,
            "limit_mb_per_s": None if cap is None else cap / 1e6,
            "limit_iops": None if cap is None else cap / bs,
            "fraction_of_limit": None if cap is None else rd["bw_bytes"] / cap,
            "split_bytes": split,
        })
    total = sum(d["bytes_per_s"] for d in per)
    caps = [d["limit_mb_per_s"] for d in per]
    cap_total = None if None in caps else sum(caps) * 1e6
    return {
        "bs": bs, "qd": qd, "runtime_s": runtime_s, "ramp_s": ramp_s, "cgroup": cgroup,
        "ndevices": len(per), "bytes_per_s": total, "gb_per_s": total / 1e9,
        "iops": sum(d["iops"] for d in per),
        "limit_gb_per_s": None if cap_total is None else cap_total / 1e9,
        "fraction_of_limit": None if cap_total is None else total / cap_total,
        "devices": per,
        "split": any(d["split_bytes"] is not None and bs > d["split_bytes"] for d in per),
    }


def split_bytes(dev: str) -> int | None:
    """Largest request a block device takes as one bio from a buffer of
    scattered 4 KiB pages: min(max_sectors_kb, max_segments x page size).
    Larger requests are split, and on Linux 6.18 blk-throttle then delivers
    only ~half the bps limit to them (docs/benchmarks.md).  None for files."""
    name = os.path.basename(os.path.realpath(dev))
    try:
        sectors_kb = int(_sysfs(name, "queue", "max_sectors_kb"))
        segments = int(_sysfs(name, "queue", "max_segments"))
    except (OSError, ValueError):
        return None
    return min(sectors_kb * 1024, segments * os.sysconf("SC_PAGE_SIZE"))


def _majmin(dev: str) -> str | None:
    try:
        rdev = os.stat(dev).st_rdev
    except OSError:
        return None
    return f"{os.major(rdev)}:{os.minor(rdev)}" if rdev else None
