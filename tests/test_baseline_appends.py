"""The §8 baselines keep decoding after appends (issue 23, item 4).

Quest, InfLLM and PQCache grow by their own rules while tokens are appended
(``layout._baselines.QuestAppend``/``InfLLMAppend``/``PQCacheAppend`` through
``DecodeSession(baseline=...)``): Quest appends aligned pages with their
min/max key bounds, InfLLM blocks with the representatives of its rule,
PQCache assigns new keys to its existing centroids.  The model tests decode
260 tokens after a 400-token prompt of held-out text with the shipped
decoder: at r = 1 the tokens and logits are dense decoding's, at r = 0.1 the
store's cluster table and the selector's index cover every entry exactly
once and follow the method's rule, and each retrieval stays within its
budget.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import random_kv
from swarmfs import Retriever, Store
from swarmfs import _errors as E
from swarmfs.decode._online import DecodeSession
from swarmfs.decode._selectors import BoundSelector, MultiVectorSelector, VectorSelector
from swarmfs.layout import _baselines as B

H, HQ, D = 2, 4, 16


def flat(k):
    """[n, 2, H, d] entries -> float32 [H, n, d] keys."""
    return np.ascontiguousarray(np.asarray(k)[:, 0].transpose(1, 0, 2), dtype=np.float32)


def baseline_store(path, rng, S, layout_of, dtype="float32"):
    """A one-layer store of S random entries laid out by a baseline:
    (store, kv [S, 2, H, d], layout)."""
    s = Store.create(path, disks=3, num_layers=1, num_kv_heads=H, head_dim=D,
                     num_query_heads=HQ, dtype=dtype)
    kv = random_kv(rng, S, H, D, dtype)
    lay = layout_of(rng.standard_normal((HQ, S, D)).astype(np.float32), flat(kv))
    s.write_layer(0, kv, (lay.ptr, lay.members), lay.medoids, freq=lay.freq, local_window=4)
    return s, kv, lay


def selector_of(lay):
    if lay.name == "quest":
        return BoundSelector({0: (lay.index["lo"], lay.index["hi"])})
    if lay.name == "infllm":
        return MultiVectorSelector({0: lay.index["reps"]}, name="infllm")
    return VectorSelector({0: lay.index["vectors"]}, name="pqcache")


LAYOUTS = {
    "quest": lambda q, k: B.quest_pages(k, page=16),
    "infllm": lambda q, k: B.infllm_blocks(q, k, block=16, reps=3),
    "pqcache": lambda q, k: B.kmeans_clusters(k, mean_size=8.0),
}


def clusters_of(li):
    return [li.members[li.members_ptr[c]:li.members_ptr[c + 1]] for c in range(li.num_clusters)]


# -- the rules, on arrays -------------------------------------------------------

def test_quest_fills_the_partial_page_then_appends_aligned_pages(rng):
    """37 stored tokens (pages 0-31, 32-36): new entries first fill page 2 up
    to 48, then make pages of 16; the bounds equal Quest's layout of the
    whole sequence, exactly."""
    k_all = rng.standard_normal((H, 37 + 40, D)).astype(np.float32)
    lay = B.quest_pages(k_all[:, :37], page=16)
    rule = B.append_rule(lay)
    assert isinstance(rule, B.QuestAppend) and rule.page == 16
    assert rule.count(37, ready=10, pending=14) == 0           # page 2 not full yet
    assert rule.count(37, ready=11, pending=14) == 11
    assert rule.count(37, ready=40, pending=45) == 27          # up to 64
    g = rule.place(lay.index, num_tokens=37, sizes=lay.sizes, k=k_all[:, 37:], n=27)
    assert g.joins[0].tolist() == list(range(12)) + [11] * 16
    assert g.joins[1].tolist() == [2] * 11 and g.new_cluster_size == 16
    assert g.medoids.tolist() == [48]
    whole = B.quest_pages(k_all[:, :64], page=16)
    assert np.array_equal(g.index["lo"], whole.index["lo"])
    assert np.array_equal(g.index["hi"], whole.index["hi"])
    # the old arrays are untouched (a retrieval may still score them)
    assert np.array_equal(lay.index["lo"], B.quest_pages(k_all[:, :37], page=16).index["lo"])
    with pytest.raises(E.LayoutError, match="last page"):    # not Quest's pages
        rule.place(lay.index, num_tokens=37, sizes=np.array([16, 16, 4]), k=k_all[:, 37:],
                   n=3)
    with pytest.raises(E.LayoutError, match="not extended"):
        rule.place({"lo": lay.index["lo"][:2], "hi": lay.index["hi"][:2]}, num_tokens=37,
                   sizes=lay.sizes, k=k_all[:, 37:], n=3)


def test_infllm_blocks_take_the_representatives_of_a_whole_sequence_layout(rng):
    """Blocks written once their `block` successors exist get the
    representatives a layout of the whole sequence gives them."""
    S0, n, block, reps = 64, 32, 16, 3
    q = rng.standard_normal((HQ, S0 + n + block, D)).astype(np.float32)
    k = rng.standard_normal((H, S0 + n + block, D)).astype(np.float32)
    lay = B.infllm_blocks(q[:, :S0], k[:, :S0], block=block, reps=reps)
    rule = B.append_rule(lay)
    assert (rule.block, rule.reps) == (block, reps)
    assert rule.count(S0, ready=40, pending=47) == 16          # block 2 waits for successors
    assert rule.count(S0, ready=40, pending=48) == 32
    g = rule.place(lay.index, num_tokens=S0, sizes=lay.sizes, k=k[:, S0:], q=q[:, S0:], n=n)
    whole = B.infllm_blocks(q, k, block=block, reps=reps)
    C = S0 // block
    assert np.array_equal(g.index["reps"][:C], lay.index["reps"])
    assert np.array_equal(g.index["reps"][C:], whole.index["reps"][C:(S0 + n) // block])
    assert g.medoids.tolist() == whole.medoids[S0 // block:(S0 + n) // block].tolist()
    assert g.joins[0].tolist() == [0] * (n + 1) and g.new_cluster_size == block
    with pytest.raises(E.ShapeError, match="queries"):
        rule.place(lay.index, num_tokens=S0, sizes=lay.sizes, k=k[:, S0:], n=n)


def test_pqcache_assigns_new_keys_to_their_nearest_centroid(rng):
    k = rng.standard_normal((H, 300, D)).astype(np.float32)
    lay = B.kmeans_clusters(k[:, :200], mean_size=10.0)
    rule = B.append_rule(lay)
    assert rule.count(200, ready=7, pending=9) == 7
    g = rule.place(lay.index, num_tokens=200, sizes=lay.sizes, k=k[:, 200:], n=100)
    x = B.flat_keys(k[:, 200:]).astype(np.float64)
    c = lay.index["vectors"].astype(np.float64)
    want = ((x[:, None, :] - c[None]) ** 2).sum(-1).argmin(1)
    assert g.joins[0].tolist() == list(range(101))
    assert g.joins[1].tolist() == want.tolist()
    assert g.medoids.size == 0 and np.array_equal(g.index["vectors"], lay.index["vectors"])


def test_co_activation_layouts_grow_by_eq9_and_token_order_by_none():
    ptr, members = np.array([0, 2, 5]), np.arange(5)
    swarm = B.Layout(name="swarm", ptr=ptr, members=members, medoids=np.array([0, 2]),
                     kind="medoid", index={}, freq=np.zeros(2, np.float32), params={},
                     seconds=0.0)
    assert B.append_rule(swarm) is None
    with pytest.raises(E.LayoutError, match="no append rule"):
        B.append_rule(B.token_order(40, group=8))


# -- the store, the selectors and the session ------------------------------------

def test_store_append_takes_the_new_clusters_medoids(tmp_path, rng):
    s, kv, lay = baseline_store(tmp_path / "s", rng, 40, LAYOUTS["quest"])
    with s:
        new = random_kv(rng, 20, H, D, "float32")
        for bad, what in (([41, 60], "its own"), ([44, 50], "its own"), ([56, 44], "its own"),
                          ([47], "one token position"), ([44.0, 59.0], "one token position")):
            with pytest.raises(E.ShapeError, match=what):
                s.append(0, new, new_cluster_size=16, medoids=np.array(bad))
        assert s.num_tokens(0) == 40                         # nothing was written
        s.append(0, new, new_cluster_size=16, medoids=[47, 59])
        li = s.layer(0)
        assert li.medoid[-2:].tolist() == [47, 59]
        half = s.entry_bytes // 2
        rows = np.ascontiguousarray(new[[7, 19]]).reshape(2, -1).view(np.uint8)
        assert np.array_equal(li.medoid_keys[-2:], rows[:, :half])


@pytest.mark.parametrize("cls", [BoundSelector, MultiVectorSelector, VectorSelector])
def test_a_selector_index_that_was_not_extended_is_refused(tmp_path, rng, cls):
    method = {BoundSelector: "quest", MultiVectorSelector: "infllm",
              VectorSelector: "pqcache"}[cls]
    s, kv, lay = baseline_store(tmp_path / "s", rng, 96, LAYOUTS[method])
    with s:
        r = Retriever(s, ratio=0.2, selector=selector_of(lay))
        q = rng.standard_normal((HQ, D)).astype(np.float32)
        before = r.retrieve(0, q, torch=False)
        s.append(0, random_kv(rng, 16, H, D, "float32"), new_cluster_size=16)
        r.refresh(0)
        with pytest.raises(E.LayoutError, match=f"{lay.num_clusters} rows for "
                                                 f"{lay.num_clusters + 1} clusters"):
            r.retrieve(0, q, torch=False)
        # an index with more rows than a (older) layer index scores its clusters only
        idx = r.selector.layer_index(0)
        grown = {x: np.concatenate([a, a[:1]]) for x, a in idx.items()}
        r.selector.replace(0, grown)
        sc = r.selector.scores(0, q[None], before.index)
        assert sc.shape == (1, lay.num_clusters)
        with pytest.raises(E.InvalidArgumentError):
            r.selector.replace(0, {"nope": grown[next(iter(grown))]})


def test_a_baseline_session_needs_a_given_index(tmp_path, rng):
    s, kv, lay = baseline_store(tmp_path / "s", rng, 64, LAYOUTS["quest"])
    with s:
        with pytest.raises(E.InvalidArgumentError, match="no given index"):
            DecodeSession(Retriever(s, ratio=0.2), 0, baseline=B.QuestAppend(16))
        with pytest.raises(E.InvalidArgumentError, match="append rule"):
            DecodeSession(Retriever(s, ratio=0.2, selector=selector_of(lay)), 0,
                          baseline="quest")
        short = BoundSelector({0: (lay.index["lo"][:-1], lay.index["hi"][:-1])})
        with pytest.raises(E.LayoutError, match="rows"):
            DecodeSession(Retriever(s, ratio=0.2, selector=short), 0,
                          baseline=B.QuestAppend(16))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["quest", "infllm", "pqcache"])
def test_sessions_grow_each_baseline_by_its_rule(tmp_path, rng, method):
    """120 steps of random entries after a 37-token prefix (a partial last
    page/block): several flushes, each followed by an index that fits the
    layer and covers every entry once; the index equals what the method's
    layout of the whole sequence holds (Quest, InfLLM's full blocks), or
    the nearest centroid (PQCache); the DRAM count includes the layer after
    every flush; a forced flush writes the rest."""
    S0, steps = 37, 120
    s, kv, lay = baseline_store(tmp_path / "s", rng, S0, LAYOUTS[method])
    with s:
        r = Retriever(s, ratio=0.25, selector=selector_of(lay))
        sess = DecodeSession(r, 0, window=3, flush_batch=8, baseline=B.append_rule(lay))
        new = random_kv(rng, steps, H, D, "float32")
        qs = rng.standard_normal((steps, HQ, D)).astype(np.float32)
        flushes = 0
        for t in range(steps):
            S = s.num_tokens(0)
            out = sess.step(qs[t], new[t, 0], new[t, 1])
            # the layer's DRAM state (window, index) is counted right after a flush too
            assert r.dram_bytes() >= r.selector.dram_bytes(0) + 3 * s.entry_bytes
            li = r.index(0)
            st, before = out.retrieval.stats, out.retrieval.index
            assert st.budget <= st.entries <= st.budget + before.sizes.max() - 1
            if out.flushed.size:
                flushes += 1
                assert out.flushed.tolist() == list(range(S, s.num_tokens(0)))
                for x in r.selector.layer_index(0).values():
                    assert x.shape[0] == li.num_clusters
            assert np.array_equal(np.sort(li.members), np.arange(li.num_tokens))
        assert flushes >= 3
        sess.flush()
        li = s.layer(0)
        S = li.num_tokens
        assert S0 + steps == S and sess.pending == 0
        assert np.array_equal(np.sort(li.members), np.arange(S))
        k_all = flat(np.concatenate([kv, new]))
        idx = r.selector.layer_index(0)
        if method == "quest":
            whole = B.quest_pages(k_all, page=16)
            assert np.array_equal(li.members_ptr, whole.ptr)
            assert np.array_equal(idx["lo"], whole.index["lo"])
            assert np.array_equal(idx["hi"], whole.index["hi"])
        elif method == "infllm":
            # blocks of 16 from 37 on (the prefill's short block stays short)
            assert li.sizes.tolist() == [16, 16, 5] + [16] * 7 + [8]
            q_all = np.concatenate([np.zeros((HQ, S0, D), np.float32),
                                    qs.transpose(1, 0, 2)], axis=1)
            r_all = B.representative_scores(q_all, k_all, window=16)
            for c in range(3, 10):               # the blocks written by the rule
                a = int(li.members_ptr[c])
                top = a + np.argsort(-r_all[a:a + 16], kind="stable")[:3]
                assert np.array_equal(idx["reps"][c], B.flat_keys(k_all, top))
                assert li.medoid[c] == top[0]
        else:
            c = idx["vectors"].astype(np.float64)
            x = B.flat_keys(k_all[:, S0:]).astype(np.float64)
            near = ((x[:, None, :] - c[None]) ** 2).sum(-1).argmin(1)
            cl = np.repeat(np.arange(li.num_clusters), li.sizes)
            assert np.array_equal(cl[np.argsort(li.members)][S0:], near)
            assert np.array_equal(idx["vectors"], lay.index["vectors"])
        assert s.verify() == []


# -- the shipped decoder ------------------------------------------------------------

PROMPT, NEW = 400, 260          # 259 decode steps after the prefill's token


@pytest.fixture(scope="module")
def decoder():
    """The shipped decoder, a 400-token held-out prompt and dense greedy
    decoding of it: (model, ids, tokens, logits)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swarmfs.models import DEFAULT_DECODER, heldout_texts
    tok = AutoTokenizer.from_pretrained(DEFAULT_DECODER)
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_DECODER, dtype=torch.float32).eval()
    ids = tok(heldout_texts("python")[:20_000], return_tensors="pt").input_ids[:, :PROMPT]
    assert ids.shape == (1, PROMPT)
    model.set_attn_implementation("sdpa")
    seq, logits = generate(model, ids, None)
    return model, ids, seq, logits


