"""swarmfs.hf batches (``_batch``): rows of different lengths, left padding,
rows finishing at different times, rows sharing a stored document.

The same random small Llama as tests/test_hf.py.  A batch row must decode
exactly as the same request alone: same tokens at any r, and at r = 1 the
logits of DynamicCache on the padded batch.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_hf import make_model  # noqa: E402

import swarmfs  # noqa: E402
import swarmfs.hf as H  # noqa: E402
from swarmfs import ConfigError, InvalidArgumentError, ShapeError  # noqa: E402

NEW = 5


def padded(lengths, seed=0, vocab=128):
    """Rows of random ids (none is 0, the pad id) left-padded to one length:
    (rows, ids [B, P], attention_mask [B, P])."""
    g = torch.Generator().manual_seed(seed)
    P = max(lengths)
    rows = [torch.randint(3, vocab, (n,), generator=g) for n in lengths]
    ids = torch.zeros(len(lengths), P, dtype=torch.long)
    am = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, P - len(r):] = r
        am[b, P - len(r):] = 1
    return rows, ids, am


def gen(model, ids, am, cache, n=NEW, **kw):
    """Greedy generate: (new tokens [B, n'], logits [B, n', vocab] float32)."""
    with torch.no_grad():
        o = model.generate(ids, attention_mask=am, cache=cache, max_new_tokens=n,
                           pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                           **{"do_sample": False, **kw})
    return o.sequences[:, ids.shape[1]:], torch.stack(o.logits, 1).float()


def live(tokens, eos: int = 2) -> int:
    """Steps of a row until and including its end-of-text (the config's, 2):
    generate pads it afterwards, and its later logits are of no token."""
    hit = (tokens == eos).nonzero()
    return int(hit[0, 0]) + 1 if hit.numel() else int(tokens.shape[0])


def alone(model, row, path, ratio, n=NEW, gen_kw=None, **kw):
    """One row decoded by itself (no padding)."""
    H.enable(model)
    with H.SwarmCache(path, model.config, ratio=ratio, disks=2, **kw) as c:
        return gen(model, row[None], torch.ones(1, len(row), dtype=torch.long), c, n,
                   **(gen_kw or {}))


def layer_arrays(path, layer=0):
    """A stored layer's entries (all tokens) and cluster table."""
    with swarmfs.Store.open(path) as s:
        li = s.layer(layer)
        kv = s.read_entries(layer, np.arange(s.num_tokens(layer)))
        return kv, li.members_ptr.copy(), li.members.copy(), li.medoid.copy()


@pytest.mark.parametrize("B", [2, 4, pytest.param(8, marks=pytest.mark.slow)])
def test_left_padded_batch_rows_decode_as_alone(B, tmp_path):
    """Each row of a left-padded batch gives its single-row tokens at r = 0.1
    and r = 1 (the same logits within 1e-4, the same layout: padding is
    not laid out), and at r = 1 DynamicCache's logits on the padded batch."""
    model = make_model("llama")
    lengths = [200 - 23 * i for i in range(B)]
    rows, ids, am = padded(lengths, seed=B)
    model.set_attn_implementation("sdpa")
    tok_d, lg_d = gen(model, ids, am, None)
    H.enable(model)
    for r in (1.0, 0.1):
        paths = [tmp_path / f"r{r}-row{i}" for i in range(B)]
        with H.SwarmCache(paths, model.config, ratio=r, disks=2) as c:
            tok_b, lg_b = gen(model, ids, am, c)
            assert c.num_rows == B and c.summary()["rows"] == B
            assert [s.num_tokens(0) for s in c.stores] == lengths      # no padding stored
        if r == 1.0:
            assert torch.equal(tok_b, tok_d)
            for i in range(B):
                n = live(tok_b[i])
                assert float((lg_b[i, :n] - lg_d[i, :n]).abs().max()) <= 1e-4
        for i in range(B):
            tok_1, lg_1 = alone(model, rows[i], tmp_path / f"alone-r{r}-{i}", r)
            n = tok_1.shape[1]
            assert torch.equal(tok_1[0], tok_b[i, :n]), (r, i)
            assert float((lg_1[0] - lg_b[i, :n]).abs().max()) <= 1e-4
            if i == B - 1:                       # the most padded row: the same layout
                kb, pb, mb, db = layer_arrays(paths[i])
                k1, p1, m1, d1 = layer_arrays(tmp_path / f"alone-r{r}-{i}")
                assert kb.shape == k1.shape and np.abs(kb - k1).max() <= 1e-5
                assert np.array_equal(pb, p1) and np.array_equal(mb, m1)
                assert np.array_equal(db, d1)


def test_rows_finish_at_different_times(tmp_path):
    """A row that generates its end-of-text stops taking tokens: generate
    keeps feeding it padding, which is neither attended, kept nor written;
    the other rows go on as alone, and each store holds what the row's
    single run stores."""
    model = make_model("llama")
    rows, ids, am = padded([90, 120, 70], seed=3)
    free, _ = alone(model, rows[0], tmp_path / "probe", 0.2, n=8,
                    gen_kw={"min_new_tokens": 8})       # row 0 without an end-of-text
    eos = int(free[0, 2])                               # ... make its third token one
    assert eos not in free[0, :2].tolist()
    ref = [alone(model, rows[i], tmp_path / f"alone{i}", 0.2, n=8, eos_token_id=eos,
                 gen_kw={"eos_token_id": eos}) for i in range(3)]
    paths = [tmp_path / f"row{i}" for i in range(3)]
    H.enable(model)
    with H.SwarmCache(paths, model.config, ratio=0.2, disks=2, eos_token_id=eos) as c:
        tok, _ = gen(model, ids, am, c, n=8, eos_token_id=eos)
        assert c.summary()["finished_rows"] >= 1
        steps = [len([s for s in c.stats if s.row == i and s.layer == 0]) for i in range(3)]
    assert tok[0, 2] == eos and (tok[0, 3:] == 0).all()      # generate pads the finished row
    assert steps[0] == 2 < steps[1]             # the padding it was fed was never attended
    for i in range(3):
        t1 = ref[i][0][0]
        assert torch.equal(tok[i, :t1.shape[0]], t1)
        with swarmfs.Store.open(paths[i]) as a, swarmfs.Store.open(tmp_path / f"alone{i}") as b:
            assert a.num_tokens(0) == b.num_tokens(0)     # prompt + tokens fed before its end
    with swarmfs.Store.open(paths[0]) as s:
        assert s.num_tokens(0) == 90 + 2


def test_rows_sharing_a_stored_document(tmp_path):
    """Rows continuing the same stored document share its store: one
    retrieval per layer and step serves them, yet each row attends to its
    own selection (its logits equal its single-row run); a shorter document
    in the same batch is padded on the left."""
    model = make_model("llama")
    H.enable(model)
    docs, _, _ = padded([160, 120], seed=7)
    for i, d in enumerate(docs):
        with H.SwarmCache(tmp_path / f"doc{i}", model.config, ratio=0.2, disks=2,
                          append=False) as c, torch.no_grad():
            model(d[None], cache=c, use_cache=True)
    g = torch.Generator().manual_seed(11)
    conts = [torch.randint(3, 128, (3,), generator=g) for _ in range(3)]
    which = [0, 0, 1]
    reqs = [torch.cat([docs[w], c]) for w, c in zip(which, conts, strict=True)]
    P = max(len(r) for r in reqs)
    ids = torch.zeros(3, P, dtype=torch.long)
    am = torch.zeros_like(ids)
    for b, r in enumerate(reqs):
        ids[b, P - len(r):] = r
        am[b, P - len(r):] = 1
    ref = []
    for b, r in enumerate(reqs):
        with H.SwarmCache.from_store(tmp_path / f"doc{which[b]}", model.config, ratio=0.2,
                                     input_ids=r[None]) as c:
            ref.append(gen(model, r[None], torch.ones(1, len(r), dtype=torch.long), c, 4,
                           min_new_tokens=4))
    calls = []
    orig = swarmfs.Retriever.retrieve

    def spy(self, layer, q, **kw):
        calls.append((self.store.path, layer, np.asarray(q).shape))
        return orig(self, layer, q, **kw)
    paths = [tmp_path / f"doc{w}" for w in which]
    with H.SwarmCache.from_store(paths, model.config, ratio=0.2, input_ids=ids,
                                 attention_mask=am) as c:
        assert len({id(s) for s in c.stores}) == 2 and c.get_seq_length() == 160
        swarmfs.Retriever.retrieve = spy
        try:
            tok, lg = gen(model, ids, am, c, 4, min_new_tokens=4)
        finally:
            swarmfs.Retriever.retrieve = orig
    shared = [x for x in calls if x[0].endswith("doc0")]
    assert shared and all(shape[0] == 2 for _, _, shape in shared)   # both rows, one read
    assert len(shared) == 2 * 6    # one per layer and token: the 3 new ones, 3 generated
    for b in range(3):
        t1, l1 = ref[b]
        n = t1.shape[1]
        assert torch.equal(tok[b, :n], t1[0])
        assert float((lg[b, :n] - l1[0]).abs().max()) <= 1e-4
    with pytest.raises(ShapeError, match="pad it on the left by 40"):
        H.SwarmCache.from_store(paths, model.config, input_ids=ids,
                                attention_mask=torch.ones_like(am))
    with pytest.raises(InvalidArgumentError, match="one store per row"):
        H.SwarmCache.from_store(paths, model.config, append=True)


def test_batch_refusals_come_before_any_store_is_written(tmp_path):
    model = make_model("llama")
    H.enable(model)
    rows, ids, am = padded([40, 30], seed=1)
    two = [tmp_path / "a", tmp_path / "b"]
    with H.SwarmCache(two[:1], model.config) as c, \
            pytest.raises(ShapeError, match="serves 1"):     # one store, two rows
        gen(model, ids, am, c)
    right = am.flip(1)                                       # right padding
    with H.SwarmCache(two, model.config) as c, torch.no_grad(), \
            pytest.raises(ShapeError, match="ends in padding"):
        model(ids.flip(1), attention_mask=right, cache=c, use_cache=True)
    assert not any(p.exists() for p in two)
    with pytest.raises(InvalidArgumentError, match="given twice"):
        H.SwarmCache([two[0], two[0]], model.config)
    with pytest.raises(InvalidArgumentError, match="one row"):
        H.SwarmCache(two, model.config, prefetch="previous")
    with pytest.raises(InvalidArgumentError):
        H.SwarmCache(two, model.config, sinks=-1)
    with pytest.raises(InvalidArgumentError):
        H.SwarmCache(two, model.config, eos_token_id="x")
    with H.SwarmCache(two, model.config) as c:
        with pytest.raises(ConfigError, match="beam search"):
            gen(model, ids, am, c, num_beams=2)
        with pytest.raises(ShapeError, match="would run 4 rows"):
            gen(model, ids, am, c, do_sample=True, num_return_sequences=2)
    assert not any(p.exists() for p in two)


def test_prefill_progress_counts_layers_and_rows(tmp_path):
    model = make_model("llama")
    H.enable(model)
    rows, ids, am = padded([50, 40, 30], seed=2)
    seen = []
    with H.SwarmCache([tmp_path / f"r{i}" for i in range(3)], model.config, disks=2,
                      progress=lambda *a: seen.append(a)) as c, torch.no_grad():
        model(ids, attention_mask=am, cache=c, use_cache=True)
    assert [x for x in seen if x[0] == "prefill"] == [("prefill", 1, 2), ("prefill", 2, 2)]
    for stage in ("layout", "write"):
        assert [x[1:] for x in seen if x[0] == stage] == [(i, 6) for i in range(1, 7)]
