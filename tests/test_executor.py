"""The executor (swarmfs/_executor.py): a plan in one batched submission,
per-entry checksums, damage location, the staging pool (issue 12)."""

import os

import numpy as np
import pytest

from swarmfs import Store
from swarmfs import _errors as E
from swarmfs.store._executor import COUNTERS, Executor
from swarmfs.store._planner import plan_reads


@pytest.fixture
def st(tmp_path):
    s = Store.create(tmp_path / "st", disks=3, num_layers=1, num_kv_heads=2, head_dim=8,
                     dtype="float32")
    kv = np.random.default_rng(1).standard_normal((60, 2, 2, 8)).astype(np.float32)
    s.write_layer(0, kv, np.array_split(np.arange(60), 6))
    yield s, kv
    s.close()


def _executor(s):
    ex = s._executor
    assert isinstance(ex, Executor)
    return ex


def test_execute_returns_the_planned_rows_in_order_and_counts(st):
    s, kv = st
    ex = _executor(s)
    li = s.layer(0)
    toks = np.array([41, 3, 3, 17, 59])
    copies = li.token_copies(np.unique(toks))
    plan = plan_reads(li.members[copies], li.copy_disk[copies], li.copy_off[copies],
                      ndisks=3, entry_bytes=s.entry_bytes, block_size=s.block_size)
    before = ex.counters()
    rows = ex.execute(li, plan, copies, verify=True, order=np.searchsorted(plan.tokens, toks))
    assert rows.tobytes() == kv[toks].tobytes()
    after = ex.counters()
    assert set(after) == set(COUNTERS)
    assert after["entries_returned"] - before["entries_returned"] == 5
    assert after["bytes_returned"] - before["bytes_returned"] == 5 * s.entry_bytes
    assert after["bytes_read"] - before["bytes_read"] == plan.staging_bytes
    assert s.stats().entries_returned == after["entries_returned"]


def test_a_flipped_byte_is_a_checksum_error_unless_verify_is_off(st):
    s, kv = st
    li = s.layer(0)
    c = int(li.token_copies(np.array([10]))[0])
    d, off = int(li.copy_disk[c]), int(li.copy_off[c])
    with open(s.disk_paths[d], "r+b") as f:
        f.seek(off + 5)
        b = f.read(1)
        f.seek(off + 5)
        f.write(bytes([b[0] ^ 0xFF]))
    s2 = Store.open(s.path)
    with pytest.raises(E.ChecksumError) as ei:
        s2.read_entries(0, [10])
    assert (ei.value.disk, ei.value.offset, ei.value.layer) == (d, off, 0)
    assert ei.value.cluster == int(li.copy_cluster[c])
    assert s2.stats().checksum_failures == 1
    got = s2.read_entries(0, [10], verify=False)
    assert got.tobytes() != kv[10].tobytes()                 # the damage, unverified
    s2.close()


def test_verify_layer_reports_the_damaged_entry(st):
    s, _ = st
    li = s.layer(0)
    c = int(li.token_copies(np.array([33]))[0])
    d, off = int(li.copy_disk[c]), int(li.copy_off[c])
    fd = os.open(s.disk_paths[d], os.O_WRONLY)
    os.pwrite(fd, b"\0" * s.entry_bytes, off)
    os.close(fd)
    out = s.verify()
    assert len(out) == 1
    r = out[0]
    assert (r["disk"], r["offset"], r["tokens"], r["lost"]) == (d, off, [33], [33])


def test_staging_buffers_are_pooled(st):
    s, _ = st
    ex = Executor(s.engine, [], path=s.path, disk_paths=[], entry_bytes=s.entry_bytes,
                  block_size=s.block_size)
    with ex.staging(1000) as a:
        assert a.size >= 1 << 20
    with ex.staging(4096) as b:          # the same (>= 1 MiB) buffer again
        assert b is a
        with ex.staging(10) as c:        # in use: a second one
            assert c is not a
    with ex.staging(3 << 20) as d:       # larger than any pooled buffer: a new one
        assert d is not a and d is not c and d.size >= 3 << 20
    ex.close()
