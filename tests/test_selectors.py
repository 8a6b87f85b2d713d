"""The one selection rule (SWARM §5.2, eq. 8): clusters by score until the
budget of distinct entries, with one local-window rule."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import random_clusters, random_kv, same_bits
from swarmfs import Retriever, Store
from swarmfs._errors import InvalidArgumentError, SwarmError
from swarmfs.decode._selectors import MedoidSelector, group_queries, score_medoids, select_clusters
from swarmfs.decode._window import window_size


def csr(clusters):
    ptr = np.zeros(len(clusters) + 1, np.int64)
    ptr[1:] = np.cumsum([len(c) for c in clusters])
    return ptr, np.concatenate([np.asarray(c, np.int64) for c in clusters])


def reference(scores, clusters, S, budget, w):
    """The rule spelled out: score order (ties: lower id), a Python set."""
    budget = min(budget, S)
    seen = set(range(S - w, S))
    order = sorted(range(len(scores)),
                   key=lambda c: (-(scores[c] if not np.isnan(scores[c]) else -np.inf), c))
    chosen = []
    for c in order:
        if len(seen) >= budget:
            break
        chosen.append(c)
        seen |= set(np.asarray(clusters[c]).tolist())
    return chosen, len(seen)


def test_issue_example_whole_context_at_r_1():
    # 64 tokens in clusters [48..63], [2..47], [0], [1]; r = 1 returns all 64
    clusters = [np.arange(48, 64), np.arange(2, 48), [0], [1]]
    ptr, members = csr(clusters)
    for scores in ([4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0]):
        for w in (0, 16, 64):
            sel = select_clusters(np.array(scores, np.float32), ptr, members, num_tokens=64,
                                  budget=64, window=w)
            got = set(range(64 - w, 64)).union(*[set(np.asarray(clusters[c]).tolist())
                                                 for c in sel.clusters])
            assert got == set(range(64)) and sel.entries == 64


def test_replicas_and_window_are_not_counted_twice():
    # c0 = [0..3], c1 = [4, 0] (0 replicated), c2 = [5..19]; window = {18, 19}
    clusters = [[0, 1, 2, 3], [4, 0], list(range(5, 20))]
    ptr, members = csr(clusters)
    sc = np.array([3.0, 2.0, 1.0], np.float32)
    sel = select_clusters(sc, ptr, members, num_tokens=20, budget=5, window=0)
    assert sel.clusters.tolist() == [0, 1] and sel.entries == 5
    sel = select_clusters(sc, ptr, members, num_tokens=20, budget=6, window=0)
    assert sel.clusters.tolist() == [0, 1, 2] and sel.entries == 20
    sel = select_clusters(sc, ptr, members, num_tokens=20, budget=6, window=2)
    assert sel.clusters.tolist() == [0] and sel.entries == 6
    sel = select_clusters(sc, ptr, members, num_tokens=20, budget=2, window=2)
    assert sel.clusters.tolist() == [] and sel.entries == 2


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 300), st.integers(1, 40), st.integers(0, 400), st.integers(0, 80),
       st.integers(0, 2**31), st.booleans())
def test_selection_equals_the_rule(S, C, budget, w, seed, ties):
    rng = np.random.default_rng(seed)
    C = min(C, S)
    clusters = random_clusters(rng, S, C, extra_copies=S // 3)
    ptr, members = csr(clusters)
    scores = rng.integers(0, 3, C).astype(np.float32) if ties else \
        rng.standard_normal(C).astype(np.float32)
    if C > 2 and seed % 5 == 0:
        scores[seed % C] = np.nan
    w = min(w, S)
    sel = select_clusters(scores, ptr, members, num_tokens=S, budget=budget, window=w)
    want, n = reference(scores, clusters, S, budget, w)
    assert sel.clusters.tolist() == want
    assert sel.entries == n
    got = set(range(S - w, S)).union(*[set(clusters[c].tolist()) for c in sel.clusters])
    assert len(got) == sel.entries
    assert sel.entries >= min(budget, S)                       # the budget is met
    if len(sel.clusters):                                      # ... by the last cluster
        before = set(range(S - w, S)).union(*[set(clusters[c].tolist())
                                              for c in sel.clusters[:-1]])
        assert len(before) < min(budget, S)


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31), st.sampled_from(["normal", "narrow", "ties", "special"]),
       st.sampled_from([0.01, 0.1, 0.5]))
def test_selection_equals_the_rule_with_many_clusters(seed, kind, r):
    """Thousands of clusters, so the choice finds its candidates by a key
    threshold (two counting passes) rather than taking them all: scores
    whose keys share their upper 22 bits ("narrow": 1 + i ulp), heavy ties,
    NaN, +-inf and +-0 all give the rule's clusters."""
    rng = np.random.default_rng(seed)
    S = int(rng.integers(2000, 12000))
    C = int(rng.integers(500, min(3000, S // 2)))
    clusters = random_clusters(rng, S, C, extra_copies=S // 4)
    ptr, members = csr(clusters)
    if kind == "normal":
        scores = rng.standard_normal(C).astype(np.float32)
    elif kind == "narrow":
        scores = (np.float32(1) + rng.integers(0, 64, C) * np.finfo(np.float32).eps
                  ).astype(np.float32)
    elif kind == "ties":
        scores = rng.integers(0, 4, C).astype(np.float32)
    else:
        scores = rng.choice(np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-30, -1e-30, 2.0],
                                     np.float32), C)
    budget = int(np.ceil(r * S))
    w = int(rng.integers(0, 64))
    sel = select_clusters(scores, ptr, members, num_tokens=S, budget=budget, window=w)
    want, n = reference(scores, clusters, S, budget, w)
    assert sel.clusters.tolist() == want
    assert sel.entries == n


@pytest.mark.slow
@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**31))
def test_r1_returns_every_token_8_kv_heads_4096(tmp_path_factory, seed):
    rng = np.random.default_rng(seed)
    S, H, HQ, D = 4096, 8, 16, 8
    path = tmp_path_factory.mktemp("r1")
    with Store.create(path / "st", disks=3, num_layers=1, num_kv_heads=H, head_dim=D,
                      num_query_heads=HQ, dtype="float16") as s:
        kv = random_kv(rng, S, H, D, "float16")
        s.write_layer(0, kv, random_clusters(rng, S, 300, 900), local_window=64)
        r = Retriever(s, ratio=1.0)
        for q in rng.standard_normal((3, HQ, D)):
            out = r.retrieve(0, q, torch=False)
            assert out.positions.tolist() == list(range(S))
            assert same_bits(out.k, kv[:, 0].transpose(1, 0, 2))
            assert same_bits(out.v, kv[:, 1].transpose(1, 0, 2))


