#!/usr/bin/env python3
"""Evaluate swarm-llama on held-out text (issue 11, part 1; docs/model.md).

Three measurements, all on text the decoder never trained on
(:func:`swarmfs.models.heldout_documents`):

1. **Held-out perplexity** per source (stdlib Python files, WikiText-2,
   Tiny Shakespeare, GSM8K), over the first ``--tokens`` tokens of each, cut
   into non-overlapping ``--window``-token windows; every token but the first
   of a window is scored.  Next to it, with the same tokenizer and on the same
   target tokens: a unigram model (add-one) and an interpolated Kneser-Ney
   bigram model (discount 0.75), both counted on the training streams.
2. **Repeat check** (long context): a held-out passage of L tokens followed
   by itself (2L tokens, L = 2048 and 4096); mean loss on the repeat against
   mean loss on the first occurrence.  A model that copies from far back has a
   much lower loss on the repeat; the bigram model is shown for reference.
3. **Loss by position** on held-out 8192-token inputs (does the loss stay
   flat or fall as context grows up to the trained 8192 tokens).

Usage::

    .venv/bin/python -m tools.eval_decoder [--model DIR] [--json docs/data/model/eval.json]
"""

from __future__ import annotations

import json
import math
import pathlib
import platform
import sys
import time
import types

import click
import numpy as np

SOURCES = ("python", "wikitext2", "shakespeare", "gsm8k")


def heldout_ids(tok, source: str) -> np.ndarray:
    from swarmfs.models import heldout_documents, heldout_texts
    if source == "python":
        text = heldout_texts("python")
    else:
        text = next(d.text for d in heldout_documents("prose") if d.name == source)
    return np.asarray(tok(text, verbose=False)["input_ids"], dtype=np.int64)


class NGram:
    """Unigram (add-one) and interpolated Kneser-Ney bigram over token ids."""

    def __init__(self, streams: list[np.ndarray], vocab: int, discount: float = 0.75):
        self.V, self.d = vocab, discount
        uni = np.zeros(vocab, np.float64)
        keys = []
        for s in streams:
            uni += np.bincount(s, minlength=vocab)
            keys.append(s[:-1].astype(np.int64) * vocab + s[1:])
        self.p_uni = (uni + 1.0) / (uni.sum() + vocab)
        self.keys, self.counts = np.unique(np.concatenate(keys), return_counts=True)
        prev, nxt = self.keys // vocab, self.keys % vocab
        self.c_prev = np.bincount(prev, weights=self.counts, minlength=vocab)   # c(v)
        self.n1_prev = np.bincount(prev, minlength=vocab).astype(np.float64)     # N1+(v .)
        n1_next = np.bincount(nxt, minlength=vocab).astype(np.float64)           # N1+(. w)
        # continuation probability, add-one smoothed so unseen tokens keep mass
        self.p_cont = (n1_next + 1.0) / (n1_next.sum() + vocab)

    def unigram_nll(self, targets: np.ndarray) -> np.ndarray:
        return -np.log(self.p_uni[targets])

    def bigram_nll(self, prev: np.ndarray, targets: np.ndarray) -> np.ndarray:
        q = prev * self.V + targets
        i = np.clip(np.searchsorted(self.keys, q), 0, self.keys.size - 1)
        c = np.where(self.keys[i] == q, self.counts[i], 0).astype(np.float64)
        cv = self.c_prev[prev]
        seen = cv > 0
        safe = np.where(seen, cv, 1.0)
        lam = np.where(seen, self.d * self.n1_prev[prev] / safe, 1.0)
        p = np.where(seen, np.maximum(c - self.d, 0.0) / safe, 0.0) + lam * self.p_cont[targets]
        return -np.log(p)


def token_nll(model, ids: np.ndarray) -> np.ndarray:
    """Per-token NLL (nats) of ids[1:] given the prefix; one forward pass."""
    import torch
    with torch.inference_mode():
        x = torch.from_numpy(ids[None, :])
        logits = model(input_ids=x, use_cache=False).logits[0, :-1].float()
        return torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="none").numpy()


def repeat_nll(model, passage) -> tuple[np.ndarray, np.ndarray]:
    """Per-token NLL (nats) on a passage followed by itself: (first, repeat),
    the targets 1..L-1 of the first occurrence and L+1..2L-1 of the repeat
    (the copy check: a model that attends back scores the repeat far below
    the first occurrence)."""
    passage = np.asarray(passage, dtype=np.int64)
    L = passage.shape[0]
    nll = token_nll(model, np.concatenate([passage, passage]))   # nll[i] scores seq[i + 1]
    return nll[: L - 1], nll[L:]


