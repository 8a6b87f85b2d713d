"""swarmfs.hf: SwarmCache and the "swarm" attention against transformers' DynamicCache.

Random-initialised small Llama, Qwen2, Qwen3 and Mistral models with GQA
(4 query heads, 2 KV heads), stores on tmp files.  With r = 1 the retrieved
set is the whole context, so decoding must give DynamicCache's logits.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import swarmfs  # noqa: E402
import swarmfs.hf as H  # noqa: E402
from swarmfs import ShapeError  # noqa: E402

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# max |logit difference| allowed, by dtype (the retrieved K/V are the same
# bytes in the same order, so in practice the difference is 0)
TOL = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 5e-2}
PROMPT, NEW = 64, 5


def make_model(arch: str, dtype: str = "float32", seed: int = 0, **over):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )
    Cfg, Model = {"llama": (LlamaConfig, LlamaForCausalLM),
                  "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                  "qwen3": (Qwen3Config, Qwen3ForCausalLM),
                  "mistral": (MistralConfig, MistralForCausalLM)}[arch]
    kw = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=128,
              max_position_embeddings=1024)
    if arch == "mistral":
        kw["sliding_window"] = None
    kw.update(over)
    torch.manual_seed(seed)
    model = Model(Cfg(**kw)).eval().to(DTYPES[dtype])
    model.set_attn_implementation("sdpa")
    return model


def prompt(n: int = PROMPT, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (1, n), generator=g)


def generate(model, ids, cache=None, n=NEW):
    with torch.no_grad():
        out = model.generate(ids, cache=cache, max_new_tokens=n, do_sample=False,
                             output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0)
    return out.sequences, torch.stack(out.logits).float()


def dense_generate(model, ids, n=NEW):
    model.set_attn_implementation("sdpa")
    return generate(model, ids, None, n)


def swarm_generate(model, ids, path, n=NEW, **kw):
    H.enable(model)
    cache = H.SwarmCache(path, model.config, disks=2, **kw)
    try:
        seq, logits = generate(model, ids, cache, n)
        return seq, logits, cache.summary(), cache
    finally:
        cache.close()


def manual_loop(model, ids, cache, steps):
    """Prefill, then greedy one-token forwards; returns the per-step logits."""
    out = []
    with torch.no_grad():
        o = model(ids, cache=cache, use_cache=True)
        out.append(o.logits[:, -1].float())
        tok = o.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            o = model(tok, cache=cache, use_cache=True)
            out.append(o.logits[:, -1].float())
            tok = o.logits[:, -1:].argmax(-1)
    return torch.cat(out)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("arch", ARCHS)
def test_whole_context_budget_equals_dynamic_cache(arch, dtype, tmp_path):
    model = make_model(arch, dtype)
    ids = prompt()
    seq_d, lg_d = dense_generate(model, ids)
    seq_s, lg_s, summ, _ = swarm_generate(model, ids, tmp_path / "gen", ratio=1.0)
    assert summ["steps"] == NEW - 1
    assert summ["entries"] > 0 and summ["bytes_read"] > 0       # really read from the disks
    assert torch.equal(seq_d, seq_s)
    assert float((lg_d - lg_s).abs().max()) <= TOL[dtype]

    # the same through a manual forward loop, DynamicCache against SwarmCache
    from transformers import DynamicCache
    model.set_attn_implementation("sdpa")
    ref = manual_loop(model, ids, DynamicCache(), 3)
    H.enable(model)
    with H.SwarmCache(tmp_path / "loop", model.config, ratio=1.0, disks=3) as cache:
        got = manual_loop(model, ids, cache, 3)
        assert cache.get_seq_length() == PROMPT + 3
        assert cache.store.num_tokens(0) == PROMPT           # nothing flushed yet: W steps
    assert float((ref - got).abs().max()) <= TOL[dtype]


def test_prefill_keeps_no_prefix_kv_in_dram(tmp_path):
    model = make_model("llama")
    ids = prompt(400)
    H.enable(model)
    with H.SwarmCache(tmp_path / "s", model.config, ratio=0.1, disks=2) as cache:
        generate(model, ids, cache, 3)
        st = cache.store
        full = 400 * st.entry_bytes * st.num_layers
        assert cache.dram_bytes() < full
        for layer in st.layers:           # window + hot clusters, not the prefix
            resident = int(cache.retriever.layer_state(layer).resident.sum())
            assert 0 < resident <= 400 // 4
        # layers are laid out: clusters with medoids, not one block
        assert all(st.num_clusters(li) > 1 for li in st.layers)


def test_decoder_layout_tau_default_and_override(tmp_path):
    """SwarmCache lays a prompt out at ``DECODER_TAU`` when its ``layout``
    gives no tau (the shipped decoder's rarely co-activated far-back keys
    lose recall at the offline default), and keeps a tau the caller sets."""
    from swarmfs import _defaults
    from swarmfs.layout import LayoutParams
    model = make_model("llama")
    ids = prompt(300)
    H.enable(model)
    for name, layout, want in (("default", None, _defaults.DECODER_TAU),
                               ("no-tau", LayoutParams(), _defaults.DECODER_TAU),
                               ("tau", LayoutParams(tau=0.6), 0.6)):
        with H.SwarmCache(tmp_path / name, model.config, ratio=0.1, disks=2,
                          layout=layout) as cache:
            generate(model, ids, cache, 1)
            for layer in cache.store.layers:
                assert cache.store.layer_record(layer).extra["layout"]["tau"] == want
    assert _defaults.DECODER_TAU == 0.2


def test_decoder_layout_representative_default_and_centroid(tmp_path):
    """The decoder path keeps ``DECODER_REPRESENTATIVE`` unless the layout
    names one; a centroid layout's index keys are its clusters' mean keys,
    also after decoding appended entries (r = 1 matches dense either way)."""
    from swarmfs import _defaults
    from swarmfs.layout import LayoutParams
    model = make_model("llama")
    ids = prompt(300)
    seq_d, lg_d = dense_generate(model, ids, 40)
    H.enable(model)
    for name, layout, want in (("default", None, _defaults.DECODER_REPRESENTATIVE),
                               ("centroid", LayoutParams(representative="centroid",
                                                         local_window=8), "centroid")):
        cache = H.SwarmCache(tmp_path / name, model.config, ratio=1.0, disks=2, layout=layout)
        with cache:
            seq, lg = generate(model, ids, cache, 40)
        assert torch.equal(seq, seq_d) and float((lg - lg_d).abs().max()) <= 1e-4
        from swarmfs import Store
        with Store.open(tmp_path / name) as st:
            for layer in st.layers:
                assert st.layer_record(layer).representative == want
                li = st.layer(layer)
                if want != "centroid":
                    continue
                assert li.num_tokens > 300                   # decoded entries were appended
                k = st.read_entries(layer, np.arange(li.num_tokens))[:, 0].astype(np.float64)
                means = np.stack([k[li.members[a:b]].mean(0) for a, b in
                                  zip(li.members_ptr[:-1], li.members_ptr[1:], strict=True)])
                assert np.allclose(st.medoid_keys(layer), means, rtol=1e-5, atol=1e-6)
    assert _defaults.DECODER_REPRESENTATIVE == "medoid"


def test_sparse_budget_differs_from_dense_by_a_small_amount(tmp_path):
    """r < 1 decodes; its logits move away from dense, less as r grows
    (measured on this random model: max |diff| ~0.15 at r = 0.1, ~0.05 at
    r = 0.5, logits up to ~0.5)."""
    model = make_model("llama")
    ids = prompt(300)
    seq_d, lg_d = dense_generate(model, ids, 5)
    diffs = {}
    for r in (0.1, 0.5):
        _, lg_s, summ, _ = swarm_generate(model, ids, tmp_path / f"r{r}", n=5, ratio=r)
        assert summ["entries"] <= 2 * (np.ceil(r * 300) + 64)   # budget per layer, 2 layers
        d = (lg_d[1:] - lg_s[1:]).abs()       # step 0 is the prefill's: dense, equal
        assert float((lg_d[0] - lg_s[0]).abs().max()) == 0.0
        diffs[r] = float(d.mean())
    assert 0 < diffs[0.5] < diffs[0.1] < 0.25     # measured: ~0.14 and ~0.05


def test_from_store_reuse_equals_fresh_prefill(tmp_path):
    model = make_model("qwen2")
    ids = prompt()
    H.enable(model)
    with H.SwarmCache(tmp_path / "doc", model.config, ratio=0.5, disks=2,
                      append=False) as fresh:
        seq_f, lg_f = generate(model, ids, fresh, 5)
    with H.SwarmCache.from_store(tmp_path / "doc", model.config, ratio=0.5) as again:
        assert again.get_seq_length() == PROMPT
        # the request starts with the stored document; generate feeds the rest
        seq, lg = generate(model, seq_f[:, :PROMPT + 1], again, 4)
        assert again.summary()["steps"] == 4
        assert again.layout_report == {}              # no prefill, no layout
    assert torch.equal(seq, seq_f)
    assert float((lg_f[1:] - lg).abs().max()) == 0.0
    # a second request from the same store (append=False left it unchanged),
    # its ids checked against the prompt's fingerprint recorded at prefill
    req = seq_f[:, :PROMPT + 1]
    with H.SwarmCache.from_store(tmp_path / "doc", model.config, ratio=0.5,
                                 input_ids=req) as third:
        seq3, lg3 = generate(model, req, third, 4)
        assert third.store.num_tokens(0) == PROMPT
    assert float((lg3 - lg).abs().max()) == 0.0


def test_from_store_refuses_a_request_that_does_not_continue_the_document(tmp_path):
    """Reusing a stored prefix for another document (or without a token
    after it) used to decode silently over the stored document's KV; with
    the request's ids, from_store checks them against the fingerprint the
    prefill recorded and refuses."""
    model = make_model("llama")
    H.enable(model)
    ids = prompt()
    with H.SwarmCache(tmp_path / "doc", model.config, ratio=0.5, disks=2,
                      append=False) as c:
        generate(model, ids, c, 2)
        assert c.store.layer_record(0).extra["prefix"] == H.prefix_fingerprint(ids[0].numpy())
    other = ids.clone()
    other[0, 3] = (other[0, 3] + 1) % model.config.vocab_size     # one token differs
    ext = torch.tensor([[1]])
    for bad, what in ((torch.cat([other, ext], 1), "not the stored prompt"),
                      (ids, "at least one more"),                 # no token after it
                      (ids[:, :-1], "at least one more"),         # shorter than the prompt
                      (torch.cat([ids, ext], 1).repeat(2, 1), "one sequence"),
                      (torch.cat([ids, ext], 1).float(), "one sequence")):
        with pytest.raises(ShapeError, match=what):
            H.SwarmCache.from_store(tmp_path / "doc", model.config, input_ids=bad)
    good = torch.cat([ids, ext], 1)
    with H.SwarmCache.from_store(tmp_path / "doc", model.config, input_ids=good) as again:
        assert again.get_seq_length() == ids.shape[1]
    # a model switched to the swarm attention without swarmfs.hf.enable has no
    # hook: its prefill records nothing, and asked to check, from_store says so
    bare = make_model("llama")
    H.register()
    bare.set_attn_implementation(H.ATTENTION)
    with H.SwarmCache(tmp_path / "noprint", bare.config, ratio=0.5, disks=2,
                      append=False) as c:
        generate(bare, ids, c, 2)
        assert "prefix" not in c.store.layer_record(0).extra
    with pytest.raises(ShapeError, match="no fingerprint"):
        H.SwarmCache.from_store(tmp_path / "noprint", model.config, input_ids=good)
    # appended tokens (append=True) are counted: the request must go past them,
    # and its prompt part is still checked
    with H.SwarmCache(tmp_path / "grown", model.config, ratio=0.5, disks=2) as c:
        seq = generate(model, ids, c, 3)[0]
    with H.SwarmCache.from_store(tmp_path / "grown", model.config) as c:
        stored = c.get_seq_length()                 # the new tokens were flushed at close
    assert stored > ids.shape[1]
    with pytest.raises(ShapeError, match="at least one more"):
        H.SwarmCache.from_store(tmp_path / "grown", model.config, input_ids=seq[:, :stored])
    H.SwarmCache.from_store(tmp_path / "grown", model.config,
                            input_ids=seq[:, :stored + 1]).close()
    bad = seq[:, :stored + 1].clone()
    bad[0, 0] = (bad[0, 0] + 1) % model.config.vocab_size
    with pytest.raises(ShapeError, match="not the stored prompt"):
        H.SwarmCache.from_store(tmp_path / "grown", model.config, input_ids=bad)


def test_store_shape_or_dtype_mismatch_raises_shape_error(tmp_path):
    model = make_model("llama")
    H.enable(model)
    with H.SwarmCache(tmp_path / "a", model.config, ratio=1.0, disks=2) as c:
        generate(model, prompt(), c, 2)
    other = make_model("llama", num_key_value_heads=4)
    with pytest.raises(ShapeError, match="KV heads: store 2, model 4"):
        H.SwarmCache.from_store(tmp_path / "a", other.config)
    half = make_model("llama", "float16")
    H.enable(half)
    with H.SwarmCache.from_store(tmp_path / "a", half.config) as c:
        with pytest.raises(ShapeError, match=r"dtype: store float32, model float16") as ei:
            generate(half, prompt(PROMPT + 1), c, 1)
        assert ei.value.layer == 0


def test_bad_use_raises_swarm_errors(tmp_path):
    model = make_model("llama")
    H.enable(model)
    with pytest.raises(swarmfs.ConfigError, match="needs the model config"):
        H.SwarmCache(tmp_path / "x")
    with pytest.raises(swarmfs.InvalidArgumentError):
        H.SwarmCache(tmp_path / "x", model.config, ratio=0)
    with pytest.raises(swarmfs.InvalidArgumentError):
        H.SwarmCache(tmp_path / "x", model.config, prefetch="later")
    with H.SwarmCache(tmp_path / "b", model.config) as c, \
            pytest.raises(ShapeError, match="batch size 1"), torch.no_grad():
        model(prompt().repeat(2, 1), cache=c)
    with H.SwarmCache(tmp_path / "c", model.config) as c:
        generate(model, prompt(), c, 1)
    with pytest.raises(swarmfs.StoreExistsError):
        H.SwarmCache(tmp_path / "c", model.config)
    with pytest.raises(swarmfs.StoreNotFoundError):
        H.SwarmCache.from_store(tmp_path / "none", model.config)
    short = make_model("mistral", sliding_window=32)
    H.enable(short)
    with H.SwarmCache(tmp_path / "d", short.config) as c, \
            pytest.raises(swarmfs.ConfigError, match="sliding window"), torch.no_grad():
        short(prompt(), cache=c)


def test_new_tokens_join_clusters_and_stay_exact(tmp_path):
    """Past W + 32 decode steps the DecodeSession appends matured tokens to
    the store (eq. 9); with r = 1 the logits still equal DynamicCache's."""
    from swarmfs.layout import LayoutParams
    model = make_model("qwen3")
    ids = prompt(64)
    n = 44
    seq_d, lg_d = dense_generate(model, ids, n)
    seq_s, lg_s, summ, cache = swarm_generate(model, ids, tmp_path / "s", n=n, ratio=1.0,
                                              layout=LayoutParams(local_window=8))
    assert float((lg_d - lg_s).abs().max()) <= TOL["float32"]
    st = swarmfs.Store.open(tmp_path / "s")
    try:
        # close() flushed every pending token: the store holds prompt + generated
        assert st.num_tokens(0) == 64 + n - 1
        assert st.num_clusters(0) > cache.layout_report[0]["clusters"]
    finally:
        st.close()


