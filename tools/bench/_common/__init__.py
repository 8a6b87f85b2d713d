"""Shared machinery of the evaluation benchmarks (SWARM §8): traces, layouts,
stores, timed retrieval, accuracy, JSON and plots.

**Traces.**  One real activation trace drives every figure, chosen with
``--trace`` (a field of :class:`BenchConfig`): ``minilm`` (the default, and
every number in docs/benchmarks.md §7) or ``decoder``.  Both run over the
three texts of ``../shared/data`` (read in place, never copied): WikiText-2
test, Tiny Shakespeare and GSM8K test, tokenised separately with the model's
own tokenizer (no special tokens) and concatenated in that order.  Longer
contexts repeat that sequence (SWARM §8.1: "when a single sequence is
insufficient, we concatenate multiple samples").

**Trace: minilm.**  all-MiniLM-L6-v2 (an encoder with 512 positions):
WikiText-2 273,178 MiniLM tokens, Tiny Shakespeare 288,719, GSM8K 211,635
(773,532 in all).  The model runs in its native 512-token windows over the
whole token sequence (``layout._capture``); because 773,532 is not a multiple
of 512 the second pass falls on other window boundaries (shifted by 412
tokens), so its K/V/Q are new model outputs, not copies of the first pass.
We keep layer 2 of 6 (post-projection Q, K, V, 12 heads x 32, fp16).  Only
layers 0-2 are computed (a copy of the model config with
``num_hidden_layers = 3``; layer 2 sees exactly the same inputs as in the
6-layer model, which ``tests/test_bench_smoke.py`` checks bit for bit).

**Trace: decoder.**  swarm-llama (``swarmfs.models.DEFAULT_DECODER``, the
causal Llama swarmfs ships: 8 query heads over 2 KV heads x 32, RoPE) over the
same texts (371,175 + 374,124 + 237,699 = 982,998 of its tokens), post-RoPE
Q, K, V of one layer, fp16.  It runs causally in consecutive windows of
8,192 tokens (its longest trained context) from token 0; each window is run
together with the next 512 tokens as one causal sequence, whose queries are
the window's decode queries (the K/V/Q of the window itself do not depend on
them: the model is causal).  A context starts at the first window boundary
inside its dataset, so a context of k x 8,192 tokens is k whole causal
windows.  Contexts longer than 8,192 tokens are such windows side by
side, exactly as the MiniLM trace's 512-token windows: positions restart at
0 in every window and no token of one window ever attended to another, so
the context holds no co-activation across window boundaries that the model
computed, and the held-out queries see every window's keys at the same
relative positions as their own window's.  (The queries after a context that
ends on a window boundary come from that window's continuation, RoPE
positions 8,192-8,703: a decode step just past the trained length, within
``max_position_embeddings`` = 32,768, as ``swarmfs demo`` decodes after an
8K prefill.)  The kept layer follows a rule computed
per checkpoint (:func:`decoder_layer`: the layer whose attention mass lies
furthest outside the local window on held-out text); the rule's numbers are
in the trace meta and every figure's JSON (``trace``).  Caches are named by
a hash of ``model.safetensors``, so a new checkpoint is captured anew.

**Stretching to Qwen3-32B entries.**  An entry of the store is one token's K
and V with the size of a Qwen3-32B entry (8 KV heads x 128 x fp16 x 2 = 4 KiB
per token per layer); :class:`Widening` maps a model's heads onto it.
MiniLM: 16 store heads x 64 with one query head each: MiniLM head h (32
values) is store head h, zero-padded to 64; heads 12-15 are zeros.  Decoder:
Qwen3-32B's own shape, 8 KV heads x 128 and 64 query heads (GQA group 8):
decoder KV head h is store KV head h (32 values, zero-padded to 128), decoder
query head j (GQA group j // 4) is store query head 8 (j // 4) + j mod 4,
the other store heads are zeros.  Queries are multiplied by the model's logit
scale over the store's (scaling / head_dim**-0.5 of the store), so every
logit is the model's, and every score, selection and attention weight is the
model's, including SWARM's per-head softmax medoid score (zero query heads
add the same constant to every cluster).  Every byte moved, every index vector
(2 KiB per key, as a Qwen3-32B key) and every GEMV is Qwen3-32B-sized (the
decoder trace also scores 64 query heads, as Qwen3-32B).  The access pattern
per decode step is therefore a real one (real queries against real keys of a
real context), the I/O is that of a 4 KiB-entry model.
``tests/test_bench_widening.py`` checks that every logit and the dense
attention output from the widened arrays are the model's.

**Contexts and held-out queries.**  A context of S tokens is a slice
``[start, start + S)`` of the trace (``start`` = the beginning of a dataset's
first pass, default WikiText-2; for the decoder the first window boundary in
it).  Decode-step queries are held out: positions ``start + S + 8 i`` (never
profiled), each attending to the S context tokens; for the decoder they are
the queries it computed there as the causal continuation of the context's
last window (:meth:`Trace.decode_queries`).

**Harness.**  Every figure is a click command made by :func:`command` (or
:func:`ablation_command`): the options all figures share become one frozen
:class:`BenchConfig` passed down explicitly (no module state); its own options
follow.  Run them as ``python -m tools.bench.<figure>`` from the repository
root.  Layouts are memoised with ``joblib.Memory`` (:func:`build_layout`),
tables are printed with tabulate (:func:`table`), and figures are drawn with
:func:`figure`, :func:`lines` and :func:`variant_bars`.

**Modules.**  ``config`` (paths, sizes, :class:`BenchConfig`),
``widening`` (:class:`Widening`), ``traces`` (:func:`load_trace`,
:class:`Trace`, contexts and held-out queries), ``layouts``
(:func:`build_layout`), ``disks`` (:class:`Disks`, fio ceilings), ``runner``
(:class:`Bench`, :func:`stream_steps`), ``stats`` (:func:`summarize`),
``cli`` (:func:`command`, :class:`Ablation`), ``output`` (the JSON),
``plots`` and ``tables`` (including the cells of ``run_all``'s Markdown
summary, which each figure module writes for itself with its
``summary(payload)``).  Every name a figure uses is re-exported here, so a
figure reads ``from tools.bench import _common as C`` and ``C.<name>``.

Not a test: nothing here asserts on timings.
"""

