"""Writing: non-finite values refused, free-space allocation (issue 9, items 11, 13)."""

import numpy as np
import pytest

from swarmfs import _errors as E
from swarmfs._write import allocate, check_finite, free_extents


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_check_finite_names_token_k_or_v_and_head(dtype):
    x = np.zeros((5, 2, 3, 4), dtype)
    check_finite(x.reshape(5, -1).view(np.uint8), dtype, (2, 3, 4))
    x[3, 1, 2, 1] = np.inf
    with pytest.raises(E.ShapeError, match="V of token 13 .KV head 2."):
        check_finite(x.reshape(5, -1).view(np.uint8), dtype, (2, 3, 4), first_token=10)
    x[3, 1, 2, 1] = 0
    x[0, 0, 0, 0] = np.nan
    with pytest.raises(E.ShapeError, match="K of token 0 .KV head 0."):
        check_finite(x.reshape(5, -1).view(np.uint8), dtype, (2, 3, 4))


def test_check_finite_bfloat16_bit_patterns():
    ml = pytest.importorskip("ml_dtypes")
    x = np.ones((2, 2, 1, 2), ml.bfloat16)
    x[1, 0, 0, 1] = np.float32("nan")
    with pytest.raises(E.ShapeError, match="token 1"):
        check_finite(x.reshape(2, -1).view(np.uint8), "bfloat16", (2, 1, 2))
    big = np.array([3.0e38], np.float32).astype(ml.bfloat16)   # finite, large
    y = np.full((1, 2, 1, 2), big[0], ml.bfloat16)
    check_finite(y.reshape(1, -1).view(np.uint8), "bfloat16", (2, 1, 2))


def _disk(end, free=()):
    return {"index": 0, "path": "d", "end": end, "capacity": 0, "free": [list(r) for r in free]}


def test_allocate_best_fit_then_end():
    disks = [_disk(100 << 10, [[12288, 4096, 0], [20480, 8192, 0], [40960, 2048, 0]])]
    base, out = allocate(disks, np.array([2048], np.uint64), gen=5)
    assert int(base[0]) == 40960 and out[0]["free"] == [[12288, 4096, 0], [20480, 8192, 0]]
    base, out = allocate(disks, np.array([16384], np.uint64), gen=5)
    assert int(base[0]) == 100 << 10 and out[0]["end"] == (100 << 10) + 16384


def test_allocate_respects_quarantine_and_readers():
    disks = [_disk(1 << 20, [[12288, 8192, 5]])]
    assert int(allocate(disks, np.array([4096], np.uint64), gen=6)[0][0]) == 1 << 20
    assert int(allocate(disks, np.array([4096], np.uint64), gen=7)[0][0]) == 12288
    # a reader still at generation 4 may read what commit 5 freed
    assert int(allocate(disks, np.array([4096], np.uint64), gen=9,
                        oldest_reader=4)[0][0]) == 1 << 20
    assert int(allocate(disks, np.array([4096], np.uint64), gen=9,
                        oldest_reader=5)[0][0]) == 12288


def test_free_extents_merges_and_gives_back_the_tail():
    disks = [_disk(65536, [[12288, 4096, 1]])]
    out = free_extents(disks, [0, 1], [0, 0], [16384, 61440], [4000, 4096], gen=3,
                       block_size=512)
    # [12288, 4096] is reusable at 3 (gen 0), [16384, 4096] just freed (3): not merged
    assert out[0]["free"] == [[12288, 4096, 0], [16384, 4096, 3], [61440, 4096, 3]]
    assert out[0]["end"] == 65536            # the tail range is still in quarantine
    out = free_extents(out, [], [], [], [], gen=5, block_size=512)
    assert out[0]["free"] == [[12288, 8192, 0]] and out[0]["end"] == 61440
    out = free_extents([_disk(65536, [[61440, 4096, 0]])], [], [], [], [], gen=5,
                       block_size=512)
    assert out[0]["free"] == [] and out[0]["end"] == 61440
