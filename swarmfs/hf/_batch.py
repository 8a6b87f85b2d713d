"""The rows of a :class:`~swarmfs.hf.SwarmCache` batch and what they need
from a forward pass: each row's left padding, its mask columns, K and V in
one dtype, and the generation mode ``generate`` is about to run.

* :class:`Doc` -- one store (a stored document) and its Retriever, serving
  one row or, read-only, several rows that continue the same document.
* :class:`Row` -- one request: its document, its left padding, its
  DecodeSessions, whether it has finished.
* :func:`left_pads` -- each row's left padding, from a prefill's mask.
* :func:`visible` -- a 4D mask (bool or additive) as bool.
* :func:`cast_kv` -- K and V in the store's dtype (autocast) or refused.
* :func:`generation_mode` -- what ``model.generate(**kwargs)`` will run.
"""

from __future__ import annotations

import numpy as np

from .. import _errors as errors
from ._attention import prefix_fingerprint

__all__ = ["Doc", "Row", "left_pads", "visible", "cast_kv", "generation_mode", "begin_generate",
           "crop", "check_request", "BEAM_MODES", "KV_DTYPES"]

#: generation modes that reorder or expand the cache's rows (refused)
BEAM_MODES = frozenset({"beam_search", "beam_sample", "constrained_beam_search",
                        "group_beam_search", "contrastive_search"})

#: the dtypes a store holds
KV_DTYPES = ("float16", "bfloat16", "float32")


class Doc:
    """One store and its Retriever (SWARM §5.2) serving one or more rows.

    Attributes:
        path: the store directory; store: the open :class:`~swarmfs.Store`
            (None before a prefill creates it).
        retriever: its :class:`~swarmfs.Retriever` (made at the first decode).
        rows: the :class:`Row` objects it serves (several only read-only).
        index: a baseline method's index per layer.
        sinks: layer -> (K, V) torch [H_kv, s, d] of the first s tokens
            (attention sinks, kept in DRAM).
        layout_report: per layer, the prefill's clusters and seconds.
        prefix_length: tokens stored when the rows started decoding.
    """

    def __init__(self, path, store=None):
        self.path, self.store = path, store
        self.retriever = None
        self.rows: list[Row] = []
        self.index: dict[int, object] = {}
        self.rules: dict[int, object] = {}
        self.sinks: dict[int, tuple] = {}
        self.layout_report: dict[int, dict] = {}
        self.prefix_length = 0

    @property
    def shared(self) -> bool:
        """Several rows read this store (one retrieval per layer serves them)."""
        return len(self.rows) > 1


class Row:
    """One request of a batch (one row of the model's input).

    Attributes:
        row: its index in the batch; doc: its :class:`Doc`.
        pad: left padding columns before its first real token.
        sessions: layer -> :class:`~swarmfs.DecodeSession` (its new tokens).
        finished: it was fed an end-of-text token; nothing of it is kept since.
        records: layer -> [(query, attended positions, scale)] (``record=True``).
        steps: layer -> decode steps served.
    """

    def __init__(self, row: int, doc: Doc):
        self.row, self.doc = int(row), doc
        self.pad = 0
        self.sessions: dict = {}
        self.finished = False
        self.records: dict[int, list] = {}
        self.steps: dict[int, int] = {}


def visible(m):
    """A 4D attention mask as bool (True: attend).  An additive mask (0 to
    attend, a large negative value not to) is compared with half its dtype's
    minimum."""
    import torch
    if m.dtype == torch.bool:
        return m
    return m > torch.finfo(m.dtype).min / 2


def left_pads(mask, rows: int, length: int, *, store=None) -> np.ndarray:
    """Left padding of each row of a prefill (SWARM's layout sees real tokens only).

    The masked columns before a row's first visible one are its padding: the
    layout, the store and the budget never see them.  A masked column after
    it (``generate`` masks every prompt token equal to ``pad_token_id`` when
    given no ``attention_mask``) stays a token of the row, masked at
    attention time as by dense attention.

    Args:
        mask: the prefill's 4D mask [B or 1, 1, T, length] (bool or additive)
            or None (no padding).
        rows: B; length: key columns.

    Returns:
        int64 [B]: pad columns before each row's first real token.

    Raises:
        ShapeError: a row whose last token is masked (right padding: the
            next token would follow padding) or that is all padding.
    """
    if mask is None:
        return np.zeros(rows, np.int64)
    last = visible(mask[:, 0, -1, :]).cpu().numpy()   # the last query sees its row's real keys
    if last.shape[0] == 1 and rows > 1:
        last = np.broadcast_to(last, (rows, last.shape[1]))
    if last.shape != (rows, length):
        raise errors.ShapeError(f"attention mask of shape {tuple(mask.shape)} for {rows} rows of "
                                f"{length} tokens", store=store)
    pads = np.where(last.any(axis=1), last.argmax(axis=1), length).astype(np.int64)
    bad = np.flatnonzero(~last[:, -1])
    if bad.size:
        b = int(bad[0])
        what = "holds only padding" if pads[b] >= length else "ends in padding"
        raise errors.ShapeError(f"row {b} of the prompt {what}: a SwarmCache lays out each "
                                "row's real tokens, padded on the left (tokenizer "
                                "padding_side='left')", store=store)
    return pads


