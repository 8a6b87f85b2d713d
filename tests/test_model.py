"""swarm-llama, the decoder trained here (tools/train_decoder.py, docs/model.md),
and the corpus split it was trained on (swarmfs.models)."""

import json
import os

import numpy as np
import pytest

from conftest import DATA
from swarmfs import InvalidArgumentError
from swarmfs.models import DEFAULT_DECODER, documents, heldout_documents, heldout_texts
from tools.eval_decoder import repeat_losses

needs_data = pytest.mark.skipif(not (DATA / "wikitext2_raw_test.raw").exists(),
                                reason="shared data (WikiText-2) not present")
needs_model = pytest.mark.skipif(not DEFAULT_DECODER.is_dir(),
                                 reason=f"trained decoder {DEFAULT_DECODER} not present")


# ----------------------------------------------------------------- corpus split
@needs_data
def test_heldout_split_is_disjoint_fixed_and_covers_both_kinds():
    docs = documents(DATA)
    held = [d for d in docs if d.heldout]
    train = [d for d in docs if not d.heldout]
    py_held = {d.name for d in held if d.kind == "python"}
    py_train = {d.name for d in train if d.kind == "python"}
    assert py_held and py_train and not (py_held & py_train)
    # about 5% of the stdlib files, chosen by hash: a fixed set, not the first or last few
    assert 0.02 < len(py_held) / (len(py_held) + len(py_train)) < 0.10
    assert py_held == {d.name for d in heldout_documents("python", DATA)}
    # prose: each source's held-out part is its tail, about 10%, and never in training
    for name in ("wikitext2", "shakespeare", "gsm8k"):
        (tr,) = [d for d in train if d.name == name]
        (ho,) = [d for d in held if d.name == name]
        assert 0.05 < len(ho.text) / (len(ho.text) + len(tr.text)) < 0.15
        assert ho.text[:200] not in tr.text
    assert heldout_documents(None, DATA) == held


@needs_data
def test_heldout_texts_are_long_and_reject_unknown_kinds():
    py = heldout_texts("python", DATA)
    prose = heldout_texts("prose", DATA)
    assert len(py) > 100_000 and "# file: stdlib/" in py
    assert len(prose) > 100_000
    with pytest.raises(InvalidArgumentError):
        heldout_texts("klingon", DATA)
    with pytest.raises(InvalidArgumentError):
        heldout_documents("code", DATA)


# ----------------------------------------------------------------- the model
@pytest.fixture(scope="module")
def decoder():
    if not DEFAULT_DECODER.is_dir():
        pytest.skip(f"trained decoder {DEFAULT_DECODER} not present")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.set_num_threads(2)
    tok = transformers.AutoTokenizer.from_pretrained(DEFAULT_DECODER)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        DEFAULT_DECODER, dtype=torch.float32, attn_implementation="sdpa").eval()
    return tok, model


@needs_model
def test_checkpoint_is_a_small_gqa_llama():
    cfg = json.loads((DEFAULT_DECODER / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]
    assert cfg["head_dim"] >= 32
    assert cfg["max_position_embeddings"] >= 16384
    weights = DEFAULT_DECODER / "model.safetensors"
    assert 1_000_000 < weights.stat().st_size <= 25 * 2**20
    assert (DEFAULT_DECODER / "tokenizer.json").is_file()


@needs_model
def test_loads_offline_and_generates(decoder):
    import torch
    tok, model = decoder
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    assert model.config.vocab_size == len(tok)
    prompt = "def read_file(path):\n    with open(path) as f:\n"
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    assert tok.decode(ids[0]) == prompt                      # byte-level BPE round-trips
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 12) or out[0, -1] == tok.eos_token_id
    assert torch.equal(out[0, : ids.shape[1]], ids[0])
    assert isinstance(tok.decode(out[0, ids.shape[1]:]), str)


@needs_model
@needs_data
def test_predicts_heldout_text_far_better_than_chance(decoder):
    """On held-out Python the trained model is far better than uniform; a
    random-initialised model of the same shape is not."""
    import torch
    import transformers
    tok, model = decoder
    ids = tok(heldout_texts("python", DATA)[:6000])["input_ids"][:300]
    assert len(ids) == 300
    first, _ = repeat_losses(model, ids)
    assert first < np.log(model.config.vocab_size) - 2.0
    torch.manual_seed(0)
    random_model = transformers.LlamaForCausalLM(model.config).eval()
    r_first, _ = repeat_losses(random_model, ids)
    assert not r_first < np.log(model.config.vocab_size) - 2.0


@needs_model
@needs_data
@pytest.mark.parametrize("passage", ["python", "prose", "random ids"])
def test_copies_a_repeated_passage(decoder, passage):
    """On a 300-token passage followed by itself, the loss on the repeat is far
    below (< 0.5x) the loss on the first occurrence: the model attends 300
    tokens back and copies.  Held-out Python, held-out prose, and uniformly
    random token ids (which only copying predicts: an induction head, not a
    memorised text).  A random-initialised model of the same shape fails."""
    import torch
    import transformers
    tok, model = decoder
    if passage == "random ids":
        ids = np.random.default_rng(0).integers(1, model.config.vocab_size, 300).tolist()
    else:
        ids = tok(heldout_texts(passage, DATA)[:6000])["input_ids"][:300]
    assert len(ids) == 300
    torch.manual_seed(0)
    random_model = transformers.LlamaForCausalLM(model.config).eval()
    r_first, r_repeat = repeat_losses(random_model, ids)
    assert not r_repeat < 0.5 * r_first
    first, repeat = repeat_losses(model, ids)
    assert repeat < 0.5 * first, (first, repeat)


