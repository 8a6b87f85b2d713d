"""A figure's JSON: the payload plus the command line, the machine, the
streaming settings and the trace recipe."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import platform
import sys
import time

import numpy as np

from .config import DECODER_TAIL, DECODER_WINDOW, TRACE_LAYER, BenchConfig
from .traces import decoder_layer, decoder_model, model_hash
from .widening import DECODER_WIDENING, MINILM_WIDENING


def machine() -> dict:
    """The machine a figure ran on, for its JSON: CPUs, kernel, load, memory."""
    return {"cpus": os.cpu_count(), "kernel": platform.release(),
            "loadavg_at_start": os.getloadavg(), "python": platform.python_version(),
            "mem_available_gib": _meminfo("MemAvailable") / 2**30}


def _meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def finish(cfg: BenchConfig, out: pathlib.Path, payload: dict, plot) -> dict:
    """A figure's last step: write its JSON (:func:`write_json`), draw it with
    ``plot(payload, out)`` and return the payload."""
    write_json(cfg, out, payload)
    plot(payload, out)
    return payload


def write_json(cfg: BenchConfig, out: pathlib.Path, payload: dict) -> pathlib.Path:
    """The figure's JSON with the command line, the machine, the streaming
    settings and the trace recipe added."""
    payload = dict(payload)
    payload.setdefault("command", cfg.command or " ".join(sys.argv))
    payload.setdefault("machine", machine())
    payload.setdefault("stream", {"block_s": cfg.block_s, "warmup_s": cfg.warmup_s})
    payload.setdefault("trace", trace_identity(cfg))
    payload.setdefault("trace_recipe", trace_recipe(cfg.trace))
    p = out.with_suffix(".json")
    tmp = p.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=_json_default))
    tmp.replace(p)
    print(f"wrote {p}", file=sys.stderr)
    return p


def trace_identity(cfg: BenchConfig) -> dict:
    """What identifies the trace a figure ran on (for its JSON): the model,
    its checkpoint hash and kept layer (with the decoder's layer rule), the
    window, and how its heads were widened."""
    if cfg.trace == "decoder":
        model = decoder_model()
        rule = decoder_layer(cfg.cache, model)
        return {"kind": "decoder", "model": "swarm-llama", "model_sha256": model_hash(model),
                "layer": rule["layer"], "layer_rule": rule, "window": DECODER_WINDOW,
                "tail": DECODER_TAIL, "widening": dataclasses.asdict(DECODER_WIDENING)}
    return {"kind": "minilm", "model": "sentence-transformers/all-MiniLM-L6-v2",
            "layer": TRACE_LAYER, "window": 512,
            "widening": dataclasses.asdict(MINILM_WIDENING)}


def trace_recipe(kind: str) -> str:
    """How the ``kind`` trace was made and widened, in one line: the
    "Trace: <kind>" and "Stretching to Qwen3-32B entries" paragraphs of the
    package docstring (:mod:`tools.bench._common`)."""
    doc = sys.modules[__package__].__doc__

    def para(head: str) -> list:
        return doc.split(f"**{head}.**")[1].split("**")[0].split()
    return " ".join(para(f"Trace: {kind}") + para("Stretching to Qwen3-32B entries"))


def _json_default(x):
    """``json.dumps``' fallback: numpy scalars and arrays, paths."""
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, pathlib.Path):
        return str(x)
    raise TypeError(type(x))


@contextlib.contextmanager
def timer(label: str):
    """Print the seconds the block took, as ``  label: N s`` on stderr."""
    t0 = time.perf_counter()
    yield
    print(f"  {label}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