def test_prefetch_previous_query_is_exact_at_full_budget(tmp_path):
    model = make_model("llama")
    ids = prompt()
    seq_d, lg_d = dense_generate(model, ids, 6)
    seq_s, lg_s, summ, cache = swarm_generate(model, ids, tmp_path / "p", n=6, ratio=1.0,
                                              prefetch="previous")
    assert float((lg_d - lg_s).abs().max()) <= TOL["float32"]
    pre = [s for s in cache.stats if s.prefetched]
    assert len(pre) == 2 * 4           # every layer from the second decode step on
    assert summ["prefetch_hit"] == 1.0  # r = 1: the stale query selects everything too


@pytest.mark.parametrize("method", ["quest", "infllm", "pqcache"])
def test_baseline_layouts_decode_on_the_same_store(method, tmp_path):
    """The §8 baselines' layouts (swarmfs.layout._baselines) decode through the
    same store and Retriever: exact at r = 1, sparse below."""
    model = make_model("llama")
    ids = prompt(160)
    seq_d, lg_d = dense_generate(model, ids, 4)
    _, lg_s, summ, cache = swarm_generate(model, ids, tmp_path / "a", n=4, ratio=1.0,
                                          method=method)
    assert float((lg_d - lg_s).abs().max()) <= TOL["float32"]
    assert cache.retriever.selector.name == method
    _, lg_r, summ, _ = swarm_generate(model, ids, tmp_path / "b", n=4, ratio=0.2,
                                      method=method)
    assert summ["entries"] <= 2 * (32 + 64)
    assert float((lg_d[1:] - lg_r[1:]).abs().max()) > 0


