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
    assert _defaults.DECODER_TAU == 0.3


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