from .cli import (
    Ablation,
    ablation_command,
    command,
    dataset_option,
    run,
    setup,
    setup_trace,
    tokens_option,
)
from .config import (
                  BLOCK_S,
                  CACHE,
                  DATA,
                  DATASETS,
                  DECODER_TAIL,
                  DECODER_WINDOW,
                  ENTRY_BYTES,
                  OUT,
                  QUERY_STRIDE,
                  REPO,
                  TRACE_LAYER,
                  TRACES,
                  WARMUP_S,
                  BenchConfig,
                  store_dir,
)
from .disks import Disks, ceilings, fio_ceiling, resolve_disks
from .layouts import build_layout
from .output import finish, machine, timer, trace_identity, trace_recipe, write_json
from .plots import bar_plot, ceiling_lines, figure, lines, pyplot, save_fig, variant_bars
from .runner import STEP_PARTS, Bench, Variant, stream_steps
from .stats import ACC_KEYS, STEP_KEYS, mean, median, summarize
from .tables import md_table, measure_cell, ms_cell, num_cell, table, variant_table
from .traces import (
                  Trace,
                  context,
                  decoder_layer,
                  decoder_model,
                  load_trace,
                  mass_outside_window,
                  model_hash,
                  query_positions,
                  trace_tokens,
                  truncated_model,
                  window_stats,
)
from .widening import (
                  DECODER_WIDENING,
                  MINILM_WIDENING,
                  Widening,
                  narrow,
                  widen_flat,
                  widen_kv,
                  widen_q,
)

__all__ = [
    # config
    "BLOCK_S", "CACHE", "DATA", "DATASETS", "DECODER_TAIL", "DECODER_WINDOW", "ENTRY_BYTES",
    "OUT", "QUERY_STRIDE", "REPO", "TRACE_LAYER", "TRACES", "WARMUP_S", "BenchConfig",
    "store_dir",
    # widening
    "DECODER_WIDENING", "MINILM_WIDENING", "Widening", "narrow", "widen_flat", "widen_kv",
    "widen_q",
    # traces
    "Trace", "context", "decoder_layer", "decoder_model", "load_trace",
    "mass_outside_window", "model_hash", "query_positions", "trace_tokens",
    "truncated_model", "window_stats",
    # layouts, disks
    "build_layout", "Disks", "ceilings", "fio_ceiling", "resolve_disks",
    # runner, stats
    "STEP_PARTS", "Bench", "Variant", "stream_steps",
    "ACC_KEYS", "STEP_KEYS", "mean", "median", "summarize",
    # cli
    "Ablation", "ablation_command", "command", "dataset_option", "run", "setup", "setup_trace",
    "tokens_option",
    # output, plots, tables
    "finish", "machine", "timer", "trace_identity", "trace_recipe", "write_json",
    "bar_plot", "ceiling_lines", "figure", "lines", "pyplot", "save_fig", "variant_bars",
    "md_table", "measure_cell", "ms_cell", "num_cell", "table", "variant_table",
]