def test_window_rule():
    assert window_size(256, 1000, 10_000) == 250       # a quarter of the budget
    assert window_size(256, 4000, 10_000) == 256       # W
    assert window_size(256, 4000, 100) == 100          # the context
    assert window_size(0, 4000, 100) == 0


def test_bad_arguments_raise_swarm_errors():
    ptr, members = csr([[0, 1], [2]])
    sc = np.zeros(2, np.float32)
    for kw in (dict(scores=np.zeros(3, np.float32)), dict(members_ptr=np.array([0, 2])),
               dict(members=np.array([0, 1, 5])), dict(budget=-1), dict(window=-1),
               dict(scores=np.array(["a", "b"]))):
        args = dict(scores=sc, members_ptr=ptr, members=members, num_tokens=3, budget=2)
        args.update(kw)
        with pytest.raises(InvalidArgumentError):
            select_clusters(**args)
    with pytest.raises(InvalidArgumentError):
        group_queries(np.zeros((3, 4)), 2)
    with pytest.raises(InvalidArgumentError):
        score_medoids(np.zeros((4, 8), np.float16), np.zeros((1, 6), np.float32))
    with pytest.raises(SwarmError):
        MedoidSelector(None, score="max")


# -- the int8 medoid index against the exact score -----------------------------------

