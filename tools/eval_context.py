#!/usr/bin/env python3
"""Does the decoder use its long context?  Issue 22's dense checks.

Dense attention (SDPA), no swarmfs, on text the decoder never trained on:

* ``python`` / ``prose``: the held-out split (:func:`swarmfs.models.heldout_texts`);
* ``code-ext``: third-party Python source, outside every training source
  (the installed ``click``, ``jinja2`` and ``markdown_it`` packages, files in
  path order);
* ``prose-ext``: English prose outside every training source: Debian's
  ``/usr/share/common-licenses`` texts (GPL, LGPL, GFDL, MPL, Apache,
  Artistic, CC0; read in place), then the long descriptions of the installed
  Python distributions (``*.dist-info/METADATA`` bodies).

Measurements:

1. **Perplexity against context**: the last ``--score`` tokens of a window,
   given 512, 2K, 8K and 16K tokens before them (the same scored tokens for
   every context length), averaged over ``--windows`` windows per text.
2. **Long-range copy**: a ``--passage``-token passage, then ``--gap``
   tokens of other text, then the passage again; the mean loss on the repeat
   against the mean loss on an unrelated passage in the same place (1.0: the
   copy far back is not used; 0: copied perfectly).
3. **Retrieval accuracy**: passkey and multi-key needle
   (:mod:`swarmfs.models.tasks`) at each ``--task-lengths``, exact match of
   the answer under teacher forcing, ``--task-samples`` seeded samples each,
   in held-out prose filler.

    tools/dev run python -m tools.eval_context --out docs/data/model/context.json
"""

from __future__ import annotations

import json
import math
import pathlib
import sys
import sysconfig
import time

import click
import numpy as np

from tools._options import COUNT, OutPath

CONTEXTS = (512, 2048, 8192, 16384)
EXT_PACKAGES = ("click", "jinja2", "markdown_it")


def code_ext() -> str:
    site = pathlib.Path(sysconfig.get_paths()["purelib"])
    parts = []
    for pkg in EXT_PACKAGES:
        for f in sorted((site / pkg).rglob("*.py")):
            parts.append(f"# file: {f.relative_to(site)}\n{f.read_text(errors='replace')}\n")
    return "".join(parts)


def prose_ext() -> str:
    lic = pathlib.Path("/usr/share/common-licenses")
    parts = [f.read_text(errors="replace") for f in sorted(lic.iterdir())
             if f.is_file() and not f.is_symlink()] if lic.is_dir() else []
    site = pathlib.Path(sysconfig.get_paths()["purelib"])
    for meta in sorted(site.glob("*.dist-info/METADATA")):
        text = meta.read_text(errors="replace")
        body = text.split("\n\n", 1)[1] if "\n\n" in text else ""
        if len(body) > 2000:
            parts.append(body)
    return "\n\n".join(parts)


def texts(kinds) -> dict[str, str]:
    from swarmfs.models import heldout_texts
    src = {"python": lambda: heldout_texts("python"), "prose": lambda: heldout_texts("prose"),
           "code-ext": code_ext, "prose-ext": prose_ext}
    return {k: src[k]() for k in kinds}


def token_nll(model, ids: np.ndarray) -> np.ndarray:
    """float64 [n-1] NLL of ids[1:] given the prefix, dense SDPA."""
    import torch
    with torch.no_grad():
        lg = model(torch.from_numpy(ids[None]), use_cache=False).logits[0, :-1].float()
        lp = torch.log_softmax(lg, -1)
        return (-lp.gather(-1, torch.from_numpy(ids[1:])[:, None])[:, 0]).double().numpy()


def ppl_by_context(model, ids: np.ndarray, windows: int, score: int, contexts) -> dict:
    """Perplexity of the same ``score`` tokens after each context length."""
    top = max(contexts)
    span = top + score
    if ids.size < span:
        return {}
    starts = np.linspace(0, ids.size - span, windows).astype(int)
    out = {}
    for c in contexts:
        nll = []
        for s in starts:
            w = ids[s + top - c:s + span]
            nll.append(token_nll(model, w)[-score:].mean())
        out[str(c)] = math.exp(float(np.mean(nll)))
    return out