def test_generate_with_past_key_values_keyword(tmp_path):
    """The issue's spelling: model.generate(..., past_key_values=SwarmCache(...))."""
    model = make_model("mistral", "bfloat16")
    ids = prompt()
    seq_d, lg_d = dense_generate(model, ids, 3)
    H.enable(model)
    with H.SwarmCache(tmp_path / "s", model.config, ratio=1.0, disks=2) as cache, \
            torch.no_grad(), pytest.warns(FutureWarning):
        out = model.generate(ids, past_key_values=cache, max_new_tokens=3, do_sample=False,
                             output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0)
        assert cache.get_seq_length() == PROMPT + 2
    assert torch.equal(out.sequences, seq_d)
    assert float((torch.stack(out.logits).float() - lg_d).abs().max()) <= TOL["bfloat16"]


def test_model_without_swarm_attention_is_refused_before_decoding(tmp_path):
    """A model left on SDPA would attend to the new token only: refused."""
    model = make_model("qwen3")                 # sdpa, not "swarm"
    with H.SwarmCache(tmp_path / "s", model.config, disks=2) as cache, torch.no_grad():
        model(prompt(), cache=cache, use_cache=True)     # prefill is dense either way
        with pytest.raises(swarmfs.ConfigError, match="did not attend through swarmfs"):
            model(prompt(1), cache=cache, use_cache=True)