def cast_kv(k, v, stored: str | None, *, layer: int | None = None, store=None):
    """K and V of one attention call in one dtype, the store's.

    Under ``torch.autocast`` the projections give V in the autocast dtype and
    K, through RoPE's float32 tables, in float32; SDPA then computes in the
    autocast dtype anyway.  So under autocast both are cast to the store's
    dtype (a new store takes the autocast dtype); without it they must
    already be in it.

    Args:
        k, v: torch [B, H_kv, T, d].
        stored: the store's dtype name, or None before the first store exists.

    Returns:
        (k, v, dtype name).

    Raises:
        ShapeError: without autocast, K and V differ in dtype or differ from
            the store's (nothing is written); a dtype a store cannot hold.
    """
    import torch
    dev = k.device.type
    auto = torch.is_autocast_enabled(dev)
    if stored is not None:
        target = getattr(torch, stored)
    elif auto:
        target = torch.get_autocast_dtype(dev)
    else:
        target = k.dtype
    name = str(target).removeprefix("torch.")
    if name not in KV_DTYPES:
        raise errors.ShapeError(f"KV dtype {name} is not float16, bfloat16 or float32",
                                layer=layer, store=store)
    if k.dtype == target and v.dtype == target:
        return k, v, name
    if auto:
        return k.to(target), v.to(target), name
    kn, vn = (str(x.dtype).removeprefix("torch.") for x in (k, v))
    model = kn if kn == vn else f"K {kn} / V {vn}"
    if stored is None:
        raise errors.ShapeError(f"K is {kn} and V is {vn}: a store holds both in one dtype "
                                "(under torch.autocast both are cast to the autocast dtype)",
                                layer=layer, store=store)
    raise errors.ShapeError(f"the store's entries differ from the model's (dtype: store "
                            f"{stored}, model {model})", layer=layer, store=store)


def generation_mode(model, kwargs: dict):
    """What ``model.generate(**kwargs)`` will run, before it runs.

    Returns:
        (mode name, e.g. ``"greedy_search"``, ``"assisted_generation"``,
        ``"beam_search"``; the effective ``GenerationConfig``), or
        (None, None) when the settings do not validate (``generate`` then
        raises its own error before any forward).
    """
    import copy
    import warnings

    from transformers import GenerationConfig
    gc = kwargs.get("generation_config") or getattr(model, "generation_config", None) or \
        GenerationConfig()
    gc = copy.deepcopy(gc)
    upd = {k: v for k, v in kwargs.items() if k != "generation_config" and hasattr(gc, k)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            gc.update(**upd)
            mode = gc.get_generation_mode(kwargs.get("assistant_model"))
        except (ValueError, TypeError, AttributeError):
            return None, None
    return getattr(mode, "value", str(mode)), gc


def begin_generate(cache, model, args, kwargs) -> None:
    """What a SwarmCache does when ``generate`` starts, before any token is
    fed (:func:`swarmfs.hf.enable` wraps ``generate`` to call it): refuses
    beam search (and contrastive search) and a batch of another number of
    rows, and tells the cache the prompt's length under assisted or
    prompt-lookup decoding: transformers' first forward then holds the
    prompt and the first drafts, and only the prompt is laid out; the
    drafts' entries stay in DRAM until accepted (``SwarmCache.crop`` removes
    the rejected ones; nothing unaccepted is ever written).

    Raises:
        ConfigError: beam or contrastive search; assisted decoding over
            several rows or from a stored document.
        ShapeError: input ids of another number of rows than the cache's.
    """
    mode, gc = generation_mode(model, kwargs)
    if mode is None:
        return                          # generate raises its own error first
    if mode in BEAM_MODES:
        raise errors.ConfigError(
            f"{mode.replace('_', ' ')} is not served by a SwarmCache: its beams share a "
            "stored prompt but each needs its own new tokens in DRAM, reordered at every "
            "step, and which beam's tokens to append to the store is known only at the "
            "end; use greedy or sampled decoding (for several sequences, several rows "
            "with a store each)", store=cache.path)
    ids = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
    if getattr(ids, "ndim", 0) == 2:
        n = int(ids.shape[0]) * int(getattr(gc, "num_return_sequences", 1) or 1)
        if n != cache.num_rows:
            raise errors.ShapeError(f"generate would run {n} rows; this SwarmCache serves "
                                    f"{cache.num_rows} (one store per row)", store=cache.path)
    if mode != "assisted_generation":
        return
    if cache.num_rows != 1:
        raise errors.ConfigError("assisted decoding serves one row", store=cache.path)
    if cache.get_seq_length() != 0 or getattr(ids, "ndim", 0) != 2:
        raise errors.ConfigError("assisted decoding with a SwarmCache starts from a new store "
                                 "(transformers feeds the whole request at its first step, "
                                 "stored part included)", store=cache.path)
    cache._prompt_tokens = int(ids.shape[1])


def crop(cache, layers, tokens_to_remove) -> None:
    """Remove the newest ``-tokens_to_remove`` tokens of ``layers`` of a
    one-row cache, checked on every layer before any changes: they must
    still be pending in DRAM (``DecodeSession.discard_pending``).

    Raises:
        InvalidArgumentError: not an integer.  ConfigError: a positive
            count, several rows, or tokens already laid out on the disks.
    """
    if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, (int, np.integer)):
        raise errors.InvalidArgumentError(f"crop takes a negative token count, got "
                                          f"{tokens_to_remove!r}", store=cache.path)
    if tokens_to_remove > 0:
        raise errors.ConfigError("a SwarmCache crops by a negative count of tokens to remove "
                                 "(crop(-n)), not to a length", store=cache.path)
    n = -int(tokens_to_remove)
    if n == 0:
        return
    if cache.num_rows != 1:
        raise errors.ConfigError("crop serves one row", store=cache.path)
    sessions = cache.sessions
    for lay in layers:
        sess = sessions.get(lay.layer_idx)
        pend = sess.pending if sess is not None else 0
        if n > pend:
            raise errors.ConfigError(f"cannot remove {n} tokens: {pend} of layer "
                                     f"{lay.layer_idx}'s new tokens are still in DRAM, the "
                                     "others are laid out on the disks",
                                     layer=lay.layer_idx, store=cache.path)
    for lay in layers:
        sessions[lay.layer_idx].discard_pending(n)
        lay.seen -= n


