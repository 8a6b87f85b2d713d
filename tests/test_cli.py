"""The swarmfs command line, run as a user would (subprocesses)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import random_clusters, random_kv
from swarmfs import Store

SWARMFS = [sys.executable, "-m", "swarmfs._cli"]


def run(*args, ok=True):
    p = subprocess.run(SWARMFS + list(args), capture_output=True, text=True, timeout=300)
    if ok:
        assert p.returncode == 0, p.stderr
    return p


@pytest.fixture
def store(tmp_path, rng):
    s = Store.create(tmp_path / "st", disks=3, num_layers=2, num_kv_heads=2, head_dim=16)
    kv = random_kv(rng, 500, 2, 16, "float16")
    cl = random_clusters(rng, 500, 25, 40)
    s.write_layer(1, kv, cl)
    s.close()
    return str(tmp_path / "st"), kv, cl


@pytest.mark.slow
def test_help_on_every_command():
    out = run("--help").stdout
    for cmd in ("info", "verify", "read", "demo"):
        assert cmd in out
        assert "Usage" in run(cmd, "--help").stdout


def test_info_json(store):
    path, kv, cl = store
    d = json.loads(run("info", path, "--json").stdout)
    assert d["num_disks"] == 3 and d["clusters"] == 25 and d["entries"] == 500
    assert d["engine"] in ("io_uring", "threads")
    assert d["replication"] >= 1.0
    assert "layer" in run("info", path).stdout


def test_verify_and_flipped_byte(store):
    path, kv, cl = store
    assert "ok" in run("verify", path).stdout
    with Store.open(path) as s:
        li = s.layer(1)
        c = int(li.cluster_copies([4])[0])
        disk, off = int(li.copy_disk[c]), int(li.copy_off[c])
        dpath = s.disk_paths[disk]
    with open(dpath, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 1]))
    p = run("verify", path, ok=False)
    assert p.returncode == 1
    assert f"cluster 4 disk {disk}" in p.stdout and dpath in p.stdout
    p = run("verify", path, "--json", ok=False)
    assert json.loads(p.stdout)["failures"][0]["cluster"] == 4


def test_read_to_npy(store, tmp_path):
    path, kv, cl = store
    out = tmp_path / "c.npy"
    run("read", path, "--layer", "1", "--cluster", "7", "--out", str(out))
    arr = np.load(out)
    assert arr.view(np.uint16).tobytes() == kv[cl[7]].view(np.uint16).tobytes()
    assert "entries" in run("read", path, "--layer", "1", "--tokens", "3,1,4").stdout


def test_errors_are_one_line(store, tmp_path):
    path, _, _ = store
    p = run("read", path, "--layer", "1", "--cluster", "999", ok=False)
    assert p.returncode == 1 and "cluster 999" in p.stderr and "Traceback" not in p.stderr
    p = run("info", str(tmp_path / "nope"), ok=False)
    assert p.returncode == 1 and "does not exist" in p.stderr
    p = run("read", path, "--layer", "1", ok=False)
    assert p.returncode == 2


def test_debug_env_shows_the_traceback(tmp_path):
    missing = str(tmp_path / "nostore")
    quiet = run("info", missing, ok=False)
    assert quiet.returncode == 1 and "Traceback" not in quiet.stderr
    assert quiet.stderr.startswith("swarmfs: error:") and "nostore" in quiet.stderr
    loud = subprocess.run([sys.executable, "-m", "swarmfs", "info", missing],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "SWARMFS_DEBUG": "1"})
    assert loud.returncode != 0
    assert "Traceback" in loud.stderr and "StoreNotFoundError" in loud.stderr


def test_build_refuses_disks_and_disk_together(tmp_path):
    p = run("build", str(tmp_path / "kv.safetensors"), str(tmp_path / "st"), "--disks", "2",
            "--disk", str(tmp_path / "d0"), ok=False)
    assert p.returncode == 2 and "not both" in p.stderr
    assert not (tmp_path / "st").exists()


def test_closed_pipe_is_quiet(store):
    """``swarmfs read STORE ... | head`` with the reader gone: no traceback,
    exit status 1.  The pipe's read end is closed before the command starts,
    so its first write fails with EPIPE every time (no race with a reader)."""
    path, _, _ = store
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run(SWARMFS + ["read", path, "--layer", "1", "--cluster", "0"],
                           stdout=w, stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(w)
    assert p.stderr == "" and p.returncode == 1


# -- issue 9: the error taxonomy at the boundary ---------------------------------

def test_internal_error_exits_3_with_a_hint(store, tmp_path):
    """A bug (any non-SwarmError exception, or InternalError) is not the
    user's fault: distinct exit status 3 and a traceback hint."""
    path, _, _ = store
    code = ("import sys; from swarmfs import _cli; from swarmfs.store import _store\n"
            "def boom(self, *a, **k): raise KeyError('bug')\n"
            "_store.Store.info = boom\n"
            f"sys.argv = ['swarmfs', 'info', {path!r}]\n"
            "_cli.main()")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 3, p.stderr
    assert "internal error" in p.stderr and "SWARMFS_DEBUG=1" in p.stderr
    assert "Traceback" not in p.stderr
    code2 = code.replace("raise KeyError('bug')",
                         "from swarmfs import _errors as E; raise E.InternalError('x')")
    p = subprocess.run([sys.executable, "-c", code2], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 3 and "internal error: x" in p.stderr


def test_tokens_option_refuses_empty_items(store):
    path, _, _ = store
    for bad in ("1,,2", ",", "1,x"):
        p = run("read", path, "--layer", "1", "--tokens", bad, ok=False)
        assert p.returncode == 2 and "--tokens" in p.stderr, bad


@pytest.mark.parametrize("value", ["nan", "2", "-0.1"])
def test_hot_fraction_out_of_range(tmp_path, value):
    p = run("build", str(tmp_path / "kv.safetensors"), str(tmp_path / "st"),
            "--hot-fraction", value, ok=False)
    assert p.returncode == 1 and "hot_fraction must be a number in [0, 1]" in p.stderr
    assert "Traceback" not in p.stderr


def test_out_to_a_device_names_the_path(store):
    path, _, _ = store
    p = run("read", path, "--layer", "1", "--cluster", "0", "--out", "/dev/full", ok=False)
    assert p.returncode == 2 and "/dev/full" in p.stderr and "not a regular file" in p.stderr


def test_out_on_a_full_disk_names_the_path(store, tmp_path):
    """ENOSPC while writing --out (injected): a DiskFullError naming the file."""
    path, _, _ = store
    out = str(tmp_path / "x.npy")
    code = ("import errno, sys, numpy as np; from swarmfs import _cli\n"
            "def full(f, a): raise OSError(errno.ENOSPC, 'No space left on device')\n"
            "np.save = full\n"
            f"sys.argv = ['swarmfs', 'read', {path!r}, '--layer', '1', '--cluster', '0', "
            f"'--out', {out!r}]\n"
            "_cli.main()")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 1 and out in p.stderr and "No space left" in p.stderr


def test_verify_lists_disk_problems_and_lost_tokens(store):
    path, kv, cl = store
    s = Store.open(path)
    p0 = s.disk_paths[0]
    s.close()
    os.truncate(p0, os.path.getsize(p0) - 2048)
    p = run("verify", path, ok=False)
    assert p.returncode == 1
    assert p.stdout.startswith("DISK 0 (") and "truncated" in p.stdout
    lines = [x for x in p.stdout.splitlines() if x.startswith("BAD")]
    assert lines and all("disk 0" in x and "offset" in x and "lost" in x for x in lines)
    assert "token(s) lost" in p.stderr


@pytest.mark.slow
def test_text_that_utf8_cannot_encode_is_printed_escaped(tmp_path, rng):
    """JSON may hold lone surrogates ("\\ud800"), and Store.create takes any
    str as model_name: every command that prints the store's text prints
    them escaped (info exited 3, 'internal error: UnicodeEncodeError')."""
    path = str(tmp_path / "st")
    with Store.create(path, disks=2, num_layers=1, num_kv_heads=2, head_dim=16,
                      model_name="m\ud800") as s:
        s.write_layer(0, random_kv(rng, 50, 2, 16, "float16"),
                      random_clusters(rng, 50, 5, 5), extra={"note": "\udcff"})
    for args in (["info", path], ["info", path, "--json"], ["verify", path],
                 ["verify", path, "--json"], ["read", path, "--layer", "0", "--cluster", "1"]):
        p = run(*args)
        assert "internal error" not in p.stderr
    assert "\\ud800" in run("info", path).stdout


def test_every_ranged_float_option_refuses_nan():
    """click's FloatRange lets NaN through (it compares false with both
    bounds): mount --poll-interval nan got past the range and the mount died
    with exit 3 ('internal error: ExceptionGroup ...')."""
    import click

    from swarmfs._cli import main
    ranged = [(name, p) for name, cmd in main.commands.items() for p in cmd.params
              if isinstance(p.type, click.FloatRange)]
    assert ranged
    for _name, p in ranged:
        with pytest.raises(click.BadParameter):
            p.type.convert("nan", p, None)


@pytest.mark.parametrize("args", [
    ["--poll-interval", "nan"], ["--poll-interval", "inf"], ["--readahead", "-5"]])
def test_mount_refuses_bad_numbers_before_mounting(store, tmp_path, args):
    path, kv, cl = store
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    p = run("mount", path, str(mnt), *args, ok=False)      # returns once mounted
    if os.path.ismount(mnt):
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], timeout=30)
        pytest.fail(f"mounted with {args}")
    assert p.returncode == 2 and "Invalid value" in p.stderr, p.stderr


def test_disks_zero_is_refused_not_replaced_by_the_default(tmp_path):
    """--disks 0 ran with 4 disks ('disks or 4'), while --disks -3 was
    refused."""
    pytest.importorskip("torch")
    prompt = tmp_path / "p.txt"
    prompt.write_text("def f(x):\n    return x + 1\n" * 20)
    for n in ("0", "-3"):
        p = run("generate", "--prompt-file", str(prompt), "--disks", n,
                "--max-new-tokens", "1", ok=False)
        assert p.returncode == 1 and "disks must be an integer in [1, 256]" in p.stderr, p.stderr