@pytest.mark.parametrize("kw", [
    {"ratio": float("nan")}, {"ratio": "0.1"}, {"ratio": True},
    {"tau": float("nan")}, {"tau": "x"}, {"tau": 0}, {"tau": 1.5}, {"tau": None},
    {"prefetch": None}, {"method": "lru"}, {"hot_budget": float("nan")}, {"hot_budget": -0.1}])
def test_every_bad_argument_is_refused_before_the_prefill(tmp_path, kw):
    """A bad constructor argument is an InvalidArgumentError at once, before
    the prefill writes a store (tau='x' was a raw ValueError; tau=nan passed
    and failed only at the first decode step, after the store was written)."""
    model = make_model("llama")
    with pytest.raises(swarmfs.InvalidArgumentError):
        H.SwarmCache(tmp_path / "x", model.config, **kw)
    assert not (tmp_path / "x").exists()


def test_a_request_shorter_than_the_stored_prefix_is_a_shape_error(tmp_path):
    """generate() feeds the ids after the cache's length; with fewer ids
    than the stored prefix there are none, and torch failed with a raw
    RuntimeError ('cannot reshape tensor of 0 elements')."""
    model = make_model("llama")
    H.enable(model)
    with H.SwarmCache(tmp_path / "doc", model.config, ratio=1.0, disks=2) as c:
        generate(model, prompt(), c, 1)
    with H.SwarmCache.from_store(tmp_path / "doc", model.config) as again, \
            pytest.raises(ShapeError, match="no token after the 64"):
        generate(model, prompt()[:, :20], again, 1)