def repeat_losses(model, passage) -> tuple[float, float]:
    """Mean NLL (nats/token) of :func:`repeat_nll`: (first, repeat)."""
    first, repeat = repeat_nll(model, passage)
    return float(first.mean()), float(repeat.mean())


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--model", type=click.Path(path_type=pathlib.Path), default=None,
              help="model directory (default: DEFAULT_DECODER)")
@click.option("--tokens", type=click.IntRange(min=2), default=16384,
              help="held-out tokens scored per source")
@click.option("--window", type=click.IntRange(min=2), default=2048)
@click.option("--threads", type=click.IntRange(min=1), default=2)
@click.option("--json", "json_path", type=click.Path(path_type=pathlib.Path), default=None)
def cli(**options):
    evaluate(types.SimpleNamespace(**options))


def main(argv=None):
    """Run :func:`cli` (``argv`` None: the command line, as a program)."""
    return cli.main(args=argv, obj=argv, standalone_mode=argv is None)


def evaluate(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swarmfs.models import DEFAULT_DECODER, training_texts
    torch.set_num_threads(args.threads)
    mdir = args.model or DEFAULT_DECODER
    t0, c0 = time.time(), time.process_time()
    tok = AutoTokenizer.from_pretrained(mdir)
    model = AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    V = model.config.vocab_size
    eos = tok.eos_token_id
    streams = []
    for d in training_texts():
        streams.append(np.asarray(tok(d.text)["input_ids"] + [eos], dtype=np.int64))
    ngram = NGram(streams, V)
    n_train = int(sum(s.size for s in streams))
    result = {"model": str(mdir), "cpu": platform.processor() or platform.machine(),
              "train_tokens_for_baselines": n_train, "perplexity": {}, "repeat": {},
              "by_position": {}}
    ids_by = {s: heldout_ids(tok, s) for s in SOURCES}

    # 1. held-out perplexity
    for src in SOURCES:
        ids = ids_by[src][: args.tokens]
        m, u, b = [], [], []
        for start in range(0, ids.size - 1, args.window):
            w = ids[start:start + args.window]
            if w.size < 2:
                continue
            m.append(token_nll(model, w))
            u.append(ngram.unigram_nll(w[1:]))
            b.append(ngram.bigram_nll(w[:-1], w[1:]))
        m, u, b = (float(np.concatenate(v).mean()) for v in (m, u, b))
        result["perplexity"][src] = {"tokens": int(ids.size),
                                     "model": math.exp(m), "bigram_kn": math.exp(b),
                                     "unigram": math.exp(u),
                                     "model_nll": m, "bigram_nll": b, "unigram_nll": u}
        print(f"[ppl] {src:12s} model {math.exp(m):8.2f}  bigram {math.exp(b):8.2f}  "
              f"unigram {math.exp(u):8.2f}  ({ids.size} tokens)", flush=True)

    # 2. repeat check
    for src in ("python", "wikitext2"):
        for L in (2048, 4096):
            passage = ids_by[src][:L]
            seq = np.concatenate([passage, passage])
            first, repeat = repeat_nll(model, passage)
            bnll = ngram.bigram_nll(seq[:-1], seq[1:])
            r = {"passage_tokens": L, "total_tokens": 2 * L,
                 "model_first": float(first.mean()), "model_repeat": float(repeat.mean()),
                 "bigram_first": float(bnll[: L - 1].mean()),
                 "bigram_repeat": float(bnll[L:].mean())}
            result["repeat"][f"{src}_{2 * L}"] = r
            print(f"[repeat] {src:10s} {L}+{L}: model first {r['model_first']:.3f} repeat "
                  f"{r['model_repeat']:.3f} nats/token (bigram {r['bigram_first']:.3f} / "
                  f"{r['bigram_repeat']:.3f})", flush=True)

    # 3. loss by position on an 8192-token held-out input
    edges = [1, 256, 1024, 2048, 4096, 8192]
    for src in ("python", "wikitext2"):
        nll = token_nll(model, ids_by[src][:8192])
        pos = np.arange(1, nll.size + 1)
        result["by_position"][src] = {f"{a}-{b}": float(nll[(pos >= a) & (pos < b)].mean())
                                      for a, b in zip(edges[:-1], edges[1:], strict=False)}
        print(f"[position] {src}: {result['by_position'][src]}", flush=True)
    result["wall_s"] = round(time.time() - t0, 1)
    result["cpu_s"] = round(time.process_time() - c0, 1)
    print(f"[eval] {result['wall_s']} s wall, {result['cpu_s']} s CPU")
    if args.json_path:
        args.json_path.parent.mkdir(parents=True, exist_ok=True)
        args.json_path.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
