"""LayerIndex: stored arrays are checked against each other and the disks'
allocated space before use (issue 9, item 4)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import random_clusters
from swarmfs import _errors as E
from swarmfs.store import _format as F
from swarmfs.store._index import LayerIndex, concat_ranges, union_ints, unique_ints
from swarmfs.store._placement import place_clusters


def _arrays(sizes=(3, 2, 4), ndisks=2, Eb=64, bs=512):
    sizes = np.array(sizes)
    C = len(sizes)
    ptr = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    members = np.arange(ptr[-1], dtype=np.int32) % 7
    pl = place_clusters(sizes, ndisks=ndisks, entry_bytes=Eb, block_size=bs,
                        disk_end=np.full(ndisks, F.DATA_START, np.uint64))
    a = dict(members_ptr=ptr, members=members, medoid=members[ptr[:-1]].copy(),
             start_disk=pl.start_disk.astype(np.int32), extent_off=pl.extent_off,
             extent_xxh=np.zeros((C, ndisks), np.uint64),
             token_xxh=np.zeros(7, np.uint64), medoid_keys=np.zeros((C, Eb // 2), np.uint8),
             hot=np.zeros(C, np.uint8), freq=np.zeros(C, np.float32))
    return a, pl


def _li(a, pl, free=None, ndisks=2):
    return LayerIndex(0, a, num_tokens=7, ndisks=ndisks, entry_bytes=64, block_size=512,
                      disk_end=[int(x) for x in pl.disk_end],
                      free=free or [[] for _ in range(ndisks)])


def test_a_consistent_index_loads():
    a, pl = _arrays()
    li = _li(a, pl)
    assert li.num_copies == 9 and li.counts.sum() == 9


@pytest.mark.parametrize("breaks,match", [
    (lambda a: a["extent_off"].__setitem__((0, 0), 0), "outside the disk"),
    (lambda a: a["extent_off"].__setitem__((2, 1), 1 << 40), "outside the disk"),
    (lambda a: a["extent_off"].__setitem__((1, 0), a["extent_off"][0, 0]), "overlap"),
    (lambda a: a["medoid"].__setitem__(0, 99), "medoid"),
    (lambda a: a["hot"].__setitem__(0, 7), "hot"),
    (lambda a: a["freq"].__setitem__(0, np.nan), "freq"),
    (lambda a: a.__setitem__("medoid_keys", np.zeros((3, 31), np.uint8)), "medoid_keys"),
    (lambda a: a["start_disk"].__setitem__(1, 5), "start disk"),
    (lambda a: a["members"].__setitem__(0, 50), "member token"),
    (lambda a: a["members_ptr"].__setitem__(1, 0), "pointers"),
])
def test_inconsistent_arrays_are_a_manifest_error(breaks, match):
    a, pl = _arrays()
    breaks(a)
    with pytest.raises(E.ManifestError, match=match):
        _li(a, pl)


def test_an_extent_inside_a_free_range_is_refused():
    a, pl = _arrays()
    off = int(a["extent_off"][1, 0])
    with pytest.raises(E.ManifestError, match="free") as ei:
        _li(a, pl, free=[[[off, 512, 0]], []])
    assert ei.value.cluster == 1 and ei.value.disk == 0
    end = int(pl.disk_end[0])
    _li(a, pl, free=[[[end, 512, 0]], []])     # free space past the data is fine


def test_lookups_raise_only_swarm_errors():
    a, pl = _arrays()
    li = _li(a, pl)
    for bad in (1.5, "x", None, -1, 99):
        with pytest.raises(E.SwarmError):
            li.check_cluster(bad)
    for bad in ([1.5], ["x"], [99], [-1], [[None]]):
        with pytest.raises(E.SwarmError):
            li.check_tokens(bad)
    with pytest.raises(E.SwarmError):
        concat_ranges([1, 2], [1])
    assert concat_ranges([5, 0], [2, 1]).tolist() == [5, 6, 0]


# -- CSR invariants (hypothesis) ----------------------------------------------------

@settings(max_examples=80, deadline=None)
@given(st.integers(1, 16), st.integers(1, 6), st.integers(16, 60), st.integers(0, 40),
       st.integers(0, 2**31))
def test_csr_lookups_agree_with_the_cluster_table(C, N, S, extra, seed):
    """Per copy: its cluster, slot, disk (round-robin from the start disk) and
    byte offset (its extent's offset + slot // N entries); per token: exactly
    the copies that hold it; per cluster: its entries per disk sum to its size."""
    rng = np.random.default_rng(seed)
    Eb, bs = 64, 512
    clusters = random_clusters(rng, S, C, extra)        # every token, some replicated
    sizes = np.array([len(c) for c in clusters])
    ptr = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    members = np.concatenate(clusters).astype(np.int32)
    pl = place_clusters(sizes, ndisks=N, entry_bytes=Eb, block_size=bs,
                        disk_end=np.full(N, F.DATA_START, np.uint64))
    a = dict(members_ptr=ptr, members=members, medoid=members[ptr[:-1]].copy(),
             start_disk=pl.start_disk.astype(np.int32), extent_off=pl.extent_off,
             extent_xxh=np.zeros((C, N), np.uint64), token_xxh=np.zeros(S, np.uint64),
             medoid_keys=np.zeros((C, Eb // 2), np.uint8), hot=np.zeros(C, np.uint8),
             freq=np.zeros(C, np.float32))
    li = LayerIndex(0, a, num_tokens=S, ndisks=N, entry_bytes=Eb, block_size=bs,
                    disk_end=[int(x) for x in pl.disk_end], free=[[] for _ in range(N)])
    M = int(ptr[-1])
    assert li.num_copies == M and li.num_clusters == C and li.replication == M / S
    cl = np.repeat(np.arange(C), sizes)
    slot = np.arange(M) - ptr[cl]
    assert np.array_equal(li.copy_cluster, cl) and np.array_equal(li.copy_slot, slot)
    disk = (a["start_disk"][cl] + slot) % N
    assert np.array_equal(li.copy_disk, disk)
    assert np.array_equal(li.copy_off.astype(np.int64),
                          a["extent_off"][cl, disk].astype(np.int64) + (slot // N) * Eb)
    # entries per cluster per disk: round-robin, summing to the cluster's size
    assert np.array_equal(li.counts.sum(axis=1), sizes)
    for c in range(C):
        want = np.bincount(disk[cl == c], minlength=N)
        assert np.array_equal(li.counts[c], want)
        assert li.counts[c].max() - li.counts[c].min() <= 1
        assert np.array_equal(li.cluster_copies([c]), np.arange(ptr[c], ptr[c + 1]))
    # no two copies share a byte of the same disk
    key = li.copy_disk.astype(np.int64) * (1 << 40) + li.copy_off.astype(np.int64)
    assert np.unique(key).shape[0] == M
    # token -> copies is the inverse of copy -> token
    assert li.tok_ptr[0] == 0 and li.tok_ptr[-1] == M and (np.diff(li.tok_ptr) >= 0).all()
    assert np.array_equal(np.sort(li.tok_copy), np.arange(M))
    for t in range(S):
        copies = li.tok_copy[li.tok_ptr[t]:li.tok_ptr[t + 1]]
        assert np.array_equal(np.sort(copies), np.flatnonzero(members == t))
    toks = rng.integers(0, S, 5)
    got = li.token_copies(toks)
    assert np.array_equal(np.sort(got), np.sort(np.concatenate(
        [np.flatnonzero(members == t) for t in toks])))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-2**62, 2**62), max_size=300),
       st.lists(st.integers(-5, 5), max_size=40),
       st.sampled_from([np.int64, np.int32, np.uint64, np.int16, np.uint8]))
def test_unique_and_union_ints_equal_numpys(a, b, dtype):
    """unique_ints / union_ints (the decode step's sort-based distinct values)
    return exactly np.unique / np.union1d: values, order, dtype and shape,
    for empty, single, repeated, negative and extreme inputs of each int dtype."""
    info = np.iinfo(dtype)
    x = np.array([v for v in a if info.min <= v <= info.max], dtype=dtype)
    y = np.array([v for v in b if info.min <= v <= info.max], dtype=dtype)
    for got, want in ((unique_ints(x), np.unique(x)), (unique_ints(y), np.unique(y)),
                      (union_ints(x, y), np.union1d(x, y)),
                      (unique_ints(np.concatenate([x, x])), np.unique(x)),
                      (unique_ints(x.reshape(-1, 1)), np.unique(x.reshape(-1, 1)))):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.array_equal(got, want)
