"""Reads that land where attention reads them (issue 26): a retrieval into an
EntryBuffer returns the same entries, byte for byte, as the gather path into
K/V [H_kv, n, d], on both engines, whether the reads land in place (entries a
block multiple) or are staged; checksums stay verified; bad inputs are
refused before any read."""

import numpy as np
import pytest

from conftest import random_layer_store, same_bits
from swarmfs import EntryBuffer, Retriever, Store
from swarmfs import _errors as E
from swarmfs.decode._online import DecodeSession

ENGINES = ["io_uring", "threads"]
# (H_kv, head_dim): 4096-byte fp16 entries (block multiples: read in place),
# and 128-byte entries (staged, then copied as rows)
SHAPES = [(8, 128), (2, 16)]


def _store(tmp_path, rng, shape, engine, name="st"):
    H, D = shape
    s, kv, cl = random_layer_store(tmp_path / name, rng, S=1200, H=H, HQ=2 * H, D=D,
                                   disks=3, clusters=60, extra_copies=150, hot=[2, 9],
                                   local_window=32)
    s.close()
    return Store.open(tmp_path / name, engine=engine), kv


def _sorted(ret):
    order = np.argsort(ret.positions, kind="stable")
    return ret.positions[order], np.ascontiguousarray(ret.k[:, order]), \
        np.ascontiguousarray(ret.v[:, order])


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("shape", SHAPES, ids=["block-multiple", "staged"])
def test_entry_buffer_retrieval_equals_the_gather_path(tmp_path, rng, engine, shape):
    s, kv = _store(tmp_path, rng, shape, engine)
    H, D = shape
    try:
        r = Retriever(s, ratio=0.3)
        eb = r.entry_buffer(s.layer(0).num_tokens)
        assert isinstance(eb, EntryBuffer) and eb.rows.shape == (1200, s.entry_bytes)
        assert eb.rows.ctypes.data % s.block_size == 0
        for _ in range(4):
            q = rng.standard_normal((2 * H, D)).astype(np.float32)
            old = r.retrieve(0, q, torch=False)                 # the gather path
            new = r.retrieve(0, q, torch=False, out=eb)
            assert new.stats.entries_ssd > 0 and new.stats.entries_dram > 0
            assert np.array_equal(new.clusters, old.clusters)
            pos, k, v = _sorted(new)
            assert np.array_equal(pos, old.positions)
            assert same_bits(k, old.k) and same_bits(v, old.v)
            assert same_bits(k, kv[pos][:, 0].transpose(1, 0, 2))
            # K and V are views of the buffer; rows are the stored entries
            assert np.shares_memory(new.k, eb.rows) and np.shares_memory(new.v, eb.rows)
            assert new.entry_rows.base is not None
            assert same_bits(new.entry_rows, kv[new.positions].reshape(len(pos), -1).view(np.uint8))
            idx = np.array([0, len(pos) - 1, len(pos) // 2])
            assert same_bits(new.rows_of(idx), old.rows_of(old.find(new.positions[idx])))
            assert np.array_equal(new.find(new.positions), np.arange(len(pos)))
            assert new.find(np.array([-5, 10**9])).tolist() == [-1, -1]
        assert s.stats().checksum_failures == 0
    finally:
        s.close()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("shape", SHAPES, ids=["block-multiple", "staged"])
def test_a_flipped_byte_fails_the_checksum_on_the_entry_buffer_path(tmp_path, rng, engine,
                                                                    shape):
    s, kv = _store(tmp_path, rng, shape, engine)
    H, D = shape
    li = s.layer(0)
    r = Retriever(s, ratio=1.0)                # every entry: the damaged one is read
    q = rng.standard_normal((2 * H, D)).astype(np.float32)
    eb = r.entry_buffer(li.num_copies)
    base = r.retrieve(0, q, torch=False, out=eb)
    ssd = np.setdiff1d(np.arange(li.num_tokens), np.flatnonzero(r.layer_state(0).resident))
    tok = int(ssd[len(ssd) // 2])
    c = int(li.token_copies(np.array([tok]))[0])
    d, off = int(li.copy_disk[c]), int(li.copy_off[c])
    s.close()
    with open(Store.open(tmp_path / "st").disk_paths[d], "r+b") as f:
        f.seek(off + 3)
        b = f.read(1)
        f.seek(off + 3)
        f.write(bytes([b[0] ^ 0x10]))
    assert base.positions.size == li.num_tokens
    with Store.open(tmp_path / "st", engine=engine) as s2:
        r2 = Retriever(s2, ratio=1.0)
        with pytest.raises(E.ChecksumError) as ei:
            r2.retrieve(0, q, torch=False, out=r2.entry_buffer(li.num_copies))
        assert ei.value.disk == d and ei.value.layer == 0
        assert s2.stats().checksum_failures >= 1
    with Store.open(tmp_path / "st", engine=engine, verify=False) as s3:
        r3 = Retriever(s3, ratio=1.0)
        got = r3.retrieve(0, q, torch=False, out=r3.entry_buffer(li.num_copies))
        at = got.find(np.array([tok]))[0]
        assert not same_bits(got.entry_rows[at], kv[tok].reshape(-1).view(np.uint8))   # the damage


def test_bad_entry_buffers_are_refused_before_any_read(tmp_path, rng):
    s, _ = _store(tmp_path, rng, SHAPES[1], "io_uring")
    s2, _ = _store(tmp_path, rng, SHAPES[0], "io_uring", name="other")
    try:
        r = Retriever(s, ratio=0.5)
        q = rng.standard_normal((4, 16)).astype(np.float32)
        for bad in (0, -1, 2.5, True, "8", None):
            with pytest.raises(E.InvalidArgumentError):
                r.entry_buffer(bad)
        small = r.entry_buffer(10)
        r.layer_state(0)                       # the hot set is loaded once, first
        before = s.stats().bytes_read
        with pytest.raises(E.InvalidArgumentError, match="holds 10 entries"):
            r.retrieve(0, q, torch=False, out=small)
        foreign = Retriever(s2).entry_buffer(2000)
        with pytest.raises(E.InvalidArgumentError, match="not of this store"):
            r.retrieve(0, q, torch=False, out=foreign)
        assert s.stats().bytes_read == before
        with pytest.raises(E.InvalidArgumentError):
            EntryBuffer(np.zeros(4096, np.uint8), s.entry_bytes, 4)
        li = s.layer(0)
        copies = li.token_copies(np.arange(5))
        from swarmfs.store._planner import plan_reads
        plan = plan_reads(li.members[copies], li.copy_disk[copies], li.copy_off[copies],
                          ndisks=s.num_disks, entry_bytes=s.entry_bytes,
                          block_size=s.block_size)
        buf = s.engine.alloc(5 * s.entry_bytes)
        for into, what in [((buf,), "pair"), ((np.zeros(1 << 12, np.uint8), 0), "Engine.alloc"),
                           ((buf, -1), "base"), ((buf, 1.5), "base"),
                           ((buf, buf.size - s.entry_bytes), "need"),
                           ((s2.engine.alloc(4096), 0), "another engine")]:
            with pytest.raises(E.InvalidArgumentError, match=what):
                s.execute(li, plan, copies, into=into)
        where = s.execute(li, plan, copies, into=(buf, 0))
        assert sorted(where.tolist()) == [i * s.entry_bytes for i in range(5)]
    finally:
        s.close()
        s2.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_session_steps_in_place_equal_steps_that_copy(tmp_path, engine):
    """DecodeSession(reuse_outputs=True) lands in its EntryBuffer (4 KiB
    entries: read in place); its steps' K/V, sorted by position, are the
    copying session's, across appends and flushes, on both engines."""
    H, D = SHAPES[0]
    outs = {}
    for reuse in (False, True):
        r2 = np.random.default_rng(11)
        s, _, _ = random_layer_store(tmp_path / f"st{reuse}", r2, S=600, H=H, HQ=2 * H, D=D,
                                     disks=3, clusters=40, extra_copies=60, hot=[1],
                                     local_window=16)
        s.close()
        s = Store.open(tmp_path / f"st{reuse}", engine=engine, writable=True)
        sess = DecodeSession(Retriever(s, ratio=0.2), 0, window=8, flush_batch=4,
                             reuse_outputs=reuse)
        res = []
        for _ in range(20):
            q = r2.standard_normal((2 * H, D)).astype(np.float32)
            kv = r2.standard_normal((2, H, D)).astype(np.float16)
            x = sess.step(q, kv[0], kv[1], include_new=True)
            if reuse:
                assert np.shares_memory(x.k, sess._eb.rows)
            o = np.argsort(x.positions, kind="stable")
            res.append((x.positions[o], np.ascontiguousarray(x.k[:, o]),
                        np.ascontiguousarray(x.v[:, o]), x.flushed))
        outs[reuse] = res
        s.close()
    assert any(r[3].size for r in outs[True])                   # flushes happened
    for t, (a, b) in enumerate(zip(outs[False], outs[True], strict=True)):
        for u, w in zip(a, b, strict=True):
            assert same_bits(u, w), t


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("shape", SHAPES, ids=["block-multiple", "staged"])
def test_threads_with_their_own_entry_buffers_get_the_stored_bytes(tmp_path, rng, engine,
                                                                   shape):
    """The contract: any number of threads retrieve at once, each into its
    own EntryBuffer (stress: every row compared), in place and through the
    shared staging buffers, on both engines; a retrieval into a buffer
    another one is landing in is refused (ConcurrentUseError) and changes
    nothing in it."""
    import threading
    s, kv = _store(tmp_path, rng, shape, engine)
    H, D = shape
    r = Retriever(s, ratio=0.2)
    qs = rng.standard_normal((4, 12, 2 * H, D)).astype(np.float32)
    bad = []

    def run(i):
        eb = r.entry_buffer(1200)
        for q in qs[i]:
            x = r.retrieve(0, q, torch=False, out=eb)
            if not same_bits(x.entry_rows, kv[x.positions].reshape(len(x.positions), -1)
                             .view(np.uint8)):
                bad.append(i)
    try:
        ts = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not bad
        eb = r.entry_buffer(1200)
        first = r.retrieve(0, qs[0, 0], torch=False, out=eb)
        snap = eb.rows.copy()
        with eb._busy, pytest.raises(E.ConcurrentUseError) as ei:   # one is landing in it
            r.retrieve(0, qs[0, 1], torch=False, out=eb)
        assert ei.value.layer == 0
        assert same_bits(eb.rows, snap) and first.positions.size
    finally:
        s.close()
