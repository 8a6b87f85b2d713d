"""Properties of the pure read planner (SWARM §6.1, eq. 8)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmfs import plan_reads


def simulate(plan, disks_mem):
    """Execute a plan against in-memory disk images (no I/O): staging buffer."""
    buf = np.zeros(plan.staging_bytes, dtype=np.uint8)
    for d, o, n, t in zip(plan.disk, plan.offset, plan.length, plan.dst):
        buf[t:t + n] = disks_mem[d][o:o + n]
    return buf


@st.composite
def layouts(draw):
    """Random copies of tokens on disks: each token has 1..ndisks copies at
    distinct slots; entry size and block size vary."""
    ndisks = draw(st.integers(1, 6))
    ntok = draw(st.integers(1, 60))
    E = draw(st.sampled_from([64, 96, 512, 1536, 4096]))
    bs = draw(st.sampled_from([512, 4096]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    copies = rng.integers(1, ndisks + 1, size=ntok)
    tok = np.repeat(np.arange(ntok), copies)
    disk = np.concatenate([rng.choice(ndisks, size=c, replace=False) for c in copies])
    # slots: per disk, a random permutation of positions (some gaps)
    off = np.zeros(tok.shape[0], dtype=np.uint64)
    for d in range(ndisks):
        idx = np.flatnonzero(disk == d)
        slots = rng.choice(len(idx) * 2 + 1, size=len(idx), replace=False)
        off[idx] = 4096 + slots.astype(np.uint64) * np.uint64(E)
    want = draw(st.lists(st.integers(0, ntok - 1), min_size=1, max_size=80))
    gap = draw(st.sampled_from([0, 0, E, 4 * E]))
    return ndisks, E, bs, tok, disk, off, np.array(want), gap


def build_disks(ndisks, E, tok, disk, off, rows):
    size = int(off.max()) + E + 8192 if off.size else 8192
    mem = [np.zeros(size, dtype=np.uint8) for _ in range(ndisks)]
    for t, d, o in zip(tok, disk, off):
        mem[d][o:o + E] = rows[t]
    return mem


@settings(max_examples=150, deadline=None)
@given(layouts(), st.sampled_from(["balanced", "first"]))
def test_plan_reads_every_wanted_entry_once_and_correctly(layout, policy):
    ndisks, E, bs, tok, disk, off, want, gap = layout
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 256, size=(tok.max() + 1, E), dtype=np.uint8)
    mem = build_disks(ndisks, E, tok, disk, off, rows)
    sel = np.isin(tok, want)
    plan = plan_reads(tok[sel], disk[sel], off[sel], ndisks=ndisks, entry_bytes=E,
                      block_size=bs, max_gap=gap, policy=policy)
    # dedup: each wanted token exactly once, sorted
    assert list(plan.tokens) == sorted(set(want.tolist()))
    # requests are block aligned, per disk non-overlapping
    assert (plan.offset % bs == 0).all() and (plan.length % bs == 0).all()
    for d in range(ndisks):
        m = plan.disk == d
        o, n = plan.offset[m], plan.length[m].astype(np.uint64)
        order = np.argsort(o)
        assert (o[order][1:] >= (o + n)[order][:-1]).all()
    # staging layout is contiguous
    assert plan.staging_bytes == int(plan.length.sum())
    # the bytes at src are the entries' bytes
    buf = simulate(plan, mem)
    for t, s in zip(plan.tokens, plan.src):
        assert (buf[s:s + E] == rows[t]).all()
    # the chosen copy is a copy of that token
    assert (tok[sel][plan.copy] == plan.tokens).all()
    assert plan.disk_entries.sum() == plan.tokens.shape[0]
    # no more requests than entries
    assert plan.num_requests <= plan.num_entries


def test_no_dedup_reads_every_copy():
    tok = np.array([0, 0, 1, 1, 1])
    disk = np.array([0, 1, 0, 1, 2])
    off = np.array([4096, 4096, 8192, 8192, 4096], dtype=np.uint64)
    plan = plan_reads(tok, disk, off, ndisks=3, entry_bytes=4096, block_size=4096,
                      dedup=False)
    assert plan.num_entries == 5 and plan.num_requests == 3  # adjacent copies coalesce
    assert plan.disk_bytes.sum() == 5 * 4096


def test_balance_when_every_entry_is_everywhere():
    """Fully replicated entries spread evenly: bucket sizes differ by <= 1."""
    n, N = 1001, 4
    tok = np.repeat(np.arange(n), N)
    disk = np.tile(np.arange(N), n)
    off = (tok * 4096 + 4096).astype(np.uint64)
    plan = plan_reads(tok, disk, off, ndisks=N, entry_bytes=4096, block_size=4096)
    assert plan.disk_entries.max() - plan.disk_entries.min() <= 1


def test_single_copy_entries_go_to_their_disk_first():
    """Single-copy entries fill their buckets before replicated ones choose."""
    # tokens 0..5 only on disk 0; tokens 6..9 on disk 0 or 1
    tok = np.array([0, 1, 2, 3, 4, 5, 6, 6, 7, 7, 8, 8, 9, 9])
    disk = np.array([0] * 6 + [0, 1] * 4)
    off = np.arange(tok.shape[0], dtype=np.uint64) * 4096
    plan = plan_reads(tok, disk, off, ndisks=2, entry_bytes=4096, block_size=4096)
    assert list(plan.disk_entries) == [6, 4]
    static = plan_reads(tok, disk, off, ndisks=2, entry_bytes=4096, block_size=4096,
                        policy="first")
    assert list(static.disk_entries) == [10, 0]


def test_adjacent_entries_coalesce_and_requests_interleave():
    E = 4096
    # disk 0: 10 adjacent entries; disk 1: 10 entries with one-entry gaps
    tok = np.arange(20)
    disk = np.array([0] * 10 + [1] * 10)
    off = np.concatenate([np.arange(10) * E, np.arange(10) * 2 * E]).astype(np.uint64)
    plan = plan_reads(tok, disk, off, ndisks=2, entry_bytes=E, block_size=4096)
    assert (plan.disk == 0).sum() == 1 and (plan.disk == 1).sum() == 10
    assert list(plan.disk[:2]) == [0, 1]  # round-robin: head of each bucket first
    gapped = plan_reads(tok, disk, off, ndisks=2, entry_bytes=E, block_size=4096,
                        max_gap=E)
    assert gapped.num_requests == 2
    capped = plan_reads(tok, disk, off, ndisks=2, entry_bytes=E, block_size=4096,
                        max_request=4 * E)
    assert (capped.disk == 0).sum() == 3


def test_small_entries_sharing_a_block_merge():
    E = 128
    tok = np.arange(4)
    disk = np.zeros(4, dtype=int)
    off = np.array([0, 256, 1024, 1152], dtype=np.uint64)  # two pairs in one block each
    plan = plan_reads(tok, disk, off, ndisks=1, entry_bytes=E, block_size=512)
    assert plan.num_requests == 2
    plan4k = plan_reads(tok, disk, off, ndisks=1, entry_bytes=E, block_size=4096)
    assert plan4k.num_requests == 1 and plan4k.staging_bytes == 4096


def test_bad_arguments():
    with pytest.raises(ValueError):
        plan_reads([0], [0], [0], ndisks=1, entry_bytes=512, block_size=512, policy="x")
    with pytest.raises(ValueError):
        plan_reads([0], [0, 1], [0], ndisks=1, entry_bytes=512, block_size=512)
    empty = plan_reads([], [], [], ndisks=2, entry_bytes=512, block_size=512)
    assert empty.num_requests == 0 and empty.staging_bytes == 0


def test_bad_plan_arguments_are_invalid_argument_errors():
    from swarmfs._errors import InvalidArgumentError
    ok = dict(ndisks=2, entry_bytes=64, block_size=512)
    tok, disk, off = np.array([0, 1]), np.array([0, 1]), np.array([0, 64], np.uint64)
    for args, kw in (((tok, disk, off[:1]), {}),                            # lengths
                     ((tok, np.array([0, 2]), off), {}),                     # disk 2 of 2
                     ((tok, np.array([0, -1]), off), {}),
                     ((tok, disk, np.array([0, -64])), {}),                  # negative offset
                     ((np.array([0.0, 1.0]), disk, off), {}),                # float tokens
                     ((tok, disk, off), {"block_size": 300}),
                     ((tok, disk, off), {"ndisks": 0}),
                     ((tok, disk, off), {"entry_bytes": 1.5}),
                     ((tok, disk, off), {"max_request": 0}),
                     ((tok, disk, off), {"max_gap": -1})):
        with pytest.raises(InvalidArgumentError):
            plan_reads(*args, **{**ok, **kw})
