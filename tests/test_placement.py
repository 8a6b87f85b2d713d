"""Eq. 7 placement (SWARM §5.2) on hand-checked examples."""

import numpy as np

from swarmfs.store._placement import copy_locations, place_clusters, start_disks, stripe_counts


def test_eq7_start_disks_hand_checked():
    # p_global: 0 -> C0 starts at disk 0; p = 3 -> C1 at 3; p = 8 -> C2 at 0;
    # p = 10 -> C3 at 2; p ends at 14.
    start, p = start_disks([3, 5, 2, 4], ndisks=4)
    assert list(start) == [0, 3, 0, 2] and p == 14
    start, p = start_disks([3, 5], ndisks=4, p_global=14)
    assert list(start) == [2, 1] and p == 22


def test_round_robin_counts():
    counts = stripe_counts([3, 5, 2, 4], [0, 3, 0, 2], 4)
    assert counts.tolist() == [[1, 1, 1, 0], [1, 1, 1, 2], [1, 1, 0, 0], [1, 1, 1, 1]]


def test_extents_are_contiguous_and_aligned():
    E, B = 1536, 512
    pl = place_clusters([3, 5, 2, 4], ndisks=4, entry_bytes=E, block_size=B,
                        disk_end=np.full(4, 4096, dtype=np.uint64))
    # disk 3 holds 0 + 2 + 0 + 1 entries: C1's extent at 4096 (2 entries), C3's next
    assert pl.extent_off[1, 3] == 4096 and pl.extent_bytes[1, 3] == 2 * E
    assert pl.extent_off[3, 3] == 4096 + 2 * E
    assert (pl.extent_off % B == 0).all() and (pl.extent_bytes % B == 0).all()
    assert list(pl.disk_end) == [4096 + 4 * E, 4096 + 4 * E, 4096 + 3 * E, 4096 + 3 * E]
    # entry j of cluster 1 (start 3) is on disk (3 + j) % 4 at slot j // 4
    ptr = np.array([0, 3, 8, 10, 14])
    cluster, disk, off = copy_locations(ptr, pl.start_disk, pl.extent_off, ndisks=4,
                                        entry_bytes=E)
    c1 = slice(3, 8)
    assert list(disk[c1]) == [3, 0, 1, 2, 3]
    assert off[7] == pl.extent_off[1, 3] + E  # 5th entry: second slot on disk 3
    assert list(cluster) == [0] * 3 + [1] * 5 + [2] * 2 + [3] * 4


def test_padding_to_block_size():
    pl = place_clusters([3], ndisks=1, entry_bytes=100, block_size=512,
                        disk_end=np.array([4096], dtype=np.uint64))
    assert pl.extent_bytes[0, 0] == 512 and pl.disk_end[0] == 4608


def test_no_balance_placement_starts_every_cluster_at_disk_0():
    pl = place_clusters([3, 5, 2, 4], ndisks=4, entry_bytes=512, block_size=512,
                        disk_end=np.full(4, 4096, dtype=np.uint64), policy="disk0")
    assert list(pl.start_disk) == [0, 0, 0, 0]
    assert pl.counts[:, 0].tolist() == [1, 2, 1, 1]


def test_bad_arguments_are_invalid_argument_errors():
    """Issue 9 item 15: placement raises only SwarmError subclasses."""
    import pytest

    from swarmfs import _errors as E
    for call in (lambda: place_clusters([3], ndisks=2, entry_bytes=8, block_size=512,
                                        disk_end=[0, 0], policy="x"),
                 lambda: place_clusters([-1], ndisks=2, entry_bytes=8, block_size=512,
                                        disk_end=[0, 0]),
                 lambda: place_clusters([3], ndisks=0, entry_bytes=8, block_size=512,
                                        disk_end=[]),
                 lambda: place_clusters([3], ndisks=2, entry_bytes=8, block_size=500,
                                        disk_end=[0, 0]),
                 lambda: place_clusters([3], ndisks=2, entry_bytes=8, block_size=512,
                                        disk_end=[0]),
                 lambda: place_clusters([3], ndisks=2, entry_bytes=8, block_size=512,
                                        disk_end=[0, 0], start=[7]),
                 lambda: start_disks([1.5], 2),
                 lambda: stripe_counts([1, 2], [0], 2)):
        with pytest.raises(E.InvalidArgumentError):
            call()