@pytest.fixture(scope="module")
def real_fp16_store(tmp_path_factory):
    """MiniLM over 2,304 tokens of real text in fp16, laid out and stored as
    the demo does: 2,048 context tokens, 256 held-out queries."""
    pytest.importorskip("torch")
    from conftest import DATA
    from swarmfs._demo import build_store
    from swarmfs.layout import LayoutParams
    from swarmfs.layout._capture import capture, read_text, stdlib_text
    wiki = DATA / "wikitext2_raw_test.raw"
    text = read_text(wiki, max_chars=30_000) if wiki.is_file() else stdlib_text(30_000)
    cap = capture(text=text, max_tokens=2304, dtype="float16", progress=False)
    store, _ = build_store(cap, tmp_path_factory.mktemp("i8") / "st", disks=2,
                           params=LayoutParams(), context=2048, force=True, progress=False)
    with store:
        yield store, cap


def _positions(li, sel, S):
    mem = [li.members[li.members_ptr[c]:li.members_ptr[c + 1]] for c in sel.clusters]
    return np.unique(np.concatenate(mem + [np.arange(S - sel.window, S)]))


@pytest.mark.slow
def test_int8_index_keeps_the_exact_selection_when_the_budget_is_everything(real_fp16_store):
    store, cap = real_fp16_store
    S = 2048
    exact, fast = MedoidSelector(store, index="exact"), MedoidSelector(store)
    for layer in store.layers:
        li = store.layer(layer)
        q = cap.q[layer][:, S:S + 4].transpose(1, 0, 2).astype(np.float32)
        for a, b in zip(exact.select(layer, q, budget=S, window=64),
                        fast.select(layer, q, budget=S, window=64), strict=True):
            assert a.entries == b.entries == S
            assert _positions(li, b, S).tolist() == list(range(S))
            # the choice rule stops at the same point; only the order may differ
            assert sorted(a.clusters.tolist()) == sorted(b.clusters.tolist())


@pytest.mark.slow
def test_int8_index_recall_on_a_real_fp16_layout(real_fp16_store):
    """Attention-mass recall of the int8 index within 0.01 of the exact score's
    (mean over 6 layers x 64 held-out queries; 0.0003 at 16K tokens in
    docs/benchmarks.md §9), and nearly the same entries."""
    from swarmfs.decode._report import attention_recall, token_mass
    store, cap = real_fp16_store
    S, budget, w = 2048, 205, 51
    exact, fast = MedoidSelector(store, index="exact"), MedoidSelector(store)
    rec = {"exact": [], "int8": []}
    overlap = []
    for layer in store.layers:
        li = store.layer(layer)
        k = cap.k[layer][:, :S].astype(np.float32)
        H = k.shape[0]
        for t in range(S, S + 64):
            q = cap.q[layer][:, t].astype(np.float32)
            lg = np.einsum("hgd,hsd->hgs", q.reshape(H, -1, q.shape[1]), k)
            mass = token_mass(lg.reshape(q.shape[0], 1, S) * cap.scaling)[0]
            pos = {}
            for name, sel in (("exact", exact), ("int8", fast)):
                x = sel.select(layer, q[None], budget=budget, window=w, li=li)[0]
                pos[name] = _positions(li, x, S)
                rec[name].append(attention_recall(mass, pos[name], budget)[0])
            overlap.append(np.intersect1d(pos["int8"], pos["exact"]).size / pos["exact"].size)
    assert np.mean(rec["int8"]) >= np.mean(rec["exact"]) - 0.01
    assert np.mean(overlap) >= 0.97
    assert np.mean(rec["exact"]) > 0.5          # the layout works at all


