"""``swarmfs generate``: decode a causal LM with its KV cache on swarmfs.

Two pipelines over :class:`swarmfs.hf.SwarmCache`:

* :func:`run_generate` prefills a prompt densely, lays its KV out on N disks
  and decodes greedily, streaming the text; the report holds per-step
  retrieval figures (clusters, SSD entries, bytes, µs per stage, hit rates).
  Given an existing store it serves the stored document instead (the
  prompt must continue it; its fingerprint is checked), with no prefill.
* :func:`run_evaluate` holds out the last N tokens of a text as the
  continuation and teacher-forces them through dense attention (one causal
  forward, transformers' SDPA) and through swarmfs (prefill of the context,
  then one decode step per continuation token), and reports both
  perplexities and the attention-mass recall of every swarmfs retrieval
  against the oracle top-k over the stored context (SWARM §8.1-8.2).
"""

from __future__ import annotations

import math
import os
import pathlib
import shutil
import signal
import tempfile
import threading
import time

import numpy as np

from . import _defaults as defaults
from . import _errors as errors

__all__ = ["default_model_dir", "heldout_input", "load_model", "load_tokenizer", "check_length",
           "trained_length", "recall_report", "run_evaluate", "run_generate", "teacher_force"]


def default_model_dir() -> pathlib.Path:
    """The decoder trained for swarmfs (``swarmfs.models.DEFAULT_DECODER``).

    Raises:
        ModelError: it is not installed.
    """
    decoder: pathlib.Path | None
    try:
        from .models import DEFAULT_DECODER as decoder
    except ImportError:
        decoder = None
    if decoder is None or not pathlib.Path(decoder, "config.json").exists():
        raise errors.ModelError("no default decoder is installed (swarmfs.models.DEFAULT_DECODER); "
                                "pass --model DIR (a local transformers causal LM)")
    return pathlib.Path(decoder)


def _model_path(model_dir) -> pathlib.Path:
    path = pathlib.Path(model_dir) if model_dir is not None else default_model_dir()
    if not (path / "config.json").exists():
        raise errors.ModelError(f"{path} is not a model directory (no config.json)")
    return path


def load_tokenizer(model_dir=None):
    """The tokenizer and config of a local causal LM, without its weights
    (what the checks before any work need).

    Returns:
        (tokenizer, config).

    Raises:
        ModelError: the directory does not hold a tokenizer and a config.
    """
    from transformers import AutoConfig, AutoTokenizer
    path = _model_path(model_dir)
    try:
        return AutoTokenizer.from_pretrained(str(path)), AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError, KeyError) as exc:
        raise errors.ModelError(f"cannot load a tokenizer and config from {path}: {exc}") from None


def trained_length(model_dir, config) -> int | None:
    """Tokens of context the model was trained on, where known: the RoPE
    scaling's ``original_max_position_embeddings``, or the shipped decoder's
    (``swarmfs.models.DECODER_TRAINED_TOKENS``); None otherwise."""
    for key in ("rope_parameters", "rope_scaling"):
        rp = getattr(config, key, None)
        if isinstance(rp, dict) and isinstance(rp.get("original_max_position_embeddings"), int):
            return int(rp["original_max_position_embeddings"])
    try:
        from .models import DECODER_TRAINED_TOKENS, DEFAULT_DECODER
    except ImportError:
        return None
    if model_dir is None or pathlib.Path(model_dir).resolve() == pathlib.Path(
            DEFAULT_DECODER).resolve():
        return int(DECODER_TRAINED_TOKENS)
    return None


def check_length(config, tokens: int, new_tokens: int, *, model_dir=None) -> str | None:
    """Check a request's length against the model before any work.

    Args:
        config: the model's config; tokens: the prompt's; new_tokens: to decode.

    Returns:
        A warning (str) when the request runs past the model's trained
        length (its quality there is unknown), else None.

    Raises:
        InvalidArgumentError: past the model's positions
            (``max_position_embeddings``): RoPE has no angles for them.
    """
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    total = int(tokens) + int(new_tokens)
    positions = getattr(cfg, "max_position_embeddings", None)
    if isinstance(positions, int) and total > positions:
        raise errors.InvalidArgumentError(
            f"the prompt has {tokens} tokens and {new_tokens} more would be decoded: "
            f"{total} > the model's {positions} positions; shorten the prompt")
    trained = trained_length(model_dir, cfg)
    if trained is not None and total > trained:
        return (f"the prompt has {tokens} tokens and {new_tokens} more would be decoded: "
                f"{total} > the {trained} the model was trained on; past them its output "
                "degrades (and the prefill of a long prompt takes minutes)")
    return None


