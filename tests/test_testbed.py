"""Tests for tools/testbed: real loop devices, a real throttled cgroup, real fio.

The tests that touch the kernel need root, losetup, /dev/loop-control and a
cgroup hierarchy with block throttling (v1 blkio or v2 io); they skip cleanly
otherwise.  Each uses its own testbed name, so a testbed that is already up
is left alone, and always runs ``down`` in teardown.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import wait_until
from tools import _testbed as T

TESTBED = Path(__file__).resolve().parent.parent / "tools" / "testbed"


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    if shutil.which("losetup") is None:
        return "needs losetup"
    if not os.path.exists("/dev/loop-control"):
        return "needs loop devices (/dev/loop-control)"
    try:
        T.cgroup_backend()
    except T.TestbedError as exc:
        return str(exc)
    return None


needs_kernel = pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))
needs_fio = pytest.mark.skipif(shutil.which("fio") is None, reason="needs fio")


def cli(name, *args, check=True, **kw):
    res = subprocess.run([sys.executable, str(TESTBED), "--name", name, *args],
                         check=False, capture_output=True, text=True, timeout=60, **kw)
    if check and res.returncode != 0:
        raise AssertionError(f"testbed {' '.join(args)} -> {res.returncode}\n{res.stderr}")
    return res


def our_loop_devices(name):
    """Loop devices whose backing file follows testbed ``name``'s pattern."""
    return {dev: f for dev, f in T._loop_devices().items() if T._is_ours(name, f)}


def assert_nothing_left(name, backing):
    assert our_loop_devices(name) == {}
    for cg in T._candidate_cgroups(name):
        assert not os.path.exists(cg), cg
    assert not os.path.exists(T.state_path(name))
    assert glob.glob(os.path.join(backing, f"{name}-disk*.img")) == []


@pytest.fixture
def name(tmp_path):
    """A testbed name of our own; ``down`` always runs afterwards."""
    name = f"swarmfs-testbed-pytest-{os.getpid()}"
    backing = tmp_path / "backing"
    yield name
    with contextlib.suppress(Exception):
        T.down(name, str(backing))


@pytest.fixture
def backing(tmp_path):
    return str(tmp_path / "backing")


def up(name, backing, *extra):
    res = cli(name, "up", "--disks", "2", "--size", "64M", "--backing", backing, "--json", *extra)
    return json.loads(res.stdout)


# ---------------------------------------------------------------------------
# pure helpers (no root needed)

def test_parse_size():
    assert T.parse_size("64M") == 64 << 20
    assert T.parse_size("1GiB") == 1 << 30
    assert T.parse_size("128k") == 128 << 10
    assert T.parse_size(4096) == 4096
    with pytest.raises(T.TestbedError):
        T.parse_size("lots")


def test_profiles_keep_the_paper_ratios():
    for profile in ("pm9a3", "900p"):
        paper = T.PROFILES[profile]
        lim = T.limits_for(profile, scale=48)
        assert lim.read_bps == round(paper.read_bps / 48)
        assert lim.read_iops == round(paper.read_iops / 48)
        assert lim.write_bps is None and lim.write_iops is None
    pm, op = T.limits_for("pm9a3"), T.limits_for("900p")
    assert pm.read_bps / op.read_bps == pytest.approx(6.9 / 2.5, rel=1e-6)
    assert pm.read_iops / op.read_iops == pytest.approx(2.0, rel=1e-4)


def test_explicit_limits_and_read_ceiling():
    lim = T.limits_for(read_mbps=100, read_iops=1000, write_mbps=50)
    assert (lim.read_bps, lim.read_iops, lim.write_bps) == (100_000_000, 1000, 50_000_000)
    assert lim.read_ceiling(4096) == 1000 * 4096          # IOPS-bound
    assert lim.read_ceiling(1 << 20) == 100_000_000       # bandwidth-bound
    assert T.Limits().read_ceiling(4096) is None
    with pytest.raises(T.TestbedError):
        T.limits_for("nvme9000")


def test_v2_io_max_round_trip(tmp_path):
    """cgroup v2 is not testable for real on a v1-blkio host: check the format."""
    (tmp_path / "io.max").write_text("")
    lim = T.Limits(read_bps=143_750_000, read_iops=22917)
    T._set_limits(str(tmp_path), "7:3", lim)
    assert (tmp_path / "io.max").read_text() == \
        "7:3 rbps=143750000 riops=22917 wbps=max wiops=max\n"
    assert T.read_limits(str(tmp_path)) == {"7:3": lim}


# ---------------------------------------------------------------------------
# the real thing



