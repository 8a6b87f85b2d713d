"""Where the evaluation reads and writes, its fixed sizes, and what a
figure's command line chose (:class:`BenchConfig`)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib

from tools._shared_data import data_dir

REPO = pathlib.Path(__file__).resolve().parents[3]
DATA = data_dir()
#: dataset name -> file in ../shared/data, in trace order
DATASETS = {"wikitext2": "wikitext2_raw_test.raw",
            "shakespeare": "tinyshakespeare_input.txt",
            "gsm8k": "gsm8k_test.jsonl"}
CACHE = pathlib.Path(os.environ.get("SWARMFS_EVAL_CACHE", "/var/tmp/swarmfs-eval"))
OUT = REPO / "bench-out" / "eval"

#: the traces a figure can run on (``--trace``; see the module docstring)
TRACES = ("minilm", "decoder")
#: MiniLM layer kept in the MiniLM trace (0-based, of 6)
TRACE_LAYER = 2
#: the decoder trace's causal window: swarm-llama's longest trained context
DECODER_WINDOW = 8192
#: tokens the decoder runs after each window as its causal continuation; their
#: queries are the held-out decode queries of a context ending with the window
DECODER_TAIL = 512
#: bytes of a store entry (one token's K and V in one layer): a Qwen3-32B
#: entry, 8 KV heads x 128 x fp16 x 2, for both traces (see ``Widening``)
ENTRY_BYTES = 4096
QUERY_STRIDE = 8            # held-out decode positions start + S + 8 i
#: a timed block of replayed steps lasts at least this long (s); see Bench.stream
BLOCK_S = 2.5
#: untimed replay before each block (s): drains the throttle's burst credit
WARMUP_S = 0.3


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What a figure's command line chose (one per run; every figure takes
    these options, see :func:`command`).

    Attributes:
        name: the figure's module, e.g. ``"fig11_methods"`` (output name).
        disks: ``testbed`` | ``testbed:NAME`` | ``files:N`` | comma list of paths.
        out: output prefix (``.json``, ``.png``); None: ``bench-out/eval/NAME``.
        smoke: tiny sizes on file disks (CI): checks the harness only.
        queries, reps: held-out queries per point and timed repetitions
            (None: the figure's default).
        qd: engine queue depth (SQEs per ring).
        cache: trace, layout (joblib) and store directory.
        trace_tokens: tokens to capture at least (None: what the figure needs).
        block_s: seconds per timed block (see :meth:`Bench.stream`).
        warmup_s: untimed replay before a block (s).
        trace: ``"minilm"`` (default) or ``"decoder"``: which trace drives
            the figure (see the module docstring).
        command: the command line, recorded in the JSON.
    """
    name: str
    disks: str = "testbed"
    out: pathlib.Path | None = None
    smoke: bool = False
    queries: int | None = None
    reps: int | None = None
    qd: int = 128
    cache: pathlib.Path = CACHE
    trace_tokens: int | None = None
    block_s: float = BLOCK_S
    warmup_s: float = WARMUP_S
    trace: str = "minilm"
    command: str = ""

    def prefix(self, name: str | None = None) -> pathlib.Path:
        """The output prefix of ``name`` (default this figure's); ``-decoder``
        is appended for the decoder trace."""
        if self.out is not None:
            return pathlib.Path(self.out)
        return OUT / ((name or self.name) + ("" if self.trace == "minilm" else f"-{self.trace}")
                      + ("-smoke" if self.smoke else ""))


def store_dir(cfg: BenchConfig, name: str) -> pathlib.Path:
    """The directory of store ``name`` under the cache (its parent created)."""
    d = cfg.cache / "stores" / name
    d.parent.mkdir(parents=True, exist_ok=True)
    return d


def _sha(*parts) -> str:
    """First 12 hex digits of the SHA-256 of ``parts`` (bytes, or their str)."""
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else str(p).encode())
    return h.hexdigest()[:12]