def check_request(cache, input_ids, attention_mask=None) -> None:
    """Refuse request ids that do not continue the stored prompts of a cache
    over stored documents (``SwarmCache.from_store(..., input_ids=)``): one
    sequence per row, each padded on the left so that its document ends
    where the longest does, each starting with its store's fingerprinted
    prompt and going on by at least one token.

    Raises:
        ShapeError: naming the row and what differs.
    """
    B = len(cache._rows)
    where = {"store": cache.path}
    try:
        ids = np.asarray(input_ids.cpu() if hasattr(input_ids, "cpu") else input_ids)
        am = None if attention_mask is None else np.asarray(
            attention_mask.cpu() if hasattr(attention_mask, "cpu") else attention_mask)
    except (TypeError, ValueError) as exc:
        raise errors.ShapeError(f"input_ids: {exc}", **where) from None
    if ids.ndim == 1:
        ids = ids[None]
        am = None if am is None else am.reshape(1, -1)
    if ids.dtype.kind not in "iu" or ids.ndim != 2 or ids.shape[0] != B:
        raise errors.ShapeError(f"input_ids must hold one sequence of token ids per row "
                                f"({B} row{'s' if B > 1 else ''}), got {ids.dtype} "
                                f"{ids.shape}", **where)
    L = ids.shape[1]
    pads = np.zeros(B, np.int64)
    if am is not None:
        if am.shape != ids.shape:
            raise errors.ShapeError(f"attention_mask of shape {am.shape} for input_ids "
                                    f"{ids.shape}", **where)
        vis = am.astype(bool)
        pads = L - vis.sum(axis=1)
        if not (vis == (np.arange(L)[None] >= pads[:, None])).all():
            raise errors.ShapeError("attention_mask: pad on the left only", **where)
    for r in cache._rows:
        st, n = r.doc.store, r.doc.prefix_length
        name = f"row {r.row}: " if B > 1 else ""
        if pads[r.row] != r.pad:
            raise errors.ShapeError(f"{name}its stored document of {n} tokens must end at "
                                    f"column {n + r.pad}, with the others: pad it on the "
                                    f"left by {r.pad} tokens, not {pads[r.row]}",
                                    store=st.path)
        real = ids[r.row, pads[r.row]:]
        rec = st.layer_record(0).extra.get("prefix") if 0 in st.layers else None
        if not isinstance(rec, dict) or not isinstance(rec.get("tokens"), int) or \
                not 0 < rec["tokens"] <= n:
            raise errors.ShapeError(f"{name}the store records no fingerprint of its prompt's "
                                    "token ids (prefilled without swarmfs.hf.enable's hook); "
                                    "open it without input_ids", store=st.path)
        if real.shape[0] <= n:
            raise errors.ShapeError(f"{name}the request has {real.shape[0]} tokens; it must "
                                    f"continue the {n} stored tokens with at least one more",
                                    store=st.path)
        p = rec["tokens"]
        if prefix_fingerprint(real[:p]) != rec:
            raise errors.ShapeError(f"{name}the request's first {p} token ids are not the "
                                    f"stored prompt's (fingerprint differs): it does not "
                                    f"continue the stored document", store=st.path)
