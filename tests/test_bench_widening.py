"""The evaluation's widening of a traced model into Qwen3-32B-sized entries
(``tools/bench/_common/widening.py``: ``Widening``, ``widen_kv``, ``widen_q``,
``narrow``, ``widen_flat``), for both traces' shapes: MiniLM (12 heads x 32,
no GQA, as 16 x 64) and the decoder (8 query heads over 2 KV heads x 32, as
Qwen3-32B's 64 query heads over 8 KV heads x 128).  Random small traces, no
model: every logit and the dense attention output from the widened arrays
must be the model's, and a whole-context budget must retrieve everything
through the real store, Retriever and selectors of every method.
"""

import numpy as np
import pytest

from swarmfs._errors import ShapeError
from swarmfs.decode._report import attention_logits
from swarmfs.layout import _baselines as B
from tools.bench import _common as C

SHAPES = {"minilm": C.MINILM_WIDENING, "decoder": C.DECODER_WIDENING}


def _softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _dense(q, k, v, scaling):
    """Dense attention of queries [H_q, d] over k, v [H_kv, S, d] (GQA):
    logits [H_q, S] and outputs [H_q, d], in float64 from the arrays given."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    kv_head = np.arange(q.shape[0]) // (q.shape[0] // k.shape[0])
    logits = np.einsum("hd,hsd->hs", q, k[kv_head]) * scaling
    return logits, np.einsum("hs,hsd->hd", _softmax(logits), v[kv_head])


def _random_trace(wide, rng, T):
    q = rng.standard_normal((wide.query_heads, T, wide.head_dim)).astype(np.float16)
    k = rng.standard_normal((wide.kv_heads, T, wide.head_dim)).astype(np.float16)
    v = rng.standard_normal((wide.kv_heads, T, wide.head_dim)).astype(np.float16)
    return q, k, v


def test_the_decoder_maps_like_qwen3_32b():
    w = C.DECODER_WIDENING
    assert (w.store_kv_heads, w.store_query_heads, w.store_head_dim) == (8, 64, 128)
    assert list(w.query_slots()) == [0, 1, 2, 3, 8, 9, 10, 11]
    assert list(C.MINILM_WIDENING.query_slots()) == list(range(12))
    assert w.entry_bytes == C.MINILM_WIDENING.entry_bytes == C.ENTRY_BYTES == 4096
    with pytest.raises(ShapeError):                 # a GQA group larger than the store's
        C.Widening(1, 16, 32, 8, 64, 128)


@pytest.mark.parametrize("kind", SHAPES)
def test_widened_logits_and_attention_are_the_models(kind, rng):
    wide = SHAPES[kind]
    S = 53
    q, k, v = _random_trace(wide, rng, S)
    q = q[:, 0].astype(np.float32)                                      # one query
    scaling = 0.37                                                      # any model scale
    kv = C.widen_kv(k, v, wide)
    assert kv.shape == (S, 2, wide.store_kv_heads, wide.store_head_dim)
    assert kv.dtype == np.float16 and kv[0].nbytes == C.ENTRY_BYTES
    qw = C.widen_q(q, scaling, wide)
    assert qw.shape == (wide.store_query_heads, wide.store_head_dim)
    kw, vw = kv[:, 0].transpose(1, 0, 2), kv[:, 1].transpose(1, 0, 2)  # [H_kv', S, D]
    # the store's softmax scale is its head_dim ** -0.5
    lw, ow = _dense(qw, kw, vw, wide.store_head_dim ** -0.5)
    lm, om = _dense(q, k, v, scaling)
    slots = wide.query_slots()
    np.testing.assert_allclose(lw[slots], lm, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ow[slots, :wide.head_dim], om, rtol=1e-5, atol=1e-6)
    assert not ow[slots, wide.head_dim:].any()
    other = np.setdiff1d(np.arange(wide.store_query_heads), slots)
    assert not lw[other].any()                                          # zero heads: flat
    # the report's logits (the evaluation's accuracy path) agree as well
    rl = attention_logits(qw[:, None], kw, wide.store_head_dim ** -0.5)[:, 0]
    np.testing.assert_allclose(rl[slots], lm, rtol=1e-4, atol=1e-4)
    # narrow undoes widen; index vectors widen like the entries' keys
    assert np.array_equal(C.narrow(vw, wide), v)
    flat = B.flat_keys(k)                                               # [S, H_kv * d]
    np.testing.assert_array_equal(C.widen_flat(flat, wide), kv[:, 0].reshape(S, -1))
    with pytest.raises(ShapeError):
        C.widen_q(q[:, :-1], scaling, wide)


@pytest.mark.parametrize("kind", SHAPES)
def test_whole_context_budget_retrieves_everything(kind, rng, tmp_path):
    """r = 1 through the harness (store, Retriever, every method's selector,
    the model's queries widened): recall 1 and the dense attention output."""
    wide = SHAPES[kind]
    S, T = 320, 400
    q, k, v = _random_trace(wide, rng, T)
    tr = C.Trace(q=q, k=k, v=v, scaling=wide.head_dim ** -0.5,
                 segments={"wikitext2": (0, T)}, meta={"model": f"random {kind}"},
                 path=tmp_path / f"trace-random-{kind}-{T}.safetensors", kind=kind,
                 wide=wide, window=T)
    qs, ks = q[:, :S], k[:, :S]
    layouts = {"swarm": B.swarm(qs, ks, ratio=0.1, scaling=tr.scaling),
               "no_cluster": B.token_order(S, group=64),
               "infllm": B.infllm_blocks(qs, ks, block=32, reps=2),
               "pqcache": B.kmeans_clusters(ks, mean_size=8.0, chunk=128),
               "quest": B.quest_pages(ks, page=16)}
    cfg = C.BenchConfig(name="test", disks="files:2", cache=tmp_path, block_s=0, warmup_s=0)
    bench = C.Bench(tmp_path / "store", C.resolve_disks("files:2"), tr, 0, S,
                    [C.Variant(m, lay) for m, lay in layouts.items()], cfg=cfg, ratio=1.0)
    try:
        assert bench.store.model.num_query_heads == wide.store_query_heads
        for m in layouts:
            for p in C.query_positions(tr, 0, S, 3):
                x = bench.record(m, int(p))
                assert x["entries"] >= S and x["recall"] == pytest.approx(1.0, abs=1e-9), m
                assert x["mass"] == pytest.approx(1.0, abs=1e-5)
                assert x["rel_error"] < 1e-5, (m, x["rel_error"])
    finally:
        bench.close()


def test_decoder_decode_queries_continue_the_context_window(rng):
    """Held-out queries inside the context's last window come from the
    trace; past its end, from that window's causal continuation (tail)."""
    W, T, tail = 64, 200, 16
    wide = C.DECODER_WIDENING
    q, k, v = _random_trace(wide, rng, T)
    q_tail = rng.standard_normal((8, -(-T // W), tail, wide.head_dim)).astype(np.float16)
    tr = C.Trace(q=q, k=k, v=v, scaling=wide.head_dim ** -0.5,
                 segments={"gsm8k": (70, 130)}, meta={},
                 path=None, kind="decoder", wide=wide, window=W, q_tail=q_tail, align=W)
    assert tr.start("gsm8k") == 128                       # the first window boundary in it
    assert tr.query_limit(64) == 64 + tail and tr.query_limit(100) == 128 + tail
    got = tr.decode_queries([100, 127, 128, 143], 100)
    np.testing.assert_array_equal(got[:2], q[:, [100, 127]].transpose(1, 0, 2))
    np.testing.assert_array_equal(got[2:], q_tail[:, 1, [0, 15]].transpose(1, 0, 2))
    np.testing.assert_array_equal(tr.decode_queries([64], 64)[0], q_tail[:, 0, 0])
    assert list(C.query_positions(tr, 0, 120, 5)) == [120, 128, 136]
    with pytest.raises(SystemExit):
        tr.decode_queries([144], 100)
    with pytest.raises(SystemExit):
        C.context(tr, 80, "gsm8k")                        # runs past the trace's end
