"""The C data kernels' wrappers (``swarmfs._kernels``): results, and bad
arguments refused with InvalidArgumentError before C touches memory."""

import numpy as np
import pytest

from swarmfs._errors import InvalidArgumentError
from swarmfs._kernels import (assign_buckets, gather_rows, gemv_half, head_logits_half,
                              scatter_rows, softmax_sum, verify_rows, xxh3_ranges, xxh3_rows)


def test_bad_arguments_are_invalid_argument_errors(rng):
    buf = rng.integers(0, 255, 4096, dtype=np.uint8)
    off = np.arange(0, 4096, 64, dtype=np.uint64)
    bad = [
        lambda: gather_rows(buf, off, 0),                                    # row 0
        lambda: gather_rows(buf, off + np.uint64(4000), 64),                 # outside src
        lambda: gather_rows(buf, off, 64, out=np.empty((3, 64), np.uint8)),  # short out
        lambda: gather_rows(buf, [0.5, 1.0], 64),                           # float offsets
        lambda: gather_rows(buf, off, 64, out=np.empty((64, 64), np.uint8)[:, ::2]),
        lambda: scatter_rows(buf, [0], np.zeros((2, 8), np.uint8), [-1], 8),  # negative row
        lambda: scatter_rows(buf, [0, 8], np.zeros((2, 8), np.uint8), [0], 8),
        lambda: scatter_rows(buf.copy().setflags(write=False) or buf[::2], [0], buf, [0], 8),
        lambda: xxh3_rows(buf, -1),
        lambda: xxh3_ranges(buf, [0, 1], [8]),
        lambda: verify_rows(buf, off, 64, np.zeros(3, np.uint64)),          # wrong length
        lambda: verify_rows(buf, [4090], 64, np.zeros(1, np.uint64)),
        lambda: assign_buckets([0, 1, 2], np.array([0, 5], np.int32), 2),   # disk 5 of 2
        lambda: assign_buckets([0, 3], np.array([0, 1], np.int32), 2),      # ptr past cdisk
        lambda: assign_buckets([0, 1], np.array([0], np.int32), 2, np.zeros(3, np.int64)),
        lambda: gemv_half(np.zeros((4, 8), np.float32), np.zeros((1, 8)), bf16=False),
        lambda: gemv_half(np.zeros((4, 8), np.float16), np.zeros((1, 7)), bf16=False),
        lambda: head_logits_half(np.zeros((4, 8), np.float16), np.zeros((1, 4, 3)), 2,
                                 bf16=False),
        lambda: head_logits_half(np.zeros((4, 8), np.float16), np.zeros((1, 4, 4)), 0,
                                 bf16=False),
        lambda: softmax_sum(np.zeros(5, np.float32), 1.0),
        lambda: softmax_sum(np.zeros((2, 5), np.float32), "x"),
    ]
    for i, f in enumerate(bad):
        with pytest.raises(InvalidArgumentError):
            f()
            pytest.fail(f"case {i} was accepted")


def test_kernels_compute_what_they_say(rng):
    src = rng.integers(0, 255, (30, 64), dtype=np.uint8)
    off = np.arange(30, dtype=np.uint64)[::-1] * np.uint64(64)
    rows = gather_rows(src, off, 48)
    assert np.array_equal(rows, src[::-1, :48])
    m = rng.standard_normal((10, 16)).astype(np.float16)
    q = rng.standard_normal((2, 16)).astype(np.float32)
    assert np.allclose(gemv_half(m, q, bf16=False), q @ m.astype(np.float32).T, atol=1e-3)
    qh = rng.standard_normal((1, 4, 8)).astype(np.float32)
    lg = head_logits_half(m, qh, 2, bf16=False)
    want = np.stack([m[:, (h // 2) * 8:(h // 2 + 1) * 8].astype(np.float32) @ qh[0, h]
                     for h in range(4)])
    assert np.allclose(lg[0], want, atol=1e-3)
    x = rng.standard_normal((3, 7)).astype(np.float32)
    e = np.exp(2 * x - (2 * x).max(axis=1, keepdims=True))
    assert np.allclose(softmax_sum(x, 2.0), (e / e.sum(axis=1, keepdims=True)).sum(0),
                       atol=1e-5)