def test_medoid_selector_refuses_an_unknown_index():
    with pytest.raises(InvalidArgumentError):
        MedoidSelector(None, index="int4")
    for bad in (0, 3, True, 2.0, "2"):
        with pytest.raises(InvalidArgumentError, match="threads"):
            MedoidSelector(None, threads=bad)


@pytest.mark.slow
def test_two_thread_selection_chooses_what_one_thread_does(real_fp16_store):
    """MedoidSelector(threads=2) on a real layout: the same clusters and
    entries as one thread for held-out queries at r = 0.1."""
    store, cap = real_fp16_store
    S = 2048
    one, two = MedoidSelector(store), MedoidSelector(store, threads=2)
    for layer in store.layers:
        q = cap.q[layer][:, S:S + 16].transpose(1, 0, 2).astype(np.float32)
        for a, b in zip(one.select(layer, q, budget=205, window=51),
                        two.select(layer, q, budget=205, window=51), strict=True):
            assert a.clusters.tolist() == b.clusters.tolist() and a.entries == b.entries


# -- MedoidSelector against the rule written out in numpy --------------------------

@pytest.fixture(scope="module")
def small_fp16_store(tmp_path_factory):
    rng = np.random.default_rng(3)
    S, H, Hq, d = 600, 2, 8, 16
    s = Store.create(tmp_path_factory.mktemp("medoid") / "st", disks=2, num_layers=1,
                     num_kv_heads=H, head_dim=d, num_query_heads=Hq, dtype="float16")
    kv = random_kv(rng, S, H, d, "float16")
    s.write_layer(0, kv, random_clusters(rng, S, 40, 60), local_window=16)
    yield s, kv
    s.close()