def test_concurrent_prefills_each_record_their_own_prompt(tmp_path):
    """enable()'s contract: forwards of one model on several threads at once,
    each with its own SwarmCache, each record their own prompt's fingerprint
    (the ids are kept per thread), and each store then accepts its own
    request and refuses the others'."""
    import threading
    model = make_model("llama")
    H.enable(model)
    prompts = [prompt(seed=s) for s in range(4)]
    errors_seen = []

    def prefill(i, rnd):
        try:
            with torch.no_grad(), H.SwarmCache(tmp_path / f"r{rnd}-{i}", model.config,
                                               ratio=0.5, disks=2, append=False) as c:
                model(prompts[i], cache=c, use_cache=True)
        except BaseException as exc:        # noqa: BLE001 -- reported below
            errors_seen.append(exc)

    for rnd in range(3):
        threads = [threading.Thread(target=prefill, args=(i, rnd)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads) and not errors_seen, errors_seen
    ext = torch.tensor([[1]])
    for rnd in range(3):
        for i in range(4):
            path = tmp_path / f"r{rnd}-{i}"
            H.SwarmCache.from_store(path, model.config,
                                    input_ids=torch.cat([prompts[i], ext], 1)).close()
            with pytest.raises(ShapeError, match="not the stored prompt"):
                H.SwarmCache.from_store(path, model.config,
                                        input_ids=torch.cat([prompts[(i + 1) % 4], ext], 1))


# -- issue 24: what a serving engine hits ---------------------------------------------

@pytest.mark.slow
def test_local_window_follows_the_growing_context(tmp_path):
    """Issue 24, input 2: a 16-token prompt at r = 0.1, then 600 generated
    tokens.  The window was frozen at the prefill's value (0) and right after
    a flush the tokens 2-4 back were not attended.  Now new tokens stay in
    DRAM for W steps and the stored window is min(W, S, ceil(rS) // 4) at
    the current S: at every step and layer the last 4 generated tokens are
    attended (the prompt's own, at S = 16, get the budget's rule: 2 entries,
    no window, and the 4 attention sinks)."""
    from swarmfs.decode._window import entry_budget, window_size
    model = make_model("llama")
    ids = prompt(16)
    H.enable(model)
    with H.SwarmCache(tmp_path / "s", model.config, ratio=0.1, disks=2, record=True) as c, \
            torch.no_grad():
        model.generate(ids, cache=c, max_new_tokens=600, min_new_tokens=600, do_sample=False,
                       pad_token_id=0)
        S = c.store.num_tokens(0)
        assert S > 16 + 200                     # tokens were appended (flushes happened)
        for layer in (0, 1):
            recs = c.records[layer]
            assert len(recs) == 599
            for step, (_, _, _, pos) in enumerate(recs):
                me = 16 + step                              # this step's own position
                back = set(range(max(me - 4, 16), me + 1))
                assert back <= set(pos.tolist()), (layer, step)
            want = window_size(min(256, S), entry_budget(0.1, S), S)
            assert c.retriever.window(layer).shape[0] == want > 0


def test_padding_never_reaches_the_layout(tmp_path):
    """Issue 24, input 3: the same 200 tokens with 27 left pads and an
    attention mask.  The pads were profiled and clustered (26 medoids),
    counted in r x S (23 entries per step against 20), and the logits
    differed by up to 0.88.  Now the store holds the 200 tokens in the same
    clusters, each step attends to as many entries, and the logits agree."""
    model = make_model("llama")
    ids = prompt(200, seed=4)
    ids[ids == 0] = 1                          # no pad id inside the prompt
    padded = torch.cat([torch.zeros(1, 27, dtype=torch.long), ids], 1)
    am = torch.cat([torch.zeros(1, 27, dtype=torch.long), torch.ones(1, 200, dtype=torch.long)], 1)
    H.enable(model)
    out = {}
    for name, x, m in (("plain", ids, torch.ones_like(ids)), ("padded", padded, am)):
        with H.SwarmCache(tmp_path / name, model.config, ratio=0.1, disks=2) as c, \
                torch.no_grad():
            o = model.generate(x, attention_mask=m, cache=c, max_new_tokens=6, min_new_tokens=6,
                               do_sample=False, pad_token_id=0, output_logits=True,
                               return_dict_in_generate=True)
            li = c.store.layer(1)
            out[name] = (o.sequences[0, x.shape[1]:], torch.stack(o.logits).float(),
                         c.store.num_tokens(1), li.members.copy(), li.medoid.copy(),
                         [s.entries for s in c.stats])
    (t0, l0, n0, m0, d0, e0), (t1, l1, n1, m1, d1, e1) = out["plain"], out["padded"]
    assert n0 == n1 == 200
    assert np.array_equal(m0, m1) and np.array_equal(d0, d1)     # the same clusters, medoids
    assert e0 == e1                                              # the same budget per step
    assert torch.equal(t0, t1) and float((l0 - l1).abs().max()) <= 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_casts_k_and_v_to_one_store_dtype(dtype, tmp_path):
    """Issue 24, input 4: under torch.autocast K arrives in float32 (RoPE)
    and V in the autocast dtype.  The prefill wrote a float32 store and the
    first decode step failed (a raw TypeError for bfloat16, a ShapeError
    naming V for float16).  Now both are cast to the autocast dtype, which
    SDPA computes in anyway: DynamicCache's tokens and logits exactly."""
    model = make_model("llama")
    ids = prompt(120)
    model.set_attn_implementation("sdpa")
    with torch.autocast("cpu", dtype=dtype):
        seq_d, lg_d = generate(model, ids, None, 6)
    H.enable(model)
    with torch.autocast("cpu", dtype=dtype), \
            H.SwarmCache(tmp_path / "s", model.config, ratio=1.0, disks=2) as c:
        seq_s, lg_s = generate(model, ids, c, 6)
        assert c.store.dtype == str(dtype).removeprefix("torch.")
    assert torch.equal(seq_d, seq_s) and float((lg_d - lg_s).abs().max()) == 0.0


def test_k_and_v_of_different_dtypes_are_refused_before_a_write(tmp_path):
    """Without autocast, K and V of different dtypes (or not the store's) are
    a ShapeError naming both, before any store exists."""
    model = make_model("llama")
    k = torch.randn(1, 2, 8, 16)
    with H.SwarmCache(tmp_path / "s", model.config) as c, \
            pytest.raises(ShapeError, match="K is float32 and V is bfloat16"):
        c.update(k, k.to(torch.bfloat16), 0)
    assert not (tmp_path / "s").exists()


def test_attention_sinks_stay_attended(tmp_path):
    """Issue 24, input 5: across 48 steps and 4 layers tokens 0-3 were
    never all attended.  With sinks (the default, 4) they are at every
    step and layer, from DRAM; sinks=0 leaves them to the selection."""
    model = make_model("llama", num_hidden_layers=4)
    ids = prompt(400, seed=2)
    H.enable(model)
    seen = {}
    for s in (4, 0):
        with H.SwarmCache(tmp_path / f"s{s}", model.config, ratio=0.1, disks=2, sinks=s,
                          record=True) as c:
            generate(model, ids, c, 49)
            assert s == 0 or c.dram_bytes() >= 4 * 4 * c.store.entry_bytes
            seen[s] = [set(range(4)) <= set(pos.tolist())
                       for layer in range(4) for *_, pos in c.records[layer]]
    assert len(seen[4]) == 4 * 48 and all(seen[4])
    assert not all(seen[0])
    from swarmfs import _defaults
    assert _defaults.ATTENTION_SINKS == 4


@pytest.mark.parametrize("kw", [{"prompt_lookup_num_tokens": 3}, {"assistant": True}])
def test_assisted_decoding_never_stores_rejected_drafts(kw, tmp_path):
    """Issue 24, input 6: assisted and prompt-lookup decoding were refused by
    transformers only after the draft tokens were fed, and close() then
    wrote them.  Now the prompt alone is laid out, drafts stay in DRAM until
    accepted, crop() drops the rejected ones: the tokens are plain greedy's
    and the store holds exactly what plain greedy decoding stores."""
    model = make_model("llama")
    ids = prompt(20).repeat(1, 6)                       # repeats: prompt lookup finds drafts
    if "assistant" in kw:
        kw = {"assistant_model": make_model("llama", seed=5)}
    H.enable(model)
    common = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0)
    with H.SwarmCache(tmp_path / "plain", model.config, ratio=1.0, disks=2) as c, \
            torch.no_grad():
        plain = model.generate(ids, cache=c, **common)
    dropped = []
    orig = swarmfs.DecodeSession.discard_pending

    def spy(self, n):
        dropped.append(n)
        return orig(self, n)
    swarmfs.DecodeSession.discard_pending = spy
    try:
        with H.SwarmCache(tmp_path / "assisted", model.config, ratio=1.0, disks=2) as c, \
                torch.no_grad():
            seq = model.generate(ids, cache=c, **common, **kw)
            assert c.layout_report[0]["clusters"] > 0
    finally:
        swarmfs.DecodeSession.discard_pending = orig
    assert torch.equal(seq, plain)
    assert sum(dropped) > 0                              # drafts were rejected and dropped
    with swarmfs.Store.open(tmp_path / "plain") as a, \
            swarmfs.Store.open(tmp_path / "assisted") as b:
        assert a.num_tokens(0) == b.num_tokens(0) == 120 + 23
        ea = a.read_entries(0, np.arange(143)).astype(np.float32)
        eb = b.read_entries(0, np.arange(143)).astype(np.float32)
        assert np.array_equal(ea[:120], eb[:120]) and np.abs(ea - eb).max() <= 1e-5
    # crop() refuses what is stored; assisted decoding from a stored document is refused
    with H.SwarmCache.from_store(tmp_path / "plain", model.config) as c:
        with pytest.raises(swarmfs.ConfigError, match="laid out on the disks"):
            c.crop(-1)
        with pytest.raises(swarmfs.ConfigError, match="new store"), torch.no_grad():
            model.generate(seq, cache=c, max_new_tokens=2, prompt_lookup_num_tokens=3,
                           pad_token_id=0)