def copy_ratio(model, ids: np.ndarray, passage: int, gap: int, trials: int, seed: int) -> dict:
    """Loss on a passage repeated ``gap`` tokens later / loss on an unrelated
    passage in the same place (same prefix)."""
    rng = np.random.default_rng(seed)
    need = passage * 2 + gap
    rep, unrel = [], []
    for _ in range(trials):
        s = int(rng.integers(0, ids.size - need - passage))
        p = ids[s:s + passage]
        f = ids[s + passage:s + passage + gap]
        u = ids[s + passage + gap:s + 2 * passage + gap]
        a = token_nll(model, np.concatenate([p, f, p]))[-(passage - 1):]
        b = token_nll(model, np.concatenate([p, f, u]))[-(passage - 1):]
        rep.append(a.mean())
        unrel.append(b.mean())
    return {"repeat_loss": float(np.mean(rep)), "unrelated_loss": float(np.mean(unrel)),
            "ratio": float(np.mean(rep) / np.mean(unrel)), "trials": trials, "gap": gap}


def task_accuracy(model, tok, filler: np.ndarray, task: str, length: int, n: int,
                  seed: int) -> float:
    import torch

    from swarmfs.models.tasks import Templates, make_sample
    t = Templates(lambda s: tok(s, add_special_tokens=False)["input_ids"])
    hits = 0
    for i in range(n):
        smp = make_sample(task, filler, length, [seed, length, i], t)
        a, b = smp.answer
        with torch.no_grad():
            lg = model(torch.from_numpy(smp.ids[None, :b - 1]), use_cache=False).logits[0]
        hits += bool((lg[a - 1:b - 1].argmax(-1).numpy() == smp.ids[a:b]).all())
    return hits / n


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--model", type=click.Path(exists=True, file_okay=False, path_type=pathlib.Path),
              default=None, help="decoder directory (default swarmfs.models.DEFAULT_DECODER)")
@click.option("--kinds", multiple=True, default=["python", "prose", "code-ext", "prose-ext"],
              type=click.Choice(["python", "prose", "code-ext", "prose-ext"]))
@click.option("--windows", type=COUNT, default=4)
@click.option("--score", type=COUNT, default=256)
@click.option("--passage", type=COUNT, default=160)
@click.option("--gap", type=COUNT, default=6000)
@click.option("--trials", type=COUNT, default=8)
@click.option("--task-lengths", default="8192,16384")
@click.option("--task-samples", type=COUNT, default=20)
@click.option("--seed", type=int, default=7)
@click.option("--threads", type=COUNT, default=2)
@click.option("--out", type=OutPath(), default=None)
def cli(**o):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swarmfs.models import DEFAULT_DECODER
    torch.set_num_threads(o["threads"])
    path = o["model"] or DEFAULT_DECODER
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    res = {"model": str(path), "ppl_by_context": {}, "copy": {}, "tasks": {}}
    t0 = time.perf_counter()
    ids = {k: np.asarray(tok(v, verbose=False)["input_ids"], np.int64)
           for k, v in texts(o["kinds"]).items()}
    for k, x in ids.items():
        res["ppl_by_context"][k] = ppl_by_context(model, x, o["windows"], o["score"], CONTEXTS)
        res["copy"][k] = copy_ratio(model, x, o["passage"], o["gap"], o["trials"], o["seed"])
        print(f"{k:10s} tokens {x.size:7d} ppl by context {res['ppl_by_context'][k]} "
              f"copy ratio {res['copy'][k]['ratio']:.3f}", file=sys.stderr, flush=True)
    from swarmfs.models import heldout_texts
    filler = np.asarray(tok(heldout_texts("prose"), verbose=False)["input_ids"], np.int64)
    for length in (int(x) for x in o["task_lengths"].split(",")):
        for task in ("passkey", "multikey"):
            acc = task_accuracy(model, tok, filler, task, length, o["task_samples"], o["seed"])
            res["tasks"][f"{task}@{length}"] = acc
            print(f"{task}@{length}: {acc:.2f}", file=sys.stderr, flush=True)
    res["seconds"] = time.perf_counter() - t0
    res["tokens"] = {k: int(x.size) for k, x in ids.items()}
    print(json.dumps({k: res[k] for k in ("ppl_by_context", "tasks")}, indent=1))
    if o["out"]:
        pathlib.Path(o["out"]).write_text(json.dumps(res, indent=1))
    return res


def main(argv=None):
    """Run :func:`cli` (``argv`` None: the command line)."""
    return cli.main(args=argv, standalone_mode=argv is None)


if __name__ == "__main__":
    sys.exit(main())