@pytest.mark.root
@needs_kernel
def test_lifecycle(name, backing):
    state = up(name, backing, "--read-mbps", "200", "--read-iops", "20000")
    devices = state["devices"]
    assert len(devices) == 2 and state["complete"]
    for dev, disk in zip(devices, state["disks"], strict=True):
        assert stat.S_ISBLK(os.stat(dev).st_mode)
        assert T._sysfs(dev, "loop", "dio") == "1"           # O_DIRECT to the backing file
        assert os.path.getsize(disk["backing_file"]) == 64 << 20
    assert os.path.isdir(state["cgroup"]["path"])

    st = json.loads(cli(name, "status", "--json").stdout)
    assert st["up"]
    for d in st["disks"]:
        assert d["attached"]
        assert d["limits"]["read_bps"] == 200_000_000 and d["limits"]["read_iops"] == 20000

    # the child runs inside the throttled group
    res = cli(name, "run", "--", sys.executable, "-c",
              "print(open('/proc/self/cgroup').read())")
    rel = "/" + name
    lines = [ln.split(":", 2) for ln in res.stdout.splitlines() if ln.count(":") >= 2]
    assert any(path == rel and ("blkio" in ctrl.split(",") or (hid == "0" and ctrl == ""))
               for hid, ctrl, path in lines), res.stdout
    # ... and CMD's exit status comes back
    assert cli(name, "run", "--", sys.executable, "-c", "raise SystemExit(3)",
               check=False).returncode == 3

    cli(name, "down")
    assert_nothing_left(name, backing)
    assert not os.path.exists(backing)                     # up created it, down removes it
    assert "nothing to remove" in cli(name, "down").stdout  # idempotent


@pytest.mark.root
@needs_kernel
@needs_fio
def test_ceiling(name, backing):
    state = up(name, backing, "--profile", "pm9a3")
    res = T.ceiling(state["devices"], "128k", 8, runtime_s=1, name=name)
    assert res["gb_per_s"] > 0 and res["iops"] > 0
    assert res["cgroup"] == state["cgroup"]["path"]
    assert [d["device"] for d in res["devices"]] == state["devices"]
    for d in res["devices"]:
        assert d["bytes_per_s"] > 0 and d["iops"] > 0
        assert d["limit_mb_per_s"] > 0 and d["fraction_of_limit"] > 0
    out = json.loads(cli(name, "ceiling", "--bs", "4k", "--qd", "4", "--runtime", "0.5",
                         "--disks", "1", "--json").stdout)
    assert out["ndevices"] == 1 and out["iops"] > 0


@pytest.mark.root
@needs_kernel
def test_up_refuses_twice(name, backing):
    up(name, backing)
    res = cli(name, "up", "--disks", "1", "--size", "64M", "--backing", backing, check=False)
    assert res.returncode != 0 and "already up" in res.stderr
    assert len(our_loop_devices(name)) == 2


@pytest.mark.root
@needs_kernel
def test_down_then_up_again_at_once(name, backing):
    """`down` then an immediate `up` of the same name, repeatedly: `down` waits
    (bounded, DETACH_WAIT_S) for a detached device still held open elsewhere,
    so `up` never finds it left over.  The race it guards: a process whose
    io_uring had a throttled read in flight exits, and the ring's deferred
    teardown holds the loop device for up to a throttled request's time; the
    slow-disk isolation test in test_engine.py met it once in a CI run (its
    second parametrisation's `up` found the first's device).  Here a plain
    write and close rarely leaves the device busy, so this test checks the
    cycle and the report, not the race itself."""
    for _ in range(3):
        state = T.up(1, "16M", backing, limits=T.Limits(read_iops=100), name=name)
        fd = os.open(state["devices"][0], os.O_WRONLY)
        try:
            os.pwrite(fd, b"x" * 65536, 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        report = T.down(name, backing)
        assert report["devices_busy"] == []
        assert not our_loop_devices(name)


@pytest.mark.root
@needs_kernel
def test_down_after_crash_with_state(name, backing):
    """State file present, devices attached, a process still in the group."""
    state = up(name, backing)
    procs = os.path.join(state["cgroup"]["path"], "cgroup.procs")
    sleeper = subprocess.Popen([sys.executable, str(TESTBED), "--name", name, "run", "--",
                                "sleep", "60"])
    try:
        wait_until(lambda: sleeper.pid in T._procs(os.path.dirname(procs)),
                   what="the sleeper in the cgroup")
        report = json.loads(cli(name, "down", "--json").stdout)
        assert sleeper.pid in report["procs_moved"]
        assert sorted(report["devices_detached"]) == sorted(state["devices"])
        assert sleeper.poll() is None                      # still running, now unthrottled
        with open(f"/proc/{sleeper.pid}/cgroup") as f:
            assert "/" + name not in f.read()
    finally:
        sleeper.kill()
        sleeper.wait()
    assert_nothing_left(name, backing)


@pytest.mark.root
@needs_kernel
def test_down_after_crash_without_state(name, backing):
    """No state file at all: leftovers are found by their names."""
    os.makedirs(backing)
    _, mnt = T.cgroup_backend()
    files = []
    for i in range(2):
        path = os.path.join(backing, f"{name}-disk{i}.img")
        with open(path, "wb") as f:
            f.truncate(64 << 20)
        subprocess.run(["losetup", "--direct-io=on", "--find", path], check=True)
        files.append(path)
    os.mkdir(os.path.join(mnt, name))
    assert not os.path.exists(T.state_path(name))
    assert len(our_loop_devices(name)) == 2

    st = json.loads(cli(name, "status", "--json", check=False).stdout)
    assert st["state"] is None and len(st["leftover_devices"]) == 2
    assert cli(name, "up", "--disks", "1", "--size", "64M", "--backing", backing,
               check=False).returncode != 0              # refuses over leftovers

    report = json.loads(cli(name, "down", "--json").stdout)
    assert len(report["devices_detached"]) == 2
    assert sorted(report["files_removed"]) == files
    assert_nothing_left(name, backing)