def load_model(model_dir=None, dtype: str | None = None):
    """Load a local causal LM and its tokenizer, with the ``"swarm"`` attention.

    Args:
        model_dir: directory (default :func:`default_model_dir`).
        dtype: ``"float32"``, ``"float16"``, ``"bfloat16"`` (default: float32).

    Returns:
        (model in eval mode, tokenizer).

    Raises:
        ModelError: the directory does not hold a loadable causal LM.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from . import hf
    path = _model_path(model_dir)
    tdt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           None: torch.float32}[dtype]
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=tdt)
    except (OSError, ValueError, KeyError) as exc:
        raise errors.ModelError(f"cannot load a causal LM from {path}: {exc}") from None
    hf.enable(model)
    return model.eval(), tok


def _tokens(tok, text: str):
    import torch
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    if ids.shape[1] == 0:
        raise errors.InvalidArgumentError("the prompt has no tokens")
    return ids.to(torch.long)


class _Streamer:
    """A transformers streamer that hands decoded text pieces to a callback."""

    def __init__(self, tok, on_text, skip: int):
        self.tok, self.on_text, self.skip = tok, on_text, skip
        self.ids: list[int] = []
        self.printed = 0
        self.first = True

    def put(self, value):
        if self.first:            # generate() passes the prompt first
            self.first = False
            return
        self.ids.extend(int(x) for x in value.reshape(-1))
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            self.on_text(text[self.printed:])
            self.printed = len(text)

    def end(self):
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if len(text) > self.printed:
            self.on_text(text[self.printed:])


def _open_cache(model, store, *, ratio, disks, force, engine, prefetch, record, append=True,
                sinks=None, progress=None):
    from . import hf
    kw = {} if sinks is None else {"sinks": sinks}
    return hf.SwarmCache(store, model.config, ratio=ratio, disks=disks, force=force,
                         engine=engine, prefetch=prefetch, record=record, append=append,
                         progress=progress, **kw)


def is_store(path) -> bool:
    """Whether ``path`` holds a store (its manifest)."""
    return path is not None and os.path.exists(os.path.join(path, "manifest.json"))


class _Terminated(SystemExit):
    """SIGTERM, raised in the main thread like Ctrl-C's KeyboardInterrupt so
    that every ``with`` and ``finally`` runs (exit status 143 = 128 + 15)."""

    def __init__(self):
        super().__init__(128 + signal.SIGTERM)


def _on_sigterm(signum, frame):
    raise _Terminated()


class _StoreDir:
    """The store directory: the given one, or a temporary one removed at exit,
    also on SIGTERM (``timeout``, ``kill``) as on Ctrl-C."""

    def __init__(self, store):
        self.tmp = None if store else tempfile.mkdtemp(prefix="swarmfs-generate-")
        self.path = os.path.abspath(store) if store else os.path.join(self.tmp, "store")
        self._prev = None

    def __enter__(self):
        if self.tmp and threading.current_thread() is threading.main_thread():
            self._prev = signal.signal(signal.SIGTERM, _on_sigterm)
        return self.path

    def __exit__(self, *exc):
        try:
            if self.tmp:
                shutil.rmtree(self.tmp, ignore_errors=True)
        finally:
            if self._prev is not None:
                signal.signal(signal.SIGTERM, self._prev)


def run_generate(prompt: str, *, model_dir=None, store=None, disks=4, ratio: float = defaults.RATIO,
                 max_new_tokens: int = 64, force: bool = False, engine=None,
                 prefetch: str = "none", dtype=None, on_text=None, on_warning=None,
                 progress=None, sinks=None) -> dict:
    """Prefill ``prompt`` onto a new store and decode greedily, or serve a
    stored document.

    ``store`` naming an existing store (and ``force`` False) reuses it: the
    prompt must continue the stored document (its fingerprint is checked,
    ``SwarmCache.from_store``), nothing is prefilled or written, and the
    prompt's tokens after the stored ones are fed first.  A new store holds
    the prompt alone (the generated tokens stay in DRAM), so that a later
    request can continue it.

    Args:
        prompt: the prompt text.
        model_dir: model directory (default: the trained decoder).
        store: store directory (default: a temporary one, removed after,
            also on SIGTERM).
        disks: number of file disks or a list of disk paths.
        ratio: sparsity ratio r.
        max_new_tokens: tokens to generate (>= 1).
        on_text: called with each decoded text piece as it is generated.
        on_warning: called with a warning (the prompt runs past the model's
            trained length) before the weights load; default: ``warnings.warn``.
        progress: ``progress(stage, done, total)`` during the prefill
            (``SwarmCache``'s).
        sinks: attention sinks (default ``SwarmCache``'s).

    Returns:
        dict: model, prompt_tokens, text, tokens, ratio, reused (the stored
        document served, or None), prefill_s, decode_s, tokens_per_s,
        layout (per layer), steps (per-step rows), summary, hint (why no
        decode step ran, or None).

    Raises:
        ModelError, InvalidArgumentError (also a prompt past the model's
        positions, before any work), StoreExistsError, ShapeError (a prompt
        that does not continue the stored document), SwarmError.
    """
    import torch
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or \
            max_new_tokens < 1:
        raise errors.InvalidArgumentError(f"max_new_tokens must be >= 1, got {max_new_tokens!r}")
    tok, config = load_tokenizer(model_dir)
    ids = _tokens(tok, prompt)
    _warn(check_length(config, ids.shape[1], max_new_tokens, model_dir=model_dir), on_warning)
    reuse = store is not None and not force and is_store(store)
    model, tok = load_model(model_dir, dtype)
    from . import hf
    with _StoreDir(store) as path:
        if reuse:
            cache = hf.SwarmCache.from_store(path, model.config, ratio=ratio, engine=engine,
                                             prefetch=prefetch, input_ids=ids,
                                             **({} if sinks is None else {"sinks": sinks}))
        else:
            cache = _open_cache(model, path, ratio=ratio, disks=disks, force=force,
                                engine=engine, prefetch=prefetch, record=False, append=False,
                                sinks=sinks, progress=progress)
        with cache:
            stored = cache.get_seq_length() if reuse else 0
            streamer = _Streamer(tok, on_text, ids.shape[1]) if on_text else None
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache,
                                     max_new_tokens=max_new_tokens, do_sample=False,
                                     streamer=streamer,
                                     pad_token_id=tok.pad_token_id or tok.eos_token_id or 0)
            t1 = time.perf_counter()
            new = out[0, ids.shape[1]:].tolist()
            steps = cache.step_table()
            decode_s = sum(r["score_us"] + r["select_us"] + r["plan_us"] + r["io_us"] +
                           r["assemble_us"] + r["session_us"] + r["attend_us"]
                           for r in steps) / 1e6
            prefill_s = sum(x["layout_s"] + x["write_s"] for x in cache.layout_report.values())
            eos = tok.eos_token_id
            hint = None
            if not steps:
                first = "end-of-text" if new and new[0] == eos else repr(tok.decode(new[:1]))
                hint = (f"no decode step ran: the model's first token was {first}, which ends "
                        "the text (a prompt that ends mid-sentence or mid-line continues; "
                        "--evaluate N scores the prompt's last N tokens instead)") \
                    if max_new_tokens > 1 else "one token asked for: it comes from the prefill"
            return {"model": str(model_dir or default_model_dir()),
                    "prompt_tokens": int(ids.shape[1]), "tokens": new,
                    "text": tok.decode(new, skip_special_tokens=True), "ratio": ratio,
                    "store": None if store is None else path, "disks": cache.store.num_disks,
                    "reused": {"store": path, "tokens": stored} if reuse else None,
                    "wall_s": t1 - t0, "layout_write_s": prefill_s,
                    "swarm_attention_s": decode_s,
                    "layout": {str(k): v for k, v in cache.layout_report.items()},
                    "steps": steps, "summary": cache.summary(), "hint": hint}


def _warn(message, on_warning) -> None:
    if message is None:
        return
    if on_warning is not None:
        on_warning(message)
    else:
        import warnings
        warnings.warn(message, stacklevel=3)


def _nll(logits, targets) -> np.ndarray:
    import torch
    lp = torch.log_softmax(logits.float(), dim=-1)
    return (-lp.gather(-1, targets[:, None])[:, 0]).numpy().astype(np.float64)


def teacher_force(model, ctx, cont, cache, steps: int):
    """Prefill ``ctx`` [1, S] into ``cache``, then decode ``steps`` tokens one
    step each, fed the true continuation ``cont`` [n] (teacher forcing).

    Returns:
        (logits [steps + 1, vocab] torch: the prefill's last position and each
        step's, prefill seconds, per-step milliseconds [steps]).
    """
    import torch
    t0 = time.perf_counter()
    out = model(ctx, cache=cache, use_cache=True)
    prefill_s = time.perf_counter() - t0
    logits = [out.logits[0, -1]]
    step_ms = []
    for t in range(steps):
        t0 = time.perf_counter()
        out = model(cont[t:t + 1][None], cache=cache, use_cache=True)
        step_ms.append((time.perf_counter() - t0) * 1e3)
        logits.append(out.logits[0, -1])
    return torch.stack(logits), prefill_s, step_ms


def recall_report(cache, ratio: float, context: int) -> dict:
    """Attention-mass recall of every recorded retrieval against the oracle.

    For each layer the stored context's K and V (the first ``context``
    tokens) are read back from the store; for each decode step, the step's
    query scores all of them; recall = mass of the retrieved context entries
    / mass of the exact top-k, k = ceil(r x context) (``_report.evaluate_query``).

    Returns:
        {"recall": mean over layers and steps, "per_layer": {layer: mean},
        "mass": mean share of the query's whole attention (softmax over the
        stored context) on the retrieved context entries, "oracle_mass":
        the same for the exact top-k (both rise with the budget; recall is
        their ratio per query), "rel_error": mean attention-output error,
        "oracle_rel_error": ...}.
    """
    from .decode._report import evaluate_queries
    st = cache.store
    per_layer, err, oerr, mass, omass = {}, [], [], [], []
    for layer, recs in sorted(cache.records.items()):
        if not recs:
            continue
        kv = st.read_entries(layer, np.arange(context)).astype(np.float32)
        k_ctx = np.ascontiguousarray(kv[:, 0].transpose(1, 0, 2))
        v_ctx = np.ascontiguousarray(kv[:, 1].transpose(1, 0, 2))
        rec = []
        scaling = recs[0][2]
        qs = np.stack([x[0] for x in recs])                     # [n, H_q, d]
        for r in evaluate_queries(qs, k_ctx, v_ctx, [x[1][x[1] < context] for x in recs],
                                  scaling=scaling, ratio=ratio):
            rec.append(r["recall"])
            err.append(r["rel_error"])
            oerr.append(r["oracle_rel_error"])
            mass.append(r["mass"])
            omass.append(r["oracle_mass"])
        per_layer[layer] = float(np.mean(rec))
        del kv, k_ctx, v_ctx
    return {"recall": float(np.mean(list(per_layer.values()))) if per_layer else float("nan"),
            "per_layer": per_layer, "rel_error": float(np.mean(err)) if err else float("nan"),
            "mass": float(np.mean(mass)) if mass else float("nan"),
            "oracle_mass": float(np.mean(omass)) if omass else float("nan"),
            "oracle_rel_error": float(np.mean(oerr)) if oerr else float("nan")}


def run_evaluate(text: str, evaluate: int, *, model_dir=None, store=None, disks=4,
                 ratio: float = defaults.RATIO, force: bool = False, engine=None,
                 prefetch: str = "none", dtype=None, model=None, tok=None,
                 max_context: int | None = None, on_warning=None, progress=None,
                 sinks=None) -> dict:
    """Teacher-force the last ``evaluate`` tokens of ``text`` densely and
    through swarmfs; compare perplexities and attention-mass recall.

    Args:
        text: the whole input; its last ``evaluate`` tokens are the continuation.
        evaluate: N, continuation tokens (>= 1; the context keeps >= 2 tokens).
        max_context: keep only the last this many context tokens.
        model, tok: an already loaded model and tokenizer (else ``load_model``).
        on_warning, progress, sinks: as :func:`run_generate`.

    Returns:
        dict: context_tokens, continuation_tokens, ratio, perplexity_dense,
        perplexity_swarm, recall, recall_per_layer, mass and oracle_mass (the
        shares of attention on the retrieved and the oracle top-k entries,
        :func:`recall_report`), rel_error,
        dense_step_ms / swarm_step_ms (median per-token decode time),
        summary (retrieval medians), steps.

    Raises:
        InvalidArgumentError: N out of range, or the text past the model's
        positions (before the weights load).  ModelError, SwarmError.
    """
    import torch
    from transformers import DynamicCache
    if model is None:
        tok, config = load_tokenizer(model_dir)
        n_text = _tokens(tok, text).shape[1]
        if max_context is not None:
            n_text = min(n_text, int(max_context) + int(evaluate))
        _warn(check_length(config, n_text, 0, model_dir=model_dir), on_warning)
        model, tok = load_model(model_dir, dtype)
    ids = _tokens(tok, text)
    n = int(evaluate)
    if ids.shape[1] < 3:
        raise errors.InvalidArgumentError(f"--evaluate needs a text of at least 3 tokens "
                                          f"(2 of context and 1 to evaluate); this one has "
                                          f"{ids.shape[1]}")
    if isinstance(evaluate, bool) or n < 1 or n > ids.shape[1] - 2:
        raise errors.InvalidArgumentError(f"--evaluate {evaluate} must be in [1, "
                                          f"{ids.shape[1] - 2}] for a text of {ids.shape[1]} "
                                          "tokens")
    ctx, cont = ids[:, :-n], ids[0, -n:]
    if max_context is not None and ctx.shape[1] > max_context:
        ctx = ctx[:, -max_context:]
    S = int(ctx.shape[1])
    full = torch.cat([ctx, cont[None]], 1)
    with torch.no_grad():
        # dense: one causal forward over context + continuation (SDPA)
        model.set_attn_implementation("sdpa")
        logits = model(full, use_cache=False).logits[0, S - 1:S - 1 + n]
        nll_dense = _nll(logits, cont)
        del logits
        # dense per-token decode time (DynamicCache, in DRAM), for the step-time ratio
        _, _, dense_ms = teacher_force(model, ctx, cont, DynamicCache(), min(n, 16))
        from . import hf
        hf.enable(model)
        with _StoreDir(store) as path:
            cache = _open_cache(model, path, ratio=ratio, disks=disks, force=force,
                                engine=engine, prefetch=prefetch, record=True, sinks=sinks,
                                progress=progress)
            with cache:
                step_logits, prefill_s, swarm_ms = teacher_force(model, ctx, cont, cache, n - 1)
                nll_swarm = _nll(step_logits, cont)
                rec = recall_report(cache, ratio, S)
                summ = cache.summary()
                steps = cache.step_table()
                layout = {str(k): v for k, v in cache.layout_report.items()}
    return {"context_tokens": S, "continuation_tokens": n, "ratio": ratio,
            "perplexity_dense": float(math.exp(nll_dense.mean())),
            "perplexity_swarm": float(math.exp(nll_swarm.mean())),
            "recall": rec["recall"], "recall_per_layer": rec["per_layer"],
            "mass": rec["mass"], "oracle_mass": rec["oracle_mass"],
            "rel_error": rec["rel_error"], "oracle_rel_error": rec["oracle_rel_error"],
            "dense_step_ms": float(np.median(dense_ms)),
            "swarm_step_ms": float(np.median(swarm_ms)) if swarm_ms else None,
            "prefill_layout_s": prefill_s, "layout": layout, "summary": summ,
            "steps": steps}


def heldout_input(tok, kind: str, tokens: int) -> str:
    """The first ``tokens`` tokens of the decoder's held-out text of one kind.

    The text comes from :func:`swarmfs.models.heldout_texts` (files and
    passages the shipped decoder never trained on), so a long context built
    from it is one continuous document stream, not unrelated windows.

    Args:
        tok: the model's tokenizer.
        kind: ``"python"`` (held-out standard-library modules) or ``"prose"``
            (held-out WikiText-2, Tiny Shakespeare, GSM8K).
        tokens: how many tokens of text to return (>= 3).

    Returns:
        str: the decoded text of those tokens.

    Raises:
        InvalidArgumentError: ``tokens`` out of range or more than the held-out
            text holds.  NotFoundError: the shared datasets are missing.
    """
    from .models import heldout_texts
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 3:
        raise errors.InvalidArgumentError(f"tokens must be an integer >= 3, got {tokens!r}")
    text = heldout_texts(kind)
    chars = 8 * tokens                      # BPE tokens run 3-5 characters here
    while True:                             # tokenize only what is needed
        ids = tok(text[:chars], add_special_tokens=False)["input_ids"]
        if len(ids) > tokens or chars >= len(text):
            break
        chars *= 2
    if len(ids) < tokens:
        raise errors.InvalidArgumentError(f"the held-out {kind} text has {len(ids)} tokens, "
                                          f"fewer than the {tokens} asked for")
    return tok.decode(ids[:tokens])