def test_beam_search_is_refused_before_any_store_is_written(tmp_path):
    model = make_model("llama")
    H.enable(model)
    with H.SwarmCache(tmp_path / "s", model.config) as c:
        for kw in ({"num_beams": 2}, {"num_beams": 2, "do_sample": True}):
            with pytest.raises(swarmfs.ConfigError, match="beam"), torch.no_grad():
                model.generate(prompt(), cache=c, max_new_tokens=2, pad_token_id=0, **kw)
        with pytest.raises(swarmfs.ConfigError, match="beam search"):
            c.reorder_cache(torch.tensor([0]))
    assert not (tmp_path / "s").exists()


def test_background_upkeep_decodes_and_stores_as_inline(tmp_path):
    """upkeep="background" (issue 26): each layer's session upkeep runs on a
    worker thread after its attention; greedy tokens and logits at r = 0.1
    and the stored layers equal the inline run's, across flushes; it is
    refused beside a prefetch and for an unknown mode."""
    from swarmfs import Store
    from swarmfs.layout import LayoutParams
    model = make_model("llama")
    ids = prompt(300)
    runs = {}
    for mode in ("inline", "background"):
        H.enable(model)
        cache = H.SwarmCache(tmp_path / mode, model.config, ratio=0.1, disks=2,
                             layout=LayoutParams(local_window=16), upkeep=mode)
        with cache:
            seq, lg = generate(model, ids, cache, 60)
        with Store.open(tmp_path / mode) as st:
            state = [(st.layer(x).members.copy(), st.read_entries(x, np.arange(
                st.num_tokens(x))).copy()) for x in st.layers]
        runs[mode] = (seq, lg, state)
    (sa, la, xa), (sb, lb, xb) = runs["inline"], runs["background"]
    assert torch.equal(sa, sb) and torch.equal(la, lb)
    assert all(np.array_equal(m1, m2) and np.array_equal(k1.view(np.uint8), k2.view(np.uint8))
               for (m1, k1), (m2, k2) in zip(xa, xb, strict=True))
    assert all(m.shape[0] > 300 for m, _ in xa)          # decoded entries were flushed
    for kw, err in (({"upkeep": "background", "prefetch": "previous"},
                     swarmfs.InvalidArgumentError),
                    ({"upkeep": "thread"}, swarmfs.InvalidChoiceError)):
        with pytest.raises(err, match="upkeep"):
            H.SwarmCache(tmp_path / "bad", model.config, disks=2, **kw)