# ----------------------------------------------------------------- the recipe's copy augmentation
def test_copy_augmentation_mixture_and_pairs():
    """``--repeat`` parts with one start step form a mixture; ``pairs`` windows
    are random-id segments each followed by itself, at varying distances."""
    from tools.train_decoder import batch_for, pick_mode, repeat_at
    assert repeat_at("0:0.8:pairs,300:0.2:pairs,300:0.3:double", 299) == [(0.8, "pairs")]
    assert repeat_at("0:0.8:pairs,300:0.2:pairs,300:0.3:double", 300) == [(0.2, "pairs"),
                                                                          (0.3, "double")]
    assert repeat_at("310:0.5", 0) == []
    assert [pick_mode([(0.2, "pairs"), (0.3, "double")], u) for u in (0.1, 0.2, 0.49, 0.5)] \
        == ["pairs", "double", "double", None]
    with pytest.raises(ValueError, match="add up"):
        repeat_at("0:0.7:pairs,0:0.7:double", 5)
    with pytest.raises(ValueError, match="mode"):
        repeat_at("0:0.5:copy", 5)
    streams = {"python": np.arange(5000, dtype=np.uint16) % 8000,
               "prose": np.arange(5000, dtype=np.uint16) % 7000}
    seq = 128
    rows = batch_for(streams, 0, 7, seq, 16, 0.5, [(1.0, "pairs")], 8192)
    assert rows.shape == (16, seq + 1) and rows.max() < 8192
    distances = set()
    for row in rows:
        pos = 0
        # walk the segments: a segment of n tokens is followed by the same n tokens
        while pos < seq + 1:
            left = seq + 1 - pos

            def repeats(n, row=row, pos=pos, left=left):
                m = min(n, left - n)
                return m > 0 and np.array_equal(row[pos:pos + m], row[pos + n:pos + n + m])

            n = next((n for n in range(4, seq // 4 + 1) if repeats(n)), None)
            if n is None:                  # the tail: a segment cut before its copy
                assert left <= seq // 4
                break
            distances.add(n)
            pos += 2 * n
    assert len(distances) > 10            # the copy distance varies
    plain = batch_for(streams, 0, 7, seq, 16, 0.5, [], 8192)
    assert not any(np.array_equal(a, b) for a, b in zip(rows, plain, strict=False))


def test_far_copy_augmentation_copies_short_passages_far_back():
    """``far`` windows hold 2 to 6 passages of 32 to 256 tokens, each a copy
    of text at least 1K tokens (a quarter of the window) earlier."""
    from tools.train_decoder import batch_for
    seq = 4096
    streams = {"python": np.arange(60_000, dtype=np.uint16),   # every token unique
               "prose": np.arange(60_000, dtype=np.uint16)}
    rows = batch_for(streams, 0, 3, seq, 8, 0.5, [(1.0, "far")], 8192)
    plain = batch_for(streams, 0, 3, seq, 8, 0.5, [], 8192)
    for row, base in zip(rows, plain, strict=True):
        first: dict[int, int] = {}
        copied = np.zeros(seq + 1, bool)
        for i, v in enumerate(row.tolist()):
            if v in first and i - first[v] >= seq // 4:
                copied[i] = True
            first.setdefault(v, i)
        assert copied.any() and not np.array_equal(row, base)
        edges = np.flatnonzero(np.diff(np.r_[0, copied.astype(int), 0]))
        runs = edges[1::2] - edges[::2]
        assert (runs >= 32).any() and copied.sum() <= 6 * 256     # passages may abut


def test_far_copy_mask_marks_the_copied_tokens_after_each_first():
    """``mark_copies``: the mask is True exactly on tokens of a ``far`` copy
    past its first token; each equals a token 1K+ back (every source token
    unique), and without ``far`` nothing is marked."""
    from tools.train_decoder import batch_for
    seq = 4096
    streams = {"python": np.arange(60_000, dtype=np.uint16),
               "prose": np.arange(60_000, dtype=np.uint16)}
    rows, mask = batch_for(streams, 0, 3, seq, 8, 0.5, [(1.0, "far")], 8192, mark_copies=True)
    assert np.array_equal(rows, batch_for(streams, 0, 3, seq, 8, 0.5, [(1.0, "far")], 8192))
    for row, m in zip(rows, mask, strict=True):
        first: dict[int, int] = {}
        far = np.zeros(seq + 1, bool)
        for i, v in enumerate(row.tolist()):
            far[i] = v in first and i - first[v] >= seq // 4
            first.setdefault(v, i)
        assert m.any() and not (m & ~far).any()         # marked -> a far copy
        assert 0 < (far & ~m).sum() <= 12               # unmarked: the copies' firsts
    _, none = batch_for(streams, 0, 3, seq, 8, 0.5, [(1.0, "span")], 8192, mark_copies=True)
    assert not none.any()
