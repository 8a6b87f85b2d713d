#!/usr/bin/env python3
"""Train swarm-llama, the small Llama decoder swarmfs ships (issue 11, part 1).

The recipe (docs/model.md):

1. ``prepare``: a byte-level BPE tokenizer (``tokenizers``, vocab 8192) is
   trained on the training documents only (:func:`swarmfs.models.training_texts`:
   the Python standard library minus the held-out files, and the first 90%
   of WikiText-2, Tiny Shakespeare and GSM8K); the training documents are
   tokenized into two uint16 token streams (Python source, prose), each
   document followed by ``<|endoftext|>``.
2. ``train``: a LlamaForCausalLM (RoPE theta 500000, GQA 8 query / 2 KV heads,
   head_dim 32, tied embeddings, SDPA attention) trained with AdamW
   (betas 0.9/0.95, weight decay 0.1 on matrices), a warm-up / stable / decay
   schedule (linear warm-up, the peak, then linear decay to 10% over the last
   20% of the steps), gradient clipping 1.0, in phases by sequence length
   (short first, then 2048, then 8192 tokens).  Each step's batch is drawn
   from random windows of the streams by a generator seeded with (seed,
   step), so a resumed run sees the
   same data as an uninterrupted one.  From the steps given by ``--repeat``,
   a window is given a copied span with the given probability (an
   earlier span of 16 to seq/4 tokens pasted at a random later position), so
   the model learns to attend back and copy (induction) within the budget.
   The loss is the mean token loss, plus ``--answer-weight`` times the mean
   loss on task answer tokens (``--tasks``), plus ``--copy-weight`` times the
   mean loss on the tokens of ``far`` copies (the gradient toward copying
   thousands of tokens back, which is a few percent of a window's tokens).
   A checkpoint (model, optimizer, step,
   loss history) is written to ``OUT/ckpt/last.pt`` every ``--ckpt-every``
   seconds and at the end of each phase; a new run resumes from it.
3. ``export``: the trained weights, config, generation config and tokenizer
   go to ``--export DIR`` (loadable offline by AutoModelForCausalLM /
   AutoTokenizer), with the loss curve (PNG + JSON).

Usage (the command that produced the committed model is in docs/model.md)::

    setsid nice -n 19 .venv/bin/python -m tools.train_decoder --out /work/train \\
        --phases 512x16:N1,2048x4:N2,8192x1:N3 > /work/train/log.txt 2>&1 &

    .venv/bin/python -m tools.train_decoder --out /work/train --bench   # tokens/s per phase
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pathlib
import sys
import time
import types

import click
import numpy as np

from tools import _options as O

EOS = "<|endoftext|>"


def parse_phases(spec: str) -> list[tuple[int, int, int]]:
    """``"512x16:300,2048x4:100"`` -> [(seq_len, batch, steps), ...]."""
    phases = []
    for part in spec.split(","):
        try:
            shape, steps = part.split(":")
            seq, batch = shape.split("x")
            phases.append((int(seq), int(batch), int(steps)))
        except ValueError:
            raise ValueError(f"--phases {part!r}: expected SEQxBATCH:STEPS") from None
        if phases[-1][0] < 2 or phases[-1][1] < 1 or phases[-1][2] < 1:
            raise ValueError(f"--phases {part!r}: sequence >= 2, batch and steps >= 1")
    return phases


# --------------------------------------------------------------------------- prepare
def train_tokenizer(docs, vocab_size: int, path: pathlib.Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator((d.text for d in docs), trainer=trainer, length=len(docs))
    tok.save(str(path))
    return tok


def prepare(out: pathlib.Path, vocab_size: int, init_from: pathlib.Path | None = None
            ) -> dict[str, np.ndarray]:
    """Train the tokenizer (or take ``init_from``'s) and tokenize the training
    streams (cached in OUT)."""
    from tokenizers import Tokenizer

    from swarmfs.models import training_texts
    tok_path = out / "tokenizer.json"
    if init_from is not None and not tok_path.exists():
        tok_path.write_bytes((init_from / "tokenizer.json").read_bytes())
    streams = {k: out / f"train_{k}.u16" for k in ("python", "prose")}
    if tok_path.exists() and all(p.exists() for p in streams.values()):
        return {k: np.fromfile(p, dtype=np.uint16) for k, p in streams.items()}
    t0 = time.time()
    docs = training_texts()
    tok = train_tokenizer(docs, vocab_size, tok_path) if not tok_path.exists() \
        else Tokenizer.from_file(str(tok_path))
    eos = tok.token_to_id(EOS)
    print(f"[prepare] tokenizer: vocab {tok.get_vocab_size()}, {time.time() - t0:.0f} s",
          flush=True)
    result = {}
    for kind, path in streams.items():
        texts = [d.text for d in docs if d.kind == kind]
        ids = []
        for enc in tok.encode_batch(texts):
            ids.extend(enc.ids)
            ids.append(eos)
        arr = np.asarray(ids, dtype=np.uint16)
        arr.tofile(path)
        result[kind] = arr
        print(f"[prepare] {kind}: {len(texts)} documents, "
              f"{sum(map(len, texts)) / 1e6:.1f} M chars, {arr.size / 1e6:.2f} M tokens",
              flush=True)
    return result


# --------------------------------------------------------------------------- model
def make_config(args, vocab_size: int, eos_id: int):
    from transformers import LlamaConfig
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.head_dim or args.hidden // args.heads,
        max_position_embeddings=32768, rope_theta=float(args.rope_theta),
        rope_parameters={"rope_type": "default", "rope_theta": float(args.rope_theta)},
        rms_norm_eps=1e-5, tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
        initializer_range=0.02, use_cache=True, torch_dtype="float32")


def make_model(config):
    from transformers import LlamaForCausalLM
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    return model


def batch_for(streams, seed: int, step: int, seq: int, batch: int, prose_fraction: float,
              repeat=(), vocab: int = 8192, mark_copies: bool = False):
    """The (batch, seq + 1) int64 windows of step ``step`` (deterministic).

    With ``mark_copies`` it returns (windows, copy mask bool [batch, seq + 1]):
    the mask marks the tokens of each ``far`` copy that (in the final window)
    repeat the token the copy distance back, as does the token before them
    (so a copy's first token is not marked: only attention back to the
    source predicts the marked ones), for ``--copy-weight``.

    ``repeat`` is the copy augmentation in force, a list of (probability,
    mode) from :func:`repeat_at`: one uniform draw per window picks at most one
    mode (so the probabilities of a mixture add up).  Mode ``"span"``: the
    window gets a repeated span: a span of
    16 to seq/4 tokens at a random position is copied over a random later
    position (anywhere up to the end of the window), so predicting it pays
    off only by attending back to the first occurrence, at any distance (the
    copy augmentation that makes induction heads form within our budget).
    With ``repeat_mode="double"`` the window starts with a passage of seq/8 to
    seq/2 tokens followed by itself (the stronger signal: up to half of the
    targets are copies, at distances up to seq/2); with ``"random"`` that
    passage is uniformly random token ids (below ``vocab``), which only
    copying predicts (the synthetic task on which induction heads form);
    with ``"pure"`` the whole window is such a passage followed by itself (a
    copy at one fixed distance, seq/2, which a positional head can solve);
    with ``"pairs"`` the window is a run of random-id segments of 4 to seq/4
    tokens, each followed by itself (the copy distance varies, so only an
    induction head predicts the repeats); with ``"far"`` 2 to 6 passages of
    32 to 256 natural tokens are each copied 1K to 15/16 of the window later
    (many copy onsets per window at the distances where copying fades: the
    held-out probe repeats a 160-token passage 6K tokens back).
    """
    rng = np.random.default_rng([seed, step])
    rows, copies = [], []
    for _ in range(batch):
        s = streams["prose"] if rng.random() < prose_fraction else streams["python"]
        start = int(rng.integers(0, s.size - seq - 1))
        row = s[start:start + seq + 1].astype(np.int64)
        copy = np.zeros(seq + 1, bool)
        repeat_mode = pick_mode(repeat, rng.random()) if repeat else None
        if repeat_mode is not None:
            if repeat_mode == "pairs":
                # random-id segments of random lengths, each followed by itself:
                # the copy distance changes from segment to segment, so only a
                # content-matching (induction) head predicts the repeats, not
                # a head that attends a fixed distance back
                pos = 0
                while pos < seq + 1:
                    n = int(rng.integers(4, max(5, seq // 4) + 1))
                    seg = rng.integers(0, vocab, n)
                    both = np.concatenate([seg, seg])[:seq + 1 - pos]
                    row[pos:pos + both.size] = both
                    pos += both.size
            elif repeat_mode == "pure":
                # the whole window is random token ids followed by themselves
                n = (seq + 1) // 2
                row[:] = rng.integers(0, vocab, seq + 1)
                row[n:2 * n] = row[:n]
            elif repeat_mode in ("double", "random"):
                # a passage followed by itself, then the rest of the window: up to
                # half of the window's targets are copies at one distance; "random":
                # the passage is uniformly random tokens, predictable only by copying
                n = int(rng.integers(max(16, seq // 8), seq // 2 + 1))
                if repeat_mode == "random":
                    row[:n] = rng.integers(0, vocab, n)
                row[n:2 * n] = row[:n]
            elif repeat_mode == "far":
                copies_made = []
                for _ in range(int(rng.integers(2, 7))):
                    n = int(rng.integers(32, 257))
                    lo = min(1024, seq // 4)
                    gap = int(rng.integers(lo, max(seq * 15 // 16 - n, lo + 1)))
                    if gap + 2 * n > seq + 1:
                        continue
                    src = int(rng.integers(0, seq + 2 - gap - 2 * n))
                    row[src + gap:src + gap + n] = row[src:src + n]
                    copies_made.append((src, gap, n))
                # a later passage may overwrite an earlier one's source or copy:
                # mark what still repeats the token gap back, after a token that does
                for src, gap, n in copies_made:
                    same = row[src + gap:src + gap + n] == row[src:src + n]
                    copy[src + gap + 1:src + gap + n] |= same[1:] & same[:-1]
            else:
                n = int(rng.integers(16, max(17, seq // 4)))
                src = int(rng.integers(0, seq + 1 - 2 * n))
                dst = int(rng.integers(src + n, seq + 2 - n))
                row[dst:dst + n] = row[src:src + n]
        rows.append(row)
        copies.append(copy)
    return (np.stack(rows), np.stack(copies)) if mark_copies else np.stack(rows)


def parse_tasks(spec: str) -> tuple[float, float]:
    """``--tasks "0.5:2"`` -> (probability a window gets tasks, tasks per 1,024 tokens)."""
    if not spec:
        return 0.0, 0.0
    try:
        p, per_1k = (float(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"--tasks {spec!r}: expected PROB:PER_1K") from None
    if not 0.0 <= p <= 1.0 or per_1k < 0:
        raise ValueError(f"--tasks {spec!r}: PROB in [0, 1], PER_1K >= 0")
    return p, per_1k


def batch_with_tasks(streams, seed: int, step: int, seq: int, batch: int, prose_fraction: float,
                     repeat, vocab: int, tasks: tuple[float, float], templates):
    """:func:`batch_for`'s windows with long-context tasks spliced in
    (:func:`swarmfs.models.tasks.embed_tasks`): each window gets tasks with
    probability ``tasks[0]``, about ``tasks[1]`` per 1,024 tokens (at least
    one), drawn by a generator seeded with (seed, step, 1).

    Returns:
        (x int64 [batch, seq + 1], answer bool [batch, seq + 1], copy bool
        [batch, seq + 1]): the windows, the mask of task answer tokens and the
        mask of ``far`` copy tokens (moved with the text the tasks splice into).
    """
    from swarmfs.models.tasks import embed_tasks
    x, copy = batch_for(streams, seed, step, seq, batch, prose_fraction, repeat, vocab,
                        mark_copies=True)
    mask = np.zeros(x.shape, bool)
    p, per_1k = tasks
    rng = np.random.default_rng([seed, step, 1])
    for i in range(batch):
        if rng.random() < p:
            n = max(1, int(rng.poisson(per_1k * seq / 1024)))
            x[i], mask[i], copy[i] = embed_tasks(x[i], rng, templates, n, carry=copy[i])
    return x, mask, copy


def widen_heads(old_state: dict, old_config, config, seed: int = 0) -> dict:
    """A state dict for ``config`` (wider head_dim) that computes exactly
    what ``old_state`` computes under ``old_config``.

    RoPE pairs dimension i with i + d/2 at frequency theta^(-2i/d).  Old
    dimension i (d_old) has the frequency of new dimension i * d_new/d_old,
    so each old query/key row goes to that new row (and its pair); queries
    are scaled by sqrt(d_new/d_old) for the new 1/sqrt(d) softmax scale.
    The new query rows get small random weights and the new key rows zeros
    (no change to the scores, but a gradient for both); the new value rows
    small random weights and the matching output columns zeros.
    """
    import torch
    d0, d1 = old_config.head_dim, config.head_dim
    if d1 % d0 or config.num_attention_heads != old_config.num_attention_heads \
            or config.num_key_value_heads != old_config.num_key_value_heads:
        raise ValueError(f"widen_heads: head_dim {d0} -> {d1} with the same heads only")
    f = d1 // d0
    half0, half1 = d0 // 2, d1 // 2
    rows = np.concatenate([np.arange(half0) * f, half1 + np.arange(half0) * f])  # RoPE rows
    gen = torch.Generator().manual_seed(seed)
    state = dict(old_state)
    for key, w in old_state.items():
        if not key.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")):
            continue
        is_o = key.endswith("o_proj.weight")
        heads = (config.num_attention_heads if key.endswith(("q_proj.weight", "o_proj.weight"))
                 else config.num_key_value_heads)
        w = w if not is_o else w.t()
        hidden = w.shape[1]
        old = w.reshape(heads, d0, hidden)
        if key.endswith("q_proj.weight"):
            new = 0.02 * torch.randn(heads, d1, hidden, generator=gen)
            new[:, rows] = old * math.sqrt(f)
        elif key.endswith("k_proj.weight"):
            new = torch.zeros(heads, d1, hidden)
            new[:, rows] = old
        elif key.endswith("v_proj.weight"):
            new = 0.02 * torch.randn(heads, d1, hidden, generator=gen)
            new[:, :d0] = old
        else:
            new = torch.zeros(heads, d1, hidden)
            new[:, :d0] = old
        new = new.reshape(heads * d1, hidden)
        state[key] = new.t().contiguous() if is_o else new
    return state


def parse_repeat(spec: str) -> dict[int, list[tuple[float, str]]]:
    """``--repeat`` -> {start step: [(probability, mode), ...]}: each part
    ``FROM_STEP:PROB[:MODE]`` (mode ``span`` when not given); parts with the
    same step form a mixture, whose probabilities may add up to at most 1.

    Raises:
        ValueError: a malformed part, an unknown mode, a probability outside
            [0, 1], a negative step, or a mixture adding up to more than 1.
    """
    plan: dict[int, list[tuple[float, str]]] = {}
    for part in filter(None, spec.split(",")):
        try:
            start, p, *m = part.split(":")
            start, p = int(start), float(p)
        except ValueError:
            raise ValueError(f"--repeat {part!r}: expected FROM_STEP:PROB[:MODE]") from None
        mode = m[0] if m else "span"
        if len(m) > 1 or not 0.0 <= p <= 1.0 or start < 0:
            raise ValueError(f"--repeat {part!r}: FROM_STEP >= 0, PROB in [0, 1], one MODE")
        if mode not in REPEAT_MODES:
            raise ValueError(f"--repeat {part!r}: mode must be one of {', '.join(REPEAT_MODES)}")
        plan.setdefault(start, [])
        if p > 0:
            plan[start].append((p, mode))
    for start, mix in plan.items():
        if sum(p for p, _ in mix) > 1.0 + 1e-9:
            raise ValueError(f"--repeat: the probabilities from step {start} add up to more than 1")
    return plan


def repeat_at(plan, step: int) -> list[tuple[float, str]]:
    """The copy augmentation in force at ``step`` (``plan``: a ``--repeat``
    string or :func:`parse_repeat`'s result): the mixture of the latest
    start step <= ``step``, e.g. ``"0:0.5:pure,600:0.2:pure,600:0.3:double"``
    gives from step 600 on 20% ``pure`` windows, 30% ``double`` windows and
    50% plain text; before the first start, none."""
    if isinstance(plan, str):
        plan = parse_repeat(plan)
    in_force = [start for start in plan if start <= step]
    return list(plan[max(in_force)]) if in_force else []


REPEAT_MODES = ("span", "double", "random", "pure", "pairs", "far")


def pick_mode(mix: list[tuple[float, str]], u: float) -> str | None:
    """The mode a uniform draw ``u`` in [0, 1) picks from a mixture, or None
    (a plain window) when ``u`` falls past the probabilities' sum."""
    acc = 0.0
    for p, mode in mix:
        acc += p
        if u < acc:
            return mode
    return None


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float, decay: float) -> float:
    """Warm-up, stable, decay: linear warm-up over ``warmup`` steps, the peak
    until the last ``decay`` fraction of the steps, then a linear decay to
    ``floor * peak``.  Shortening a later phase on resume (a smaller step
    budget) moves the decay earlier without a jump while still at the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    start = int(total * (1.0 - decay))
    if step < start:
        return peak
    t = min(1.0, (step - start) / max(1, total - start))
    return peak * (1.0 - (1.0 - floor) * t)


def save_ckpt(path: pathlib.Path, model, opt, step: int, history: list, args) -> None:
    import torch
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                "history": history, "args": vars(args)}, tmp)
    os.replace(tmp, path)


def plot_curve(history: list, png: pathlib.Path, phases) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    if not history:
        return
    steps = np.array([h["step"] for h in history])
    loss = np.array([h["loss"] for h in history])
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, loss, lw=0.6, alpha=0.4, color="C0", label="train loss (per step)")
    k = min(25, len(loss))
    if k > 1:
        smooth = np.convolve(loss, np.ones(k) / k, mode="valid")
        ax.plot(steps[k - 1:], smooth, color="C0", label=f"mean of {k} steps")
    copy = [(h["step"], h["copy_loss"]) for h in history if h.get("copy_loss") is not None]
    if len(copy) >= k > 1:                  # --copy-weight runs: the far copies' own loss
        cs, cl = np.array(copy).T
        ax.plot(cs[k - 1:], np.convolve(cl, np.ones(k) / k, mode="valid"), color="C1",
                label=f"far-copy tokens' loss, mean of {k}")
    far = [(h["step"], h["copy_far"]) for h in history if h.get("copy_far")]
    if far:                                 # the held-out 6K copy ratio at checkpoints
        ax2 = ax.twinx()
        for j, kind in enumerate(far[0][1]):
            ax2.plot([s for s, _ in far], [f[kind] for _, f in far], "o-", ms=3, lw=0.8,
                     color=f"C{2 + j}", label=f"6K copy ratio, held-out {kind}")
        ax2.set_ylabel("loss on repeat / on unrelated (6K back)")
        ax2.set_ylim(0, 1.2)
        ax2.legend(loc="lower right", fontsize=8)
    start = 0
    for i, (seq, _batch, n) in enumerate(phases):
        ax.axvline(start, color="gray", lw=0.5, ls="--")
        ax.text(start, float(loss.max()) - 0.4 * (i % 3), f" {seq}", fontsize=8, va="top")
        start += n
    ax.set_xlabel("step (sequence length x batch tokens; phase lengths marked)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("swarm-llama training loss (phases by sequence length)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def train(args, streams, tok_path: pathlib.Path) -> None:
    import torch
    from tokenizers import Tokenizer
    from tqdm import tqdm
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tok = Tokenizer.from_file(str(tok_path))
    config = make_config(args, tok.get_vocab_size(), tok.token_to_id(EOS))
    model = make_model(config)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    ckpt = args.out / "ckpt" / "last.pt"
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    phases = parse_phases(args.phases)
    total = sum(n for _, _, n in phases)
    step, history = 0, []
    if ckpt.exists():
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, history = state["step"], state["history"]
        print(f"[train] resumed from {ckpt} at step {step}", flush=True)
    elif args.init_from is not None:
        from safetensors.torch import load_file
        from transformers import AutoConfig
        old_config = AutoConfig.from_pretrained(args.init_from)
        old = load_file(str(args.init_from / "model.safetensors"))
        old = {k: v.float() for k, v in old.items()}
        if old_config.head_dim != config.head_dim:
            old = widen_heads(old, old_config, config, args.seed)
        missing, unexpected = model.load_state_dict(old, strict=False)
        if unexpected or [k for k in missing if k != "lm_head.weight"]:
            raise SystemExit(f"--init-from {args.init_from}: missing {missing}, "
                             f"unexpected {unexpected}")
        model.tie_weights()
        print(f"[train] initialised from {args.init_from} (head_dim {old_config.head_dim} -> "
              f"{config.head_dim})", flush=True)
    from swarmfs.models.tasks import Templates
    templates = Templates(lambda text: tok.encode(text).ids)
    task_mix = parse_tasks(args.tasks)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[train] {n_params / 1e6:.2f} M parameters, phases {phases}, {total} steps", flush=True)
    from swarmfs.models import heldout_texts
    probe_ids = tok.encode(heldout_texts("python")[:20000]).ids
    far_probe_ids = {kind: np.asarray(tok.encode(heldout_texts(kind)[:80000]).ids)
                     for kind in ("python", "prose")}
    model.train()
    last_save = time.time()
    cpu0, wall0 = time.process_time(), time.time()
    bar = tqdm(total=total, initial=min(step, total), mininterval=15, dynamic_ncols=False,
               ncols=110)
    ends = np.cumsum([n for _, _, n in phases])
    repeat_plan = parse_repeat(args.repeat)
    override = args.out / "phases.override"
    while step < total:
        # the plan may be shortened while running (paused by benchmarks): OUT/phases.override
        if override.exists() and override.read_text().strip() != args.phases:
            args.phases = override.read_text().strip()
            phases = parse_phases(args.phases)
            total = sum(n for _, _, n in phases)
            ends = np.cumsum([n for _, _, n in phases])
            bar.total = total
            print(f"\n[train] new plan from {override}: {phases}, {total} steps", flush=True)
            if step >= total:
                break
        phase = int(np.searchsorted(ends, step, side="right"))
        seq, batch, _ = phases[phase]
        lr = lr_at(step, total, args.lr, args.warmup, args.lr_floor, args.decay)
        for g in opt.param_groups:
            g["lr"] = lr
        x, answer, copy = batch_with_tasks(streams, args.seed, step, seq, batch,
                                           args.prose_fraction, repeat_at(repeat_plan, step),
                                           config.vocab_size, task_mix, templates)
        x, answer = torch.from_numpy(x), torch.from_numpy(answer[:, 1:].reshape(-1))
        copy = torch.from_numpy(copy[:, 1:].reshape(-1))
        t0 = time.time()
        logits = model(input_ids=x[:, :-1], use_cache=False).logits
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(),
                                                x[:, 1:].reshape(-1), reduction="none")
        lm_loss = nll.mean()
        answer_loss = nll[answer].mean() if bool(answer.any()) else None
        copy_loss = nll[copy].mean() if bool(copy.any()) else None
        loss = lm_loss + sum(w * part for w, part in ((args.answer_weight, answer_loss),
                                                      (args.copy_weight, copy_loss))
                             if part is not None)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip))
        opt.step()
        dt = time.time() - t0
        step += 1
        history.append({"step": step, "seq": seq, "loss": lm_loss.item(), "lr": lr,
                        "grad_norm": gnorm, "sec": dt, "tokens": seq * batch,
                        "answer_loss": None if answer_loss is None else answer_loss.item(),
                        "copy_loss": None if copy_loss is None else copy_loss.item()})
        bar.update(1)
        bar.set_postfix(seq=seq, loss=f"{history[-1]['loss']:.3f}", tok_s=f"{seq * batch / dt:.0f}")
        boundary = step in set(ends.tolist())
        if boundary or time.time() - last_save > args.ckpt_every or step == total:
            history[-1]["copy"] = copy_probe(model, probe_ids)
            history[-1]["copy_far"] = far_copy_probe(model, far_probe_ids)
            save_ckpt(ckpt, model, opt, step, history, args)
            last_save = time.time()
            (args.out / "history.json").write_text(json.dumps(history))
            plot_curve(history, args.out / "loss.png", phases)
            print(f"\n[train] step {step}/{total} seq {seq} loss {loss.item():.3f} "
                  f"copy ratio {history[-1]['copy']} far {history[-1]['copy_far']} "
                  f"(ckpt; {time.time() - wall0:.0f} s wall, "
                  f"{time.process_time() - cpu0:.0f} s CPU this run)", flush=True)
    bar.close()
    save_ckpt(ckpt, model, opt, step, history, args)
    (args.out / "history.json").write_text(json.dumps(history))
    plot_curve(history, args.out / "loss.png", phases)
    print(f"[train] done: step {step}, {time.time() - wall0:.0f} s wall, "
          f"{time.process_time() - cpu0:.0f} s CPU this run", flush=True)


def copy_probe(model, probe_ids: list[int], lengths=(48, 300, 1024)) -> dict:
    """Repeat / first-occurrence loss ratio of held-out passages followed by
    themselves, per passage length in tokens (below 0.5: the model copies;
    about 1.0: it does not attend back).  The check of tests/test_model.py,
    run at every checkpoint so a run shows when copying forms (or is lost)."""
    from tools.eval_decoder import repeat_losses
    out = {}
    with evaluating(model):
        for n in lengths:
            first, repeat = repeat_losses(model, probe_ids[:n])
            out[str(n)] = round(repeat / first, 3)
    return out


def far_copy_probe(model, ids_by_kind: dict, gap: int = 6000, passage: int = 160) -> dict:
    """Loss on a held-out passage repeated ``gap`` tokens later / loss on an
    unrelated passage in its place (docs/model.md's copy target, at most
    0.5), per text kind: :func:`tools.eval_context.copy_ratio` over 2 trials."""
    from tools.eval_context import copy_ratio
    with evaluating(model):
        return {kind: round(copy_ratio(model, ids, passage, gap, 2, 0)["ratio"], 3)
                for kind, ids in ids_by_kind.items()}


@contextlib.contextmanager
def evaluating(model):
    """``model`` in eval mode for the block (the probes), then as it was."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


# --------------------------------------------------------------------------- export
def export(args, tok_path: pathlib.Path, dest: pathlib.Path) -> None:
    import torch
    from tokenizers import Tokenizer
    from transformers import GenerationConfig, PreTrainedTokenizerFast
    tok = Tokenizer.from_file(str(tok_path))
    eos = tok.token_to_id(EOS)
    state = torch.load(args.out / "ckpt" / "last.pt", map_location="cpu", weights_only=False)
    # the model's shape and the phase plan are the checkpoint's, not this command line's
    for key, default in (("hidden", 256), ("intermediate", 512), ("layers", 4), ("heads", 8),
                         ("kv_heads", 2), ("phases", ""), ("rope_theta", 500000.0),
                         ("head_dim", 0)):
        setattr(args, key, state["args"].get(key, default))
    model = make_model(make_config(args, tok.get_vocab_size(), eos))
    model.load_state_dict(state["model"])
    dest.mkdir(parents=True, exist_ok=True)
    n_bytes = sum(p.numel() * 4 for p in model.parameters())
    if n_bytes > 24 * 2**20:
        model = model.to(torch.bfloat16)
        model.config.torch_dtype = "bfloat16"
    model.generation_config = GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
                                               do_sample=False, max_new_tokens=64)
    model.save_pretrained(dest, safe_serialization=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS,
                                   pad_token=EOS, unk_token=EOS, model_max_length=32768)
    fast.save_pretrained(dest)
    history = state["history"]
    summary = {
        "steps": state["step"],
        "phases": [{"seq_len": s, "batch": b, "steps": n} for s, b, n in parse_phases(args.phases)],
        "tokens_per_phase": {str(s): sum(h["tokens"] for h in history if h["seq"] == s)
                             for s, _, _ in parse_phases(args.phases)},
        "compute_seconds_per_phase": {
            str(s): round(sum(h["sec"] for h in history if h["seq"] == s), 1)
            for s, _, _ in parse_phases(args.phases)},
        "final_loss_mean_last_20": float(np.mean([h["loss"] for h in history[-20:]])),
        "args": {k: (str(v) if isinstance(v, pathlib.Path) else v)
                 for k, v in state["args"].items()},
        "history": history,
    }
    print(f"[export] {dest}: {json.dumps({k: v for k, v in summary.items() if k != 'history'})}")
    if args.curve_dir:
        args.curve_dir.mkdir(parents=True, exist_ok=True)
        (args.curve_dir / "training.json").write_text(json.dumps(summary, indent=1))
        plot_curve(history, args.curve_dir / "loss_curve.png", parse_phases(args.phases))


