"""The C data kernels' wrappers (``swarmfs.store._kernels``): results, and bad
arguments refused with InvalidArgumentError before C touches memory."""

import itertools
import os

import numpy as np
import pytest

from conftest import replicated_csr, run_in_threads, same_bits
from swarmfs import _errors as E
from swarmfs._errors import InvalidArgumentError
from swarmfs.store import _kernels as K
from swarmfs.store._kernels import (
    assign_buckets,
    gather_rows,
    gemv_half,
    head_logits_half,
    scatter_rows,
    softmax_sum,
    verify_rows,
    xxh3_ranges,
    xxh3_rows,
)


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


# -- every kernel path against the scalar reference --------------------------------


@pytest.mark.parametrize("bf16", [False, True])
def test_every_path_matches_the_scalar_reference(each_path, rng, bf16):
    import ml_dtypes

    from swarmfs.store._kernels import choose_clusters, kernel_path, select_fused, set_kernel_path
    H, Hq, d, C = 4, 16, 40, 301                 # d not a multiple of 16: tails too
    dt = ml_dtypes.bfloat16 if bf16 else np.float16
    m = rng.standard_normal((C, H * d)).astype(np.float32).astype(dt)
    q = rng.standard_normal((Hq, d)).astype(np.float32)
    sizes = rng.integers(1, 9, C)
    ptr = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    S = int(ptr[-1])
    members = rng.permutation(S).astype(np.int32)
    results = {}
    wide = np.zeros((C, 3 * H * d), dt)                 # rows 3 x H d apart, read in place
    wide[:, :H * d] = m
    wide[:, H * d:] = dt(7.0)
    for path in each_path:
        assert set_kernel_path(path) == path == kernel_path()
        lg = head_logits_half(m, q[None], H, bf16=bf16)[0]
        assert same_bits(head_logits_half(wide[:, :H * d], q[None], H, bf16=bf16)[0], lg)
        g = gemv_half(m, q.reshape(H, Hq // H, d).sum(1).reshape(1, -1), bf16=bf16)
        sm = softmax_sum(lg, d ** -0.5)
        fused = {s: select_fused(m, q, H, scale=d ** -0.5, score=s, bf16=bf16, ptr=ptr,
                                 members=members, num_tokens=S, budget=S // 5, window=7)
                 for s in ("prob", "logit")}
        # the fused pass chooses what the separate kernels' scores choose
        assert fused["prob"][0].tolist() == choose_clusters(
            sm, ptr, members, num_tokens=S, budget=S // 5, window=7)[0].tolist()
        results[path] = (lg, g, sm, fused)
    ref = results["scalar"]
    exact = m.astype(np.float32)
    want_lg = np.stack([exact[:, (h // (Hq // H)) * d:(h // (Hq // H) + 1) * d] @ q[h]
                        for h in range(Hq)])
    for path, (lg, g, sm, fused) in results.items():
        assert np.allclose(lg, want_lg, rtol=1e-4, atol=1e-3), path
        assert np.allclose(lg, ref[0], rtol=1e-5, atol=1e-4), path
        assert np.allclose(g, ref[1], rtol=1e-5, atol=1e-3), path
        assert np.allclose(sm, ref[2], rtol=1e-5, atol=1e-6), path
        for s in ("prob", "logit"):
            a, b = fused[s][0], ref[3][s][0]
            # near-equal scores may swap places between paths; the sets agree
            assert len(set(a.tolist()) ^ set(b.tolist())) <= 2, (path, s)


def test_forcing_an_unknown_or_missing_path_is_refused(each_path):
    from swarmfs.store._kernels import set_kernel_path
    with pytest.raises(InvalidArgumentError):
        set_kernel_path("sse9")
    missing = [p for p in ("avx2", "avx512", "neon") if p not in each_path]
    for p in missing:
        with pytest.raises(InvalidArgumentError):
            set_kernel_path(p)


@pytest.mark.parametrize("G", [1, 4, 8, 12])
def test_packed_index_scores_like_the_plain_one(each_path, rng, G):
    from swarmfs.store._kernels import pack_medoids, select_fused, set_kernel_path
    H, d, C = 2, 24, 37                     # C not a multiple of 16: a padded block
    m = rng.standard_normal((C, H * d)).astype(np.float16)
    q = rng.standard_normal((H * G, d)).astype(np.float32)
    pk = pack_medoids(m, H)
    assert pk.shape == (H, 3, d, 16)
    assert np.array_equal(pk[1, 0, :, 5], m[5, d:].view(np.uint16))
    ptr = np.arange(C + 1, dtype=np.int64)
    members = np.arange(C, dtype=np.int32)
    for path in each_path:
        set_kernel_path(path)
        kw = dict(scale=0.2, score="prob", bf16=False, ptr=ptr, members=members,
                  num_tokens=C, budget=C, window=0)
        a, na = select_fused(m, q, H, **kw)
        b, nb = select_fused(m, q, H, packed=pk, **kw)
        assert na == nb == C
        assert a.tolist() == b.tolist(), path       # every cluster, in the same score order


def test_gather_kv_writes_entries_into_head_major_k_and_v(rng):
    from swarmfs.store._kernels import gather_kv
    H, d, n = 3, 4, 10
    rows = rng.standard_normal((n, 2, H, d)).astype(np.float16)
    buf = np.zeros(64 + rows.nbytes, np.uint8)
    buf[64:] = rows.reshape(-1).view(np.uint8)
    k = np.full((H, n + 2, d), -1, np.float16)
    v = np.full((H, n + 2, d), -1, np.float16)
    dst = rng.permutation(n + 2)[:n]
    gather_kv(buf, 64 + np.arange(n, dtype=np.uint64) * np.uint64(rows[0].nbytes), dst, k, v)
    assert np.array_equal(k[:, dst], rows[:, 0].transpose(1, 0, 2))
    assert np.array_equal(v[:, dst], rows[:, 1].transpose(1, 0, 2))
    rest = np.setdiff1d(np.arange(n + 2), dst)
    assert (k[:, rest] == -1).all() and (v[:, rest] == -1).all()
    with pytest.raises(InvalidArgumentError):
        gather_kv(buf, [buf.nbytes - 8], [0], k, v)              # outside the source
    with pytest.raises(InvalidArgumentError):
        gather_kv(buf, [64], [n + 2], k, v)                      # outside the output
    with pytest.raises(InvalidArgumentError):
        gather_kv(buf, [64], [0], k, v[:, :, :2])                # shapes differ


def _aligned(shape, dtype, offset=0):
    """A zeroed array whose data starts offset bytes past a 64-byte boundary."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.zeros(nbytes + 128, np.uint8)
    at = (-raw.ctypes.data) % 64 + offset
    return raw[at:at + nbytes].view(dtype).reshape(shape)


@pytest.mark.parametrize("d,dtype,offset,want", [
    (64, np.float16, 0, "stream"),     # 128-byte rows, aligned: streaming stores
    (32, np.float32, 0, "stream"),     # 128-byte rows (MiniLM, fp32)
    (128, np.float16, 0, "stream"),    # 256-byte rows (Qwen3-32B)
    (64, np.float16, 32, "copy"),      # K and V not 64-byte aligned
    (24, np.float16, 0, "copy"),       # 48-byte rows: not whole lines
])
def test_gather_kv_large_outputs_equal_on_every_path(rng, each_path, d, dtype, offset, want):
    """A gather large enough to store around the cache (>= 16 MiB written)
    writes the same bytes as the reference on every kernel path, and leaves
    the columns it does not own untouched; the mode is as documented."""
    from swarmfs.store._kernels import gather_kv, gather_kv_mode, set_kernel_path
    H = 8
    n = (17 << 20) // (2 * H * d * np.dtype(dtype).itemsize) + 1    # > 16 MiB written
    nt = n + 37
    rows = rng.standard_normal((n, 2, H, d)).astype(dtype)
    eb = rows[0].nbytes
    stride = eb + 64                                    # entries apart, as staging is
    buf = np.zeros(64 + n * stride, np.uint8)
    src = 64 + np.arange(n, dtype=np.uint64) * np.uint64(stride)
    for i in range(0, n, 4096):                         # fill the staging rows
        j = min(n, i + 4096)
        view = buf[64 + i * stride:64 + j * stride].reshape(j - i, stride)
        view[:, :eb] = rows[i:j].reshape(j - i, -1).view(np.uint8)
    dst = rng.permutation(nt)[:n]
    rest = np.setdiff1d(np.arange(nt), dst)
    for path, threads in itertools.product(each_path, (1, 2)):
        assert set_kernel_path(path) == path
        k = _aligned((H, nt, d), dtype, offset)
        v = _aligned((H, nt, d), dtype, offset)
        k[:, rest] = 7
        v[:, rest] = 7
        mode = gather_kv_mode(k, v, n)
        if want == "copy" or path in ("scalar", "neon"):
            assert mode == "copy", (path, mode)
        else:
            assert mode == {"avx2": "stream256", "avx512": "stream512"}[path], (path, mode)
        assert gather_kv(buf, src, dst, k, v, threads=threads) == (threads == 2)
        assert np.array_equal(k[:, dst], rows[:, 0].transpose(1, 0, 2)), (path, threads)
        assert np.array_equal(v[:, dst], rows[:, 1].transpose(1, 0, 2)), (path, threads)
        assert (k[:, rest] == 7).all() and (v[:, rest] == 7).all(), (path, threads)
        # a small gather into the same output stays on memcpy
        assert gather_kv_mode(k, v, 4) == "copy"


@pytest.mark.parametrize("n", [1, 2, 1023, 1024, 1025, 1281])
def test_gather_kv_on_two_threads_splits_from_4_mib_and_writes_the_same(rng, each_path, n):
    """threads=2 splits a call that writes at least 4 MiB (4 KiB entries: 1024
    of them) into two halves, odd counts included; below that it stays on one
    thread; either way the bytes equal the one-thread gather's, on every
    path, in memcpy mode (unaligned K and V)."""
    from swarmfs.store._kernels import gather_kv, gather_kv_mode, set_kernel_path
    H, d = 8, 128
    rows = rng.standard_normal((n, 2, H, d)).astype(np.float16)
    buf = rows.reshape(-1).view(np.uint8)
    perm = rng.permutation(n)
    src = perm.astype(np.uint64) * np.uint64(rows[0].nbytes)
    dst = rng.permutation(n + 5)[:n]
    for path in each_path:
        set_kernel_path(path)
        k1, v1 = _aligned((H, n + 5, d), np.float16, 16), _aligned((H, n + 5, d), np.float16, 16)
        k2, v2 = _aligned((H, n + 5, d), np.float16, 16), _aligned((H, n + 5, d), np.float16, 16)
        for x in (k1, v1, k2, v2):
            x[...] = 3
        assert gather_kv_mode(k1, v1, n) == "copy"
        assert gather_kv(buf, src, dst, k1, v1) is False
        assert gather_kv(buf, src, dst, k2, v2, threads=2) == (n >= 1024), (path, n)
        assert same_bits(k1, k2) and same_bits(v1, v2), (path, n)
        assert same_bits(k2[:, dst], rows[perm][:, 0].transpose(1, 0, 2)), (path, n)


@pytest.mark.parametrize("threads", [0, 3, -1, True, 2.0, "2", None])
def test_gather_kv_refuses_a_thread_count_other_than_1_or_2(threads):
    from swarmfs.store._kernels import gather_kv
    k, v = np.zeros((2, 4, 4), np.float16), np.zeros((2, 4, 4), np.float16)
    buf = np.ones(64, np.uint8)
    with pytest.raises(E.InvalidArgumentError, match="threads"):
        gather_kv(buf, [0], [0], k, v, threads=threads)
    assert not k.any() and not v.any()                 # nothing written


def test_choice_kernels_refuse_a_table_that_does_not_fit(rng):
    from swarmfs.store._kernels import choose_clusters, select_fused
    sc = np.zeros(3, np.float32)
    ptr = np.array([0, 2, 3, 5])
    members = np.array([0, 1, 2, 3, 4], np.int32)
    for p, mm in ((ptr[:3], members), (ptr, members[:4]), (ptr, np.array([0, 1, 2, 3, 9]))):
        with pytest.raises(InvalidArgumentError):
            choose_clusters(sc, p, mm, num_tokens=5, budget=5, window=0)
        with pytest.raises(InvalidArgumentError):
            select_fused(np.zeros((3, 8), np.float16), np.zeros((4, 4), np.float32), 2,
                         scale=0.5, score="prob", bf16=False, ptr=p, members=mm,
                         num_tokens=5, budget=5, window=0)
    assert choose_clusters(sc, ptr, members, num_tokens=5, budget=5, window=0)[1] == 5


# -- the int8 medoid index ----------------------------------------------------------

def _quantise(x):
    """numpy reference of the per-row int8 quantisation (float32 arithmetic as in C)."""
    x = x.astype(np.float32)
    mx = np.abs(x).max(axis=-1, keepdims=True)
    inv = np.where(mx > 0, np.float32(127) / np.where(mx > 0, mx, 1), 0).astype(np.float32)
    qx = np.clip(np.rint(x * inv), -127, 127).astype(np.int32)
    return qx, np.where(mx > 0, mx / np.float32(127), 0).astype(np.float32)[..., 0]


@pytest.mark.parametrize("G,C", [(1, 5), (1, 101), (1, 128), (8, 37), (12, 301)])
def test_int8_logits_are_the_integer_dots_on_every_path(each_path, rng, G, C):
    from swarmfs.store._kernels import head_logits_i8, pack_medoids_i8, set_kernel_path
    H, d = 2, 24                             # C not a multiple of 16: a padded block
    m = (rng.standard_normal((C, H * d)) * rng.uniform(0.1, 10, (C, 1))).astype(np.float16)
    m[0, :d] = 0                             # an all-zero row: scale 0, logits 0
    q = rng.standard_normal((H * G, d)).astype(np.float32)
    ix = pack_medoids_i8(m, H)
    mq, ms = _quantise(m.reshape(C, H, d))   # [C, H, d], [C, H]
    qq, qs = _quantise(q)
    nblk = (C + 15) // 16
    assert ix.data.shape == (H, nblk, d // 4, 16, 4)
    assert np.array_equal(ix.data[1, 0, :, 3].reshape(-1), mq[3, 1])
    assert np.array_equal(ix.scales[:, :C], ms.T) and not ix.scales[:, C:].any()
    assert np.array_equal(ix.sums[:, :C], mq.sum(-1).T)
    dots = np.stack([mq[:, h // G] @ qq[h] for h in range(H * G)])          # exact ints
    want = dots.astype(np.float32) * (ms.T[np.arange(H * G) // G] * qs[:, None])
    exact = np.stack([m[:, (h // G) * d:(h // G + 1) * d].astype(np.float32) @ q[h]
                      for h in range(H * G)])
    for path in each_path:
        set_kernel_path(path)
        got = head_logits_i8(ix, q, H)
        assert np.array_equal(got, want), path          # bit-identical on every path
    # the quantisation error bound: |dq . dm| terms of half a step each
    mabs = np.abs(m.reshape(C, H, d).astype(np.float32)).sum(-1).T[np.arange(H * G) // G]
    bound = 0.5 * (ms.T[np.arange(H * G) // G] * np.abs(q).sum(1)[:, None] +
                   qs[:, None] * mabs) + 0.25 * d * ms.T[np.arange(H * G) // G] * qs[:, None]
    assert np.all(np.abs(got - exact) <= bound * 1.001 + 1e-6)
    assert got[:, 0][: G].tolist() == [0.0] * G


def test_int8_selection_is_the_rule_on_its_scores(each_path, rng):
    from swarmfs.store._kernels import (
        choose_clusters,
        head_logits_i8,
        pack_medoids_i8,
        select_i8,
        set_kernel_path,
    )
    H, Hq, d, C = 4, 32, 64, 301
    m = rng.standard_normal((C, H * d)).astype(np.float16)
    q = rng.standard_normal((Hq, d)).astype(np.float32)
    ptr, members, S = replicated_csr(rng, C)   # the last cluster holds 200 replicas
    ix = pack_medoids_i8(m, H)
    for path in each_path:
        set_kernel_path(path)
        sc = softmax_sum(head_logits_i8(ix, q, H), d ** -0.5)
        for budget, w in ((S // 5, 7), (S, 0), (S, 30)):
            got = select_i8(ix, q, H, scale=d ** -0.5, ptr=ptr, members=members,
                            num_tokens=S, budget=budget, window=w)
            want = choose_clusters(sc, ptr, members, num_tokens=S, budget=budget, window=w)
            assert got[0].tolist() == want[0].tolist() and got[1] == want[1], path
            if budget == S:                  # the whole context: every token, once
                assert got[1] == S
            # both cores for one query: the same clusters (scores equal up to
            # the order of one addition)
            two = select_i8(ix, q, H, scale=d ** -0.5, ptr=ptr, members=members,
                            num_tokens=S, budget=budget, window=w, threads=2)
            assert two[0].tolist() == want[0].tolist() and two[1] == want[1], path


def test_int8_selection_on_two_threads_under_concurrent_callers(rng):
    """select_i8(threads=2) from several Python threads at once (the C call
    releases the GIL; each call starts and joins its own second thread and
    uses its caller's scratch): every result is the one-thread result; one
    KV head falls back to one thread."""
    import threading

    from swarmfs.store._kernels import pack_medoids_i8, select_i8
    H, Hq, d, C = 8, 64, 128, 700
    m = rng.standard_normal((C, H * d)).astype(np.float16)
    ptr, members, S = replicated_csr(rng, C)
    ix = pack_medoids_i8(m, H)
    qs = rng.standard_normal((6, Hq, d)).astype(np.float32)
    kw = dict(scale=d ** -0.5, ptr=ptr, members=members, num_tokens=S, budget=S // 10,
              window=16)
    want = [select_i8(ix, q, H, **kw) for q in qs]
    bad = []

    def worker(t):
        for i in range(40):
            j = (t + i) % len(qs)
            got = select_i8(ix, qs[j], H, threads=2, **kw)
            if got[0].tolist() != want[j][0].tolist() or got[1] != want[j][1]:
                bad.append((t, i))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and not bad
    one = pack_medoids_i8(m[:, :d], 1)
    a = select_i8(one, qs[0][:8], 1, **kw)
    b = select_i8(one, qs[0][:8], 1, threads=2, **kw)
    assert a[0].tolist() == b[0].tolist() and a[1] == b[1]


def test_int8_index_refuses_what_does_not_fit(rng):
    from swarmfs.store._kernels import head_logits_i8, pack_medoids_i8, select_i8
    m = rng.standard_normal((20, 2 * 8)).astype(np.float16)
    ix = pack_medoids_i8(m, 2)
    q = rng.standard_normal((4, 8)).astype(np.float32)
    ptr = np.arange(21, dtype=np.int64)
    mem = np.arange(20, dtype=np.int32)
    bad = [
        lambda: pack_medoids_i8(np.zeros((4, 12), np.float16), 2),        # d = 6
        lambda: pack_medoids_i8(np.zeros((4, 16), np.float32), 2),        # 4-byte floats
        lambda: head_logits_i8(ix, q[:, :4], 2),                           # d 4 != 8
        lambda: head_logits_i8(ix, q[:3], 2),                              # 3 heads, 2 KV
        lambda: head_logits_i8(ix._replace(rows=33), q, 2),               # 3 blocks, not 2
        lambda: head_logits_i8(m, q, 2),                                   # not an index
        lambda: select_i8(ix, q, 2, scale=0.0, ptr=ptr, members=mem, num_tokens=20,
                          budget=5, window=0),
        lambda: select_i8(ix, q, 2, scale=0.3, ptr=ptr[:-1], members=mem, num_tokens=20,
                          budget=5, window=0),
    ] + [
        (lambda t=t: select_i8(ix, q, 2, scale=0.3, ptr=ptr, members=mem, num_tokens=20,
                               budget=5, window=0, threads=t))
        for t in (0, 3, -1, True, 1.0, "2", None)
    ]
    for f in bad:
        with pytest.raises(InvalidArgumentError):
            f()

def test_bad_kernel_path_variable_warns_and_never_breaks_import():
    """SWARMFS_KERNEL_PATH=garbage used to make `import swarmfs` (and so every
    swarmfs command) die with a traceback; now a warning names the variable
    and the best path is used."""
    import subprocess
    import sys
    for bad in ("garbage", "AVX2", " avx2"):
        r = subprocess.run([sys.executable, "-c",
                            "import swarmfs.store._kernels as K; print(K.kernel_path())"],
                           env={**os.environ, "SWARMFS_KERNEL_PATH": bad},
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert "SWARMFS_KERNEL_PATH ignored" in r.stderr
        assert r.stdout.strip() in ("scalar", "avx2", "avx512", "neon")


def test_choose_and_select_fused_with_out_of_range_counts_raise_or_cap():
    """A budget beyond int64 raised a raw OverflowError from cffi; it means the
    whole context.  A float budget or a non-array index is an InvalidArgumentError."""
    from swarmfs.decode._selectors import select_clusters
    rng = np.random.default_rng(0)
    ptr, members = np.arange(0, 65, 8), np.arange(64)
    sc = rng.standard_normal(8).astype(np.float32)
    ids, n = K.choose_clusters(sc, ptr, members, num_tokens=64, budget=2**70, window=0)
    assert n == 64 and sorted(ids.tolist()) == list(range(8))
    m = rng.standard_normal((8, 32)).astype(np.float16)
    q = rng.standard_normal((4, 16)).astype(np.float32)
    ids, n = K.select_fused(m, q, 2, scale=0.25, score="prob", bf16=False, ptr=ptr,
                            members=members, num_tokens=64, budget=2**70, window=0)
    assert n == 64 and sorted(ids.tolist()) == list(range(8))
    with pytest.raises(E.InvalidArgumentError):
        K.select_fused(m.tolist(), q, 2, scale=0.25, score="prob", bf16=False, ptr=ptr,
                       members=members, num_tokens=64, budget=8, window=0)
    with pytest.raises(E.InvalidArgumentError):
        select_clusters(sc, ptr, members, num_tokens=64, budget=1.5, window=0)
    with pytest.raises(E.InvalidArgumentError):
        select_clusters(sc, ptr, members, num_tokens=64, budget="8", window=0)


def test_empty_aligned_and_gather_kv_mode_refuse_bad_arguments():
    from swarmfs.store._kernels import empty_aligned, gather_kv_mode
    a = empty_aligned((3, 5, 64), np.float16)
    assert a.ctypes.data % 64 == 0 and a.shape == (3, 5, 64) and a.flags.c_contiguous
    assert empty_aligned(7, np.uint8, align=4096).ctypes.data % 4096 == 0
    assert empty_aligned((0, 4), np.float32).size == 0
    for shape, dt, al in (((-1, 4), np.float16, 64), ((2.5, 4), np.float16, 64),
                          ((True, 4), np.float16, 64), ((2, 4), "no-such-dtype", 64),
                          ((2, 4), np.float16, 48), ((2, 4), np.float16, 0),
                          ((1 << 62, 1 << 10), np.float32, 64)):      # far more than memory
        with pytest.raises(InvalidArgumentError):
            empty_aligned(shape, dt, align=al)
    b = empty_aligned((3, 5, 64), np.float16)
    assert gather_kv_mode(a, b, 5) == "copy"                         # far under 16 MiB
    for args in ((a, b[:, :4], 5), (a, b.astype(np.float32), 5), (a[0], b[0], 5),
                 (a, b, -1), (a, b, 2.5), (a, "b", 5)):
        with pytest.raises(InvalidArgumentError):
            gather_kv_mode(*args)


def test_native_calls_refuse_missing_argument_structs():
    """The scoring, selection and planner calls take their arguments as
    structs (engine.h): a NULL struct, or a struct without its arrays, is
    -EINVAL in C, never a crash; se_select_i8x2 with no se_choice returns the
    scores only."""
    import errno

    from swarmfs._native import ffi, lib
    from swarmfs.decode._index2 import pack_medoids_i8x2, select_i8x2
    from swarmfs.store._kernels import _choice, _i8_fields, _query, pack_medoids_i8
    N, EINVAL = ffi.NULL, -errno.EINVAL
    q = np.ones((4, 8), np.float32)
    m = np.ones((20, 16), np.float16)
    ix = pack_medoids_i8(m, 2)
    ptr, members = np.arange(21, dtype=np.int64), np.arange(20, dtype=np.int32)
    out = np.empty(20, np.int64)
    qs, ch = _query(q, 2, 0.5), _choice(ptr, members, 20, 5, 0, out)
    i8 = ffi.new("se_i8_index *", _i8_fields(ix, 20))
    work = ffi.new("float[]", 20 * 5)
    scores = ffi.new("float[]", 20)
    assert lib.se_choose_clusters(scores, 20, N) == EINVAL
    assert lib.se_choose_clusters(scores, 20, ffi.new("se_choice *")) == EINVAL
    assert lib.se_select_fused(N, qs, 0, work, ch) == EINVAL
    assert lib.se_select_fused(ffi.new("se_half_index *", {"C": 20, "kind": 1}), qs, 0, work,
                               ch) == EINVAL                              # no medoids
    assert lib.se_select_i8(i8, N, 1, work, ch) == EINVAL
    assert lib.se_select_i8(ffi.new("se_i8_index *", {"rows": 20}), qs, 1, work, ch) == EINVAL
    assert lib.se_head_logits_i8(i8, N, work) == EINVAL
    assert lib.se_select_i8x2(N, qs, 1, scores, ch) == EINVAL
    assert lib.se_plan_reads(N, ffi.new("se_plan_out *")) == EINVAL
    assert lib.se_plan_reads(ffi.new("se_plan_in *", {"m": 1, "ndisks": 1, "E": 64,
                                                      "bs": 512}), N) == EINVAL
    # the scores alone (no se_choice) are the scores the choice is made from
    from swarmfs.store._kernels import choose_clusters
    ix2 = pack_medoids_i8x2(np.random.default_rng(1).standard_normal((20, 16)).astype(np.float16),
                            2, group_size=4)
    q2 = np.random.default_rng(2).standard_normal((4, 8)).astype(np.float32)
    s_only = select_i8x2(ix2, q2, 2, scale=0.5, ngroups=10**6)
    got = select_i8x2(ix2, q2, 2, scale=0.5, ptr=ptr, members=members, num_tokens=20, budget=5,
                      ngroups=10**6)
    want = choose_clusters(s_only, ptr, members, num_tokens=20, budget=5, window=0)
    assert got[0].tolist() == want[0].tolist() and got[1] == want[1] == 5


def test_adversarial_arguments_are_refused_before_any_native_work(rng):
    """Found by attacking the kernels: object K/V were written over with raw
    bytes (a later read crashed), K given as V got V's bytes, a member of
    2**32 + 1 was narrowed to 1 and accepted, a float budget was truncated,
    a budget of 2**63 overflowed, and coverage nan / inf escaped as
    ValueError / OverflowError."""
    from swarmfs.decode._index2 import pack_medoids_i8x2, select_i8x2
    from swarmfs.store._kernels import choose_clusters, gather_kv, pack_medoids_i8, select_i8
    buf = np.zeros(4096, np.uint8)
    k = np.empty((2, 8, 4), object)
    with pytest.raises(InvalidArgumentError, match="Python objects"):
        gather_kv(buf, [0], [0], k, np.empty((2, 8, 4), object))
    with pytest.raises(InvalidArgumentError, match="2- or 4-byte"):
        gather_kv(buf, [0], [0], np.zeros((2, 8, 4), np.float64), np.zeros((2, 8, 4)))
    from swarmfs.store._kernels import scatter_rows, xxh3_rows
    with pytest.raises(InvalidArgumentError, match="Python objects"):   # the same kind:
        scatter_rows(np.empty(64, object), [0], np.zeros(8, np.uint8), [0], 8)  # raw bytes
    with pytest.raises(InvalidArgumentError, match="Python objects"):   # over pointers
        xxh3_rows(np.empty(64, object), 8)
    kk = np.zeros((2, 8, 4), np.float16)
    with pytest.raises(InvalidArgumentError, match="share memory"):
        gather_kv(buf, [0], [0], kk, kk)
    with pytest.raises(InvalidArgumentError):
        choose_clusters(np.ones(2, np.float32), [0, 1, 2], np.array([0, 2**32 + 1]),
                        num_tokens=4, budget=4, window=0)
    H, Hq, d, C = 2, 4, 8, 40
    m = rng.standard_normal((C, H * d)).astype(np.float16)
    q = rng.standard_normal((Hq, d)).astype(np.float32)
    ptr = np.arange(C + 1, dtype=np.int64)
    members = np.arange(C, dtype=np.int32)
    ix, ix2 = pack_medoids_i8(m, H), pack_medoids_i8x2(m, H, group_size=8)
    for bad in (3.7, -1, "5"):
        with pytest.raises(InvalidArgumentError):
            select_i8(ix, q, H, scale=0.3, ptr=ptr, members=members, num_tokens=C,
                      budget=bad, window=0)
        with pytest.raises(InvalidArgumentError):
            select_i8x2(ix2, q, H, scale=0.3, ptr=ptr, members=members, num_tokens=C,
                        budget=bad, window=0)
    wide = members.astype(np.int64)
    wide[3] = 2**32 + 1                                   # narrowed to int32 it would be 1
    with pytest.raises(InvalidArgumentError, match="outside the context"):
        select_i8(ix, q, H, scale=0.3, ptr=ptr, members=wide, num_tokens=C, budget=4,
                  window=0)
    with pytest.raises(InvalidArgumentError, match="outside the context"):
        select_i8x2(ix2, q, H, scale=0.3, ptr=ptr, members=wide, num_tokens=C, budget=4,
                    window=0)
    got = select_i8(ix, q, H, scale=0.3, ptr=ptr, members=members, num_tokens=C,
                    budget=2**63, window=0)               # more than the context: all of it
    assert got[1] == C
    for cov in (float("nan"), float("inf"), 0, True):
        with pytest.raises(InvalidArgumentError):
            select_i8x2(ix2, q, H, scale=0.3, ptr=ptr, members=members, num_tokens=C,
                        budget=4, window=0, coverage=cov)
    assert select_i8x2(ix2, q, H, scale=0.3, ptr=ptr, members=members, num_tokens=C,
                       budget=C, window=0, ngroups=2**63)[1] == C


def test_streaming_gathers_plans_and_selections_from_many_threads(rng):
    """gather_kv's contract: calls may run at the same time on different
    outputs (so may plan_reads and select_i8, which keep per-thread scratch).
    Four threads, each with its own 64-byte aligned K/V written by streaming
    stores (> 16 MiB per call, every other call split over a second thread),
    plan and select 10 times; every result equals
    the single-threaded one."""
    from swarmfs import plan_reads
    from swarmfs.store._kernels import (
        empty_aligned,
        gather_kv,
        gather_kv_mode,
        kernel_path,
        pack_medoids_i8,
        select_i8,
    )
    H, d, n = 8, 128, 4200                                  # 4 KiB entries: 17 MB per call
    rows = rng.standard_normal((n, 2, H, d)).astype(np.float16)
    buf = rows.reshape(-1).view(np.uint8)
    perm = rng.permutation(n)                               # staging order != token order
    src = perm.astype(np.uint64) * np.uint64(rows[0].nbytes)
    dst = np.arange(n, dtype=np.int64)
    want_k = rows[perm][:, 0].transpose(1, 0, 2)
    C, Hq = 600, 32
    m = rng.standard_normal((C, H * d)).astype(np.float16)
    ix = pack_medoids_i8(m, H)
    q = rng.standard_normal((Hq, d)).astype(np.float32)
    ptr = np.arange(C + 1, dtype=np.int64) * 7
    members = rng.permutation(C * 7).astype(np.int32)
    kw = dict(scale=d ** -0.5, ptr=ptr, members=members, num_tokens=C * 7, budget=420,
              window=16)
    want_sel = select_i8(ix, q, H, **kw)
    tok = rng.integers(0, 5000, 3000)
    cd = rng.integers(0, 4, 3000).astype(np.int32)
    co = rng.integers(0, 1 << 20, 3000).astype(np.uint64) * np.uint64(4096)
    plan = dict(ndisks=4, entry_bytes=4096, block_size=4096)
    want_plan = plan_reads(tok, cd, co, **plan)
    bad = []

    def work(t):
        k, v = empty_aligned((H, n, d), np.float16), empty_aligned((H, n, d), np.float16)
        if gather_kv_mode(k, v, n) == "copy" and kernel_path() in ("avx2", "avx512"):
            bad.append((t, "not streaming"))
        for it in range(10):
            gather_kv(buf, src, dst, k, v, threads=1 + (t + it) % 2)   # split or not
            if not np.array_equal(k, want_k):
                bad.append((t, it, "k"))
            got = select_i8(ix, q, H, **kw)
            if got[0].tolist() != want_sel[0].tolist() or got[1] != want_sel[1]:
                bad.append((t, it, "select"))
            p = plan_reads(tok, cd, co, **plan)
            if not (np.array_equal(p.offset, want_plan.offset) and
                    np.array_equal(p.src, want_plan.src)):
                bad.append((t, it, "plan"))

    bad += run_in_threads(work, 4)
    assert bad == []


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_kv_rows_is_the_inverse_of_gather_kv(rng, dtype):
    """kv_rows(k, v, idx) returns the stored rows of columns idx (K heads then
    V heads), equal to the numpy form, also for K/V that are column slices of
    larger buffers (a reused output) and with repeated columns; gathering
    those rows back with gather_kv restores K and V."""
    import ml_dtypes

    from swarmfs.store._kernels import gather_kv, kv_rows
    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    H, n, d = 3, 57, 16
    kb = rng.standard_normal((H, n + 9, d)).astype(dt)
    vb = rng.standard_normal((H, n + 9, d)).astype(dt)
    k, v = kb[:, :n], vb[:, :n]
    idx = np.concatenate([rng.permutation(n), [5, 5, 0]])
    got = kv_rows(k, v, idx)
    want = np.ascontiguousarray(np.stack([k[:, idx], v[:, idx]]).transpose(2, 0, 1, 3))
    assert got.shape == (idx.shape[0], 2 * H * d * k.itemsize) and got.dtype == np.uint8
    assert same_bits(got, want.reshape(idx.shape[0], -1).view(np.uint8))
    k2, v2 = np.zeros((H, n, d), dt), np.zeros((H, n, d), dt)
    gather_kv(got.reshape(-1), np.arange(n, dtype=np.uint64) * np.uint64(got.shape[1]),
              idx[:n], k2, v2)
    assert same_bits(k2, k) and same_bits(v2, v)
    assert kv_rows(k, v, []).shape == (0, got.shape[1])


def test_kv_rows_refuses_what_does_not_fit():
    from swarmfs.store._kernels import kv_rows
    k = np.zeros((2, 8, 4), np.float16)
    for args, match in (((k, k, [8]), "outside"), ((k, k, [-1]), "outside"),
                        ((k, k[:, :, :2], [0]), "differ"),
                        ((k, k.astype(np.float32), [0]), "differ"),
                        ((k[:, :, ::2], k[:, :, ::2], [0]), "contiguous"),
                        ((k.transpose(1, 0, 2), k.transpose(1, 0, 2), [0]), "contiguous"),
                        ((np.zeros((2, 8, 4), np.float64),) * 2 + ([0],), "2- or 4-byte"),
                        ((np.zeros((2, 8), np.float16),) * 2 + ([0],), "2- or 4-byte"),
                        ((k, k, [0.5]), "integer"),
                        ((k, k, np.array([2**63], np.uint64)), "outside")):
        with pytest.raises(InvalidArgumentError, match=match):
            kv_rows(*args)


def test_gather_kv_on_two_threads_with_a_repeated_column_keeps_the_later_entry(rng):
    """A call whose dst_idx repeats columns (each written by both halves)
    stays on one thread even with threads=2: the later entry wins, as with
    one thread, every time (a split would race per column)."""
    from swarmfs.store._kernels import gather_kv
    H, d, m = 8, 128, 2100                                  # 8.6 MB: a split size
    rows = rng.standard_normal((m, 2, H, d)).astype(np.float16)
    buf = rows.reshape(-1).view(np.uint8)
    src = np.arange(m, dtype=np.uint64) * np.uint64(rows[0].nbytes)
    idx = np.arange(m) % (m // 2)
    k1, v1 = np.zeros((H, m // 2, d), np.float16), np.zeros((H, m // 2, d), np.float16)
    assert gather_kv(buf, src, idx, k1, v1) is False
    assert same_bits(k1, rows[m // 2:, 0].transpose(1, 0, 2))
    for _ in range(20):
        k2, v2 = np.zeros_like(k1), np.zeros_like(v1)
        assert gather_kv(buf, src, idx, k2, v2, threads=2) is False
        assert same_bits(k1, k2) and same_bits(v1, v2)


def test_softmax_sum_refuses_values_that_are_not_finite():
    from swarmfs.store._kernels import softmax_sum
    for bad in (np.nan, np.inf, -np.inf):
        x = np.zeros((2, 40), np.float32)
        x[1, 17] = bad
        with pytest.raises(InvalidArgumentError, match="NaN or inf"):
            softmax_sum(x, 0.5)


def test_kernels_refuse_torch_tensors_that_require_grad():
    """A torch output that requires grad is an InvalidArgumentError, not
    torch's RuntimeError (gather_kv; Retriever's out= is tested with it)."""
    torch = pytest.importorskip("torch")
    from swarmfs.store._kernels import gather_kv
    k = torch.zeros((2, 4, 8), dtype=torch.float16, requires_grad=True)
    v = torch.zeros((2, 4, 8), dtype=torch.float16)
    with pytest.raises(InvalidArgumentError, match="not an array"):
        gather_kv(np.zeros(64, np.uint8), [0], [0], k, v)