def generate(model, ids, cache):
    import torch
    with torch.no_grad():
        out = model.generate(ids, cache=cache, max_new_tokens=NEW, do_sample=False,
                             output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0)
    return out.sequences, torch.stack(out.logits).float()


def swarm_decode(decoder, path, method, ratio):
    import swarmfs.hf as hf
    model, ids, _, _ = decoder
    from swarmfs.layout import LayoutParams
    hf.enable(model)
    # W = 100: new entries mature after 100 steps, so 259 steps flush several times
    cache = hf.SwarmCache(path, model.config, ratio=ratio, disks=2, method=method,
                          record=True, layout=LayoutParams(local_window=100))
    try:
        seq, logits = generate(model, ids, cache)
    finally:
        cache.close()                # writes the pending entries (a forced flush)
        model.set_attn_implementation("sdpa")
    return seq, logits, cache


def check_layers(cache, method):
    """Every layer's cluster table and index cover each stored entry once,
    by the method's rule; returns the stored length."""
    S = PROMPT + NEW - 1
    with Store.open(cache.path) as st:
        for layer in range(st.num_layers):
            li = st.layer(layer)
            assert li.num_tokens == S
            assert np.array_equal(np.sort(li.members), np.arange(S))       # each once
            idx = cache.retriever.selector.layer_index(layer)
            for x in idx.values():
                assert x.shape[0] == li.num_clusters
            kv = st.read_entries(layer, np.arange(S))
            k = flat(kv)
            if method == "quest":             # aligned pages, exact bounds
                whole = B.quest_pages(k, page=16)
                assert np.array_equal(li.members_ptr, whole.ptr)
                assert np.array_equal(li.members, whole.members)
                assert np.array_equal(idx["lo"], whole.index["lo"])
                assert np.array_equal(idx["hi"], whole.index["hi"])
            elif method == "infllm":          # blocks of 64 from the prompt's end
                sizes = [64] * 6 + [16] + [64] * ((S - PROMPT) // 64) + \
                    [(S - PROMPT) % 64] * bool((S - PROMPT) % 64)
                assert li.sizes.tolist() == sizes
                assert np.array_equal(li.members, np.arange(S))
                q = np.stack([rec[0] for rec in cache.records[layer]], axis=1)  # [H_q, n, d]
                dec = k[:, PROMPT:]
                D_ = S - PROMPT
                # the session scores a block over the block and its 64 successors;
                # the forced flush at close, the `rest` pending then, over them
                sess, rule, rest = cache.sessions[layer], cache._row(0).doc.rules[layer], 0
                for _ in range(D_):
                    rest += 1
                    n = rule.count(0, max(rest - sess.window, 0), rest)
                    rest -= n if n >= sess.flush_batch else 0
                for c in range(7, li.num_clusters):
                    a = int(li.members_ptr[c]) - PROMPT
                    seg0 = a if a < D_ - rest else D_ - rest
                    seg1 = min(a + 128, D_) if a < D_ - rest else D_
                    rsc = B.representative_scores(q[:, seg0:seg1], dec[:, seg0:seg1],
                                                  window=64)[a - seg0:a - seg0 + 64]
                    n_blk = int(li.sizes[c])
                    top = np.argsort(-rsc[:n_blk], kind="stable")[:4]
                    top = np.concatenate([top, np.full(4 - top.size, top[0])])
                    assert np.array_equal(idx["reps"][c], B.flat_keys(dec, a + top))
                    assert li.medoid[c] == PROMPT + a + top[0]
            else:                             # nearest existing centroid, codebook kept
                prefill = B.kmeans_clusters(k[:, :PROMPT])          # the same seeded k-means
                assert np.array_equal(idx["vectors"], prefill.index["vectors"])
                c = idx["vectors"].astype(np.float64)
                x = B.flat_keys(k[:, PROMPT:]).astype(np.float64)
                d2 = ((x[:, None, :] - c[None]) ** 2).sum(-1)
                cl = np.repeat(np.arange(li.num_clusters), li.sizes)[np.argsort(li.members)]
                got = d2[np.arange(x.shape[0]), cl[PROMPT:]]
                assert np.all(got <= d2.min(1) * (1 + 1e-5) + 1e-5)
    return S


METHODS = ("quest", "infllm", "pqcache")


@pytest.mark.model
@pytest.mark.parametrize("method", METHODS)
def test_baseline_at_full_budget_decodes_as_dense(decoder, tmp_path, method):
    """r = 1 selects everything: 259 decode steps with appends give dense
    decoding's greedy tokens and logits.  (The local window is 100 tokens
    here, so entries wait 100 steps: InfLLM's blocks of 64 flush twice while
    decoding, the others four times, and the close writes the rest.)"""
    import torch
    _, _, seq_d, lg_d = decoder
    seq, lg, cache = swarm_decode(decoder, tmp_path / "s", method, 1.0)
    assert torch.equal(seq, seq_d)
    # float32 roundoff: the attention sums the entries in landing order
    # (DecodeSession's EntryBuffer), dense in position order
    assert float((lg - lg_d).abs().max()) <= 5e-5
    pend = [s.pending for s in cache.stats if s.layer == 0]
    flushes = sum(b < a for a, b in zip(pend, pend[1:], strict=False))
    assert flushes >= (2 if method == "infllm" else 4)
    check_layers(cache, method)


@pytest.mark.model
@pytest.mark.parametrize("method", METHODS)
def test_baseline_at_one_tenth_keeps_its_index_and_budget(decoder, tmp_path, method):
    """r = 0.1: the index covers every flushed entry exactly once by the
    method's rule, and each retrieval stays within ceil(r x S) entries plus
    less than one cluster; pending entries stay within the rule's window."""
    seq, lg, cache = swarm_decode(decoder, tmp_path / "s", method, 0.1)
    S = check_layers(cache, method)
    W = cache.sessions[0].window
    with Store.open(cache.path) as st:
        most = max(int(st.layer(layer).sizes.max()) for layer in range(st.num_layers))
    limit = {"quest": W + 32 + 16, "infllm": W + 64, "pqcache": W + 32}[method]
    sparse = 0
    for s in cache.stats:
        stored = PROMPT + s.step - s.pending
        budget = math.ceil(0.1 * stored)
        assert budget <= s.entries <= budget + most - 1
        assert s.pending <= limit
        sparse += s.entries < stored
    assert sparse == len(cache.stats)
    assert len(cache.stats) == 4 * (NEW - 1) and S == PROMPT + NEW - 1
    pend = [s.pending for s in cache.stats if s.layer == 0]
    flushes = sum(b < a for a, b in zip(pend, pend[1:], strict=False))
    assert flushes >= (2 if method == "infllm" else 3)



# -- SWARM's own state after appends ----------------------------------------------

@pytest.mark.parametrize("policy", ["swarm", "lru"])
def test_hot_sets_follow_the_clusters_appends_make(tmp_path, rng, policy):
    """New clusters made by eq. 9 appends are selected (r = 1) and compete
    for the hot set under both replacement policies (SWARM's eq. 6 and the
    Fig. 15 LRU baseline of tools/bench_decode.py); the hot mask, the
    frequencies and the DRAM count follow every flush."""
    from conftest import random_layer_store
    from tools.bench_decode import _lru_session
    s, kv, cl = random_layer_store(tmp_path / "s", rng, S=120, H=H, HQ=HQ, D=D, disks=2,
                                   clusters=12, hot=range(2), freq=np.ones(12),
                                   local_window=4)
    with s:
        r = Retriever(s, ratio=1.0)
        cls = DecodeSession if policy == "swarm" else _lru_session()
        sess = cls(r, 0, window=2, flush_batch=4, new_cluster_size=2, tau=0.05,
                   hot_budget_bytes=40 * s.entry_bytes)
        new = random_kv(rng, 40, H, D, "float16")
        admitted_new = 0
        for t in range(40):
            out = sess.step(rng.standard_normal((HQ, D)), new[t, 0], new[t, 1])
            assert r.dram_bytes() > 0
            C = s.num_clusters(0)
            assert r.hot(0).shape == (C,) and sess.freq.shape == (C,)
            admitted_new += int((out.admitted >= 12).sum())
        assert s.num_clusters(0) > 12
        if policy == "swarm":       # eq. 6 admits new clusters; LRU stamps them
            assert admitted_new > 0
        else:
            assert sess._last.shape == (s.num_clusters(0),) and sess._last[12:].min() > 0
        hot = r.hot(0)
        assert int(r.index(0).sizes[hot].sum()) * s.entry_bytes <= sess.hot_budget