# --------------------------------------------------------------------------- bench
def bench(args, streams, tok_path: pathlib.Path) -> None:
    import torch
    from tokenizers import Tokenizer
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tok = Tokenizer.from_file(str(tok_path))
    model = make_model(make_config(args, tok.get_vocab_size(), tok.token_to_id(EOS)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    print(f"[bench] {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters")
    for seq, batch, n in parse_phases(args.phases):
        times = []
        for i in range(n):
            x = torch.from_numpy(batch_for(streams, args.seed, i, seq, batch, args.prose_fraction))
            t0 = time.time()
            logits = model(input_ids=x[:, :-1], use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                                     x[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            times.append(time.time() - t0)
        med = float(np.median(times))
        print(f"[bench] seq {seq} batch {batch}: {med:.2f} s/step, "
              f"{seq * batch / med:.0f} tokens/s (median of {n})", flush=True)


_P = click.Path(path_type=pathlib.Path)


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--out", type=_P, default=pathlib.Path("/work/train"),
              help="work directory (tokenizer, token streams, ckpt/, loss curve); outside the repo")
@click.option("--phases", default="512x16:1200,2048x4:300,8192x1:60",
              help="comma-separated SEQxBATCH:STEPS, trained in order")
@click.option("--vocab", type=click.IntRange(min=257), default=8192)
@click.option("--hidden", type=click.IntRange(min=1), default=256)
@click.option("--intermediate", type=click.IntRange(min=1), default=768)
@click.option("--layers", type=click.IntRange(min=1), default=4)
@click.option("--heads", type=click.IntRange(min=1), default=8)
@click.option("--kv-heads", type=click.IntRange(min=1), default=2)
@click.option("--head-dim", type=click.IntRange(min=0), default=0,
              help="per-head width (0: hidden / heads)")
@click.option("--init-from", type=_P, default=None,
              help="a fresh run starts from this HF model directory (its tokenizer too); "
                   "a narrower head_dim is widened exactly (widen_heads)")
@click.option("--tasks", default="",
              help="long-context tasks: PROB:PER_1K, the probability that a window gets "
                   "synthetic tasks (swarmfs.models.tasks) and how many per 1,024 tokens")
@click.option("--answer-weight", type=O.NONNEG_FLOAT, default=1.0,
              help="loss weight of the mean loss on task answer tokens, beside the mean loss")
@click.option("--copy-weight", type=O.NONNEG_FLOAT, default=0.0,
              help="loss weight of the mean loss on the tokens of `far` copies (after each "
                   "copy's first), beside the mean loss: the gradient toward copying far back")
@click.option("--rope-theta", type=O.FiniteFloat(min=1.0), default=500000.0,
              help="RoPE base; a resumed run may change it (the model re-adapts)")
@click.option("--lr", type=O.POSITIVE, default=2e-3)
@click.option("--lr-floor", type=O.FRACTION, default=0.1,
              help="final LR as a fraction of the peak")
@click.option("--warmup", type=click.IntRange(min=0), default=100)
@click.option("--decay", type=O.FRACTION, default=0.2,
              help="fraction of the steps in the final LR decay")
@click.option("--weight-decay", type=O.NONNEG_FLOAT, default=0.1)
@click.option("--clip", type=O.POSITIVE, default=1.0)
@click.option("--prose-fraction", type=O.FRACTION, default=0.35,
              help="probability that a sequence is drawn from the prose stream")
@click.option("--repeat", default="",
              help="copy augmentation: comma-separated FROM_STEP:PROB[:MODE], the probability "
                   "that a window gets a copy from that step on; MODE span (default: a copied "
                   "span), double (a passage followed by itself), random (random token ids "
                   "followed by themselves, then text), pure (the whole window so) or pairs "
                   "(random-id segments of varied lengths, each followed by itself); parts "
                   "with one FROM_STEP form a mixture; see batch_for")
@click.option("--seed", type=int, default=0)
@click.option("--threads", type=click.IntRange(min=1), default=2)
@click.option("--ckpt-every", type=O.NONNEG_FLOAT, default=180.0,
              help="seconds between checkpoints")
@click.option("--export", type=_P, default=None,
              help="after training, write the HF model directory here")
@click.option("--curve-dir", type=_P, default=None,
              help="also write loss_curve.png and training.json here")
@click.option("--export-only", is_flag=True, help="skip training, export the checkpoint")
@click.option("--bench", is_flag=True, help="time STEPS steps of each phase, then stop")
def cli(**options):
    args = types.SimpleNamespace(**options)
    try:
        parse_phases(args.phases)
        parse_repeat(args.repeat)
        parse_tasks(args.tasks)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    run(args)


def main(argv=None):
    """Run :func:`cli` (``argv`` None: the command line, as a program)."""
    return cli.main(args=argv, obj=argv, standalone_mode=argv is None)


def run(args) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    streams = prepare(args.out, args.vocab, args.init_from)
    tok_path = args.out / "tokenizer.json"
    if args.bench:
        bench(args, streams, tok_path)
        return 0
    if not args.export_only:
        train(args, streams, tok_path)
    if args.export:
        export(args, tok_path, args.export)
    return 0


if __name__ == "__main__":
    sys.exit(main())