def _devices():
    """None (the C kernels), torch on the CPU, and CUDA where a GPU exists."""
    out = [None, "cpu"]
    try:
        import torch
        if torch.cuda.is_available():
            out.append("cuda")
    except ImportError:
        out.remove("cpu")
    return out


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("score", ["prob", "logit"])
def test_exact_medoid_scores_are_the_per_head_rule(small_fp16_store, rng, score, device):
    """"prob": per query head, softmax over the clusters of q_h . k_medoid
    (scaled by head_dim**-0.5; query head h reads KV head h // 4), summed over
    heads; "logit": the plain sum of those logits.  ``select`` picks what
    :func:`select_clusters` picks from those scores.  The same on the C
    kernels and in torch on a device (issue 26's GPU score path)."""
    s, kv = small_fp16_store
    li = s.layer(0)
    sel = MedoidSelector(s, score=score, index="exact", device=device)
    q = rng.standard_normal((3, 8, 16)).astype(np.float32)
    kmed = kv[li.medoid, 0].astype(np.float64)                   # [C, H, d]
    logits = np.einsum("bhd,chd->bhc", q.astype(np.float64), kmed[:, np.arange(8) // 4])
    if score == "prob":
        x = logits * 16 ** -0.5
        e = np.exp(x - x.max(axis=2, keepdims=True))
        want = (e / e.sum(axis=2, keepdims=True)).sum(axis=1)
    else:
        want = logits.sum(axis=1)
    got = sel.scores(0, q)
    assert got.shape == (3, li.num_clusters)
    assert np.allclose(got, want, rtol=2e-3, atol=2e-3 * np.abs(want).max())
    for b in range(3):
        chosen = sel.select(0, q[b:b + 1], budget=120, window=16)[0]
        ref = select_clusters(got[b], li.members_ptr, li.members, num_tokens=600,
                              budget=120, window=16)
        assert chosen.clusters.tolist() == ref.clusters.tolist()
        assert chosen.entries == ref.entries >= 120


def test_pointers_out_of_order_are_refused_not_followed():
    """ptr [0, 2**40, 3] passed the first/last check and the C choice read
    members far outside the array (SIGSEGV)."""
    for ptr in ([0, 2**40, 3], [0, 3, 1, 3], [0, -1, 3]):
        with pytest.raises(InvalidArgumentError, match="in order"):
            select_clusters(np.array([1.0, 0.5, 0.2][:len(ptr) - 1], np.float32),
                            np.array(ptr), np.array([0, 1, 2]), num_tokens=4, budget=4)


# -- threads="auto" (issue 26) ------------------------------------------------------

def test_thread_chooser_follows_the_faster_setting_and_re_measures():
    """One thread first, then two; then the faster by moving average, the
    other re-measured at intervals that double while it keeps losing (so
    a steady load wastes few calls); a change of load (two threads turning
    slow, as when the model takes the other core) moves the choice within
    a few re-measurements; layers are apart."""
    from swarmfs.decode._selectors import ThreadChooser
    ch = ThreadChooser(explore_every=4, max_interval=64, alpha=0.5)
    assert ch.pick(0) == 1
    ch.record(0, 1, 100.0)
    assert ch.pick(0) == 2
    ch.record(0, 2, 60.0)
    picks = []
    for _ in range(200):
        t = ch.pick(0)
        picks.append(t)
        ch.record(0, t, 60.0 if t == 2 else 100.0)
    ones = [i for i, t in enumerate(picks) if t == 1]
    assert 3 <= len(ones) <= 8                         # 4, 8, 16, 32, 64, 64, ... apart
    gaps = np.diff(ones)
    assert gaps.tolist() == sorted(gaps.tolist()) and gaps[-1] <= 64
    for _ in range(300):                                # the other core gets busy
        t = ch.pick(0)
        ch.record(0, t, 180.0 if t == 2 else 100.0)
    last = [ch.pick(0) for _ in range(64)]
    assert last.count(2) <= 2 and ch.estimate(0)[2] > ch.estimate(0)[1]
    assert ch.pick(1) == 1 and ch.estimate(1) == {1: None, 2: None}


def test_auto_threads_select_what_one_thread_does(small_fp16_store, rng):
    """threads="auto" chooses the same clusters and entries as one thread,
    whichever count each call used, and measures both counts."""
    store, _ = small_fp16_store
    one, auto = MedoidSelector(store), MedoidSelector(store, threads="auto")
    assert auto.threads == "auto"
    for _ in range(40):
        q = rng.standard_normal((1, 8, 16)).astype(np.float32)
        a, = one.select(0, q, budget=60, window=8)
        b, = auto.select(0, q, budget=60, window=8)
        assert a.clusters.tolist() == b.clusters.tolist() and a.entries == b.entries
    est = auto.chooser.estimate(0)
    assert est[1] is not None and est[2] is not None
    with pytest.raises(InvalidArgumentError, match="threads"):
        MedoidSelector(store, threads="Auto")


def test_torch_score_path_serves_a_retriever_and_refuses_bad_devices(small_fp16_store, rng):
    """MedoidSelector(device=...) through a Retriever returns the entries the
    exact CPU score returns; its device copy counts as DRAM only on the CPU;
    a device torch does not know is an InvalidArgumentError."""
    pytest.importorskip("torch")
    s, _ = small_fp16_store
    cpu, dev = MedoidSelector(s, index="exact"), MedoidSelector(s, device="cpu")
    ra, rb = Retriever(s, ratio=0.2, selector=cpu), Retriever(s, ratio=0.2, selector=dev)
    for _ in range(5):
        q = rng.standard_normal((8, 16)).astype(np.float32)
        a, b = ra.retrieve(0, q, torch=False), rb.retrieve(0, q, torch=False)
        assert a.clusters.tolist() == b.clusters.tolist()
        assert np.array_equal(a.positions, b.positions) and same_bits(a.k, b.k)
    assert dev.dram_bytes(0) == 3 * cpu._medoids(0).nbytes      # fp16 keys + an fp32 copy
    for bad in ("tpu", "cuda:99", 3.5, "nope:0"):
        with pytest.raises(InvalidArgumentError, match="device"):
            MedoidSelector(s, device=bad)
