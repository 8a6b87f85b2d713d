"""The transformers Cache and attention function of :mod:`swarmfs.hf` (its
docstring tells the whole story; SWARM §5-§7)."""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import numpy as np

from .. import _errors as errors
from .. import _defaults as defaults
from .. import _validate as V
from ..layout._layer import LayoutParams, lay_out_layer
from ..store._index import union_ints
from ..decode._online import DecodeSession
from ..decode._retrieve import Retriever
from ..store._store import Store, to_torch
from ..decode._window import stored_window

__all__ = ["ATTENTION", "METHODS", "SwarmCache", "SwarmLayer", "StepStats", "enable", "register",
           "prefix_fingerprint",
           "swarm_attention_forward"]

#: name of the attention implementation registered with transformers
ATTENTION = "swarm"

_TORCH_DTYPES = ("float16", "bfloat16", "float32")

#: layouts a SwarmCache can build at prefill (SWARM's and the §8 baselines')
METHODS = ("swarm", "quest", "infllm", "pqcache")


def _baseline_layout(method: str, q: np.ndarray, k: np.ndarray):
    """A baseline's layout of one layer (``swarmfs.layout._baselines``)."""
    from ..layout import _baselines as B
    if method == "quest":
        return B.quest_pages(k)
    if method == "infllm":
        return B.infllm_blocks(q, k)
    return B.kmeans_clusters(k)


def _baseline_rule(layout):
    """How a baseline's layout grows while decoding (its pages, blocks or
    centroids; ``swarmfs.layout._baselines.append_rule``)."""
    from ..layout import _baselines as B
    return B.append_rule(layout)


def _baseline_selector(method: str, index: dict):
    """The Retriever's selector for a baseline's per-layer index (None: SWARM's
    medoid index)."""
    from ..decode import _selectors as Sel
    if method == "swarm":
        return None
    if method == "quest":
        return Sel.BoundSelector({L: (x["lo"], x["hi"]) for L, x in index.items()})
    if method == "infllm":
        return Sel.MultiVectorSelector({L: x["reps"] for L, x in index.items()}, name=method)
    return Sel.VectorSelector({L: x["vectors"] for L, x in index.items()}, name=method)


def _torch():
    import torch
    return torch


def _dtype_name(t) -> str:
    name = str(t.dtype).removeprefix("torch.")
    if name not in _TORCH_DTYPES:
        raise errors.ShapeError(f"KV dtype {t.dtype} is not float16, bfloat16 or float32")
    return name


def _to_numpy(t, dtype_name: str) -> np.ndarray:
    """torch tensor -> numpy in the store dtype (bfloat16 as ml_dtypes)."""
    t = t.detach().cpu().contiguous()
    if dtype_name == "bfloat16":
        import ml_dtypes
        return t.view(_torch().int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _sdpa(module, query, key, value, mask, **kw):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    return sdpa_attention_forward(module, query, key, value, mask, **kw)


@V.checked
def swarm_attention_forward(module, query, key, value, attention_mask, scaling=None,
                            dropout: float = 0.0, **kwargs):
    """The ``"swarm"`` attention function (transformers' AttentionInterface).

    Keys that come from a :class:`SwarmCache` carry a tag that routes the
    call: prefill attends densely with SDPA and then lays the layer out and
    writes it to the store; a decode step attends over what the Retriever
    returned.  Any other cache (or none) gets plain SDPA, so a model set to
    ``"swarm"`` still works with ``DynamicCache``.

    Args:
        module: the attention module (``layer_idx``, ``num_key_value_groups``).
        query: [B, H_q, T, d]; key, value: [B, H_kv, T', d].
        attention_mask: 4D mask or None.
        scaling: softmax scale.

    Returns:
        (attn_output [B, T, H_q, d], None).
    """
    tag = getattr(key, "_swarm", None)
    if tag is None:
        return _sdpa(module, query, key, value, attention_mask, dropout=dropout,
                     scaling=scaling, **kwargs)
    cache, layer, mode = tag
    cache.layers[layer].in_flight = False
    if mode == "prefill":
        out = _sdpa(module, query, key, value, attention_mask, dropout=dropout,
                    scaling=scaling, **kwargs)
        cache._lay_out(layer, query, key, value, scaling)
        return out
    return cache._decode(layer, module, query, key, value, scaling, attention_mask)


_REGISTERED = False


@V.checked
def register() -> None:
    """Register ``"swarm"`` with transformers' AttentionInterface and
    AttentionMaskInterface (the mask is SDPA's).  Idempotent; runs on import."""
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    AttentionInterface.register(ATTENTION, swarm_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)
    _REGISTERED = True


#: the input ids of the forward pass running on this thread (set by the hook
#: :func:`enable` puts on the model's input embeddings): a prefill records
#: their fingerprint in the store, so that :meth:`SwarmCache.from_store` can
#: check a later request's ids against it
_FORWARD = threading.local()


def _record_ids(module, args):
    ids = args[0] if args else None
    _FORWARD.ids = ids if getattr(ids, "ndim", 0) == 2 else None


def _forget_ids(module, args, output):
    _FORWARD.ids = None            # a later forward of an unhooked model sees none


@V.checked
def prefix_fingerprint(ids) -> dict:
    """{"tokens": n, "xxh3": hex digest of the ids as int64}: what a prefill
    records of its prompt (layer 0's ``extra["prefix"]``)."""
    import xxhash
    a = np.ascontiguousarray(np.asarray(ids, dtype=np.int64).reshape(-1))
    return {"tokens": int(a.shape[0]), "xxh3": xxhash.xxh3_64_hexdigest(a.tobytes())}


@V.checked
def enable(model):
    """Switch a loaded model to the ``"swarm"`` attention implementation.

    Also hooks the model's input embeddings so that a prefill records a
    fingerprint of its prompt's token ids in the store (checked by
    :meth:`SwarmCache.from_store` when given the request's ids).

    Concurrency: the ids a forward pass sees are kept per thread (and
    forgotten when the model's forward returns), so forwards of one enabled
    model may run on several threads at once, each with its own
    ``SwarmCache``: each prefill records its own prompt.  One cache is used
    by one thread at a time.

    Returns:
        the model.

    Raises:
        ConfigError: the model does not accept the implementation.
    """
    register()
    try:
        model.set_attn_implementation(ATTENTION)
    except (ValueError, KeyError, AttributeError) as exc:
        raise errors.ConfigError(f"cannot switch the model to the swarm attention: {exc}") from None
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is not None and not getattr(emb, "_swarm_ids_hook", False):
        emb.register_forward_pre_hook(_record_ids)
        model.register_forward_hook(_forget_ids)
        emb._swarm_ids_hook = True
    return model


@V.checked_methods
@dataclasses.dataclass(frozen=True)
class StepStats:
    """One decode step of one layer.

    Attributes:
        step: decode step (0 = first token after the stored prefix).
        layer: layer.
        clusters: clusters selected; hot: of those, served from DRAM.
        entries: stored entries attended to; entries_ssd: of those read from
            the disks; pending: new tokens attended to from DRAM.
        bytes_read, requests: the batched read (bytes incl. alignment).
        score_us, select_us, plan_us, io_us, assemble_us: retrieval stages (µs).
        session_us: DecodeSession work besides retrieval: eq. 9 counts, cache
            replacement, appends (µs).
        attend_us: the attention product over the retrieved entries (µs).
        wait_us: time this layer waited for its §7 prefetch to finish (µs;
            the prefetch's own stage times are in score_us ... assemble_us,
            spent in the background thread).
        measure_us: scoring the exact query to measure the prefetch hit
            rate (µs; measurement only, CPU).
        prefetched: the retrieval came from a §7 prefetch.
        prefetch_hit: fraction of the entries the exact query selects
            (its clusters and the window) that the prefetched retrieval
            holds (NaN without prefetch).
        cache_hit_rate: the layer's running §6.2 cache hit rate.
    """
    step: int
    layer: int
    clusters: int
    hot: int
    entries: int
    entries_ssd: int
    pending: int
    bytes_read: int
    requests: int
    score_us: float
    select_us: float
    plan_us: float
    io_us: float
    assemble_us: float
    session_us: float
    attend_us: float
    wait_us: float
    measure_us: float
    prefetched: bool
    prefetch_hit: float
    cache_hit_rate: float


def _cache_base():
    from transformers.cache_utils import Cache, CacheLayerMixin
    return Cache, CacheLayerMixin


Cache, CacheLayerMixin = _cache_base()


@V.checked_methods
class SwarmLayer(CacheLayerMixin):
    """One layer of a :class:`SwarmCache` (it holds no KV tensors: they are
    in the store, the Retriever's DRAM partition and the DecodeSession)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, cache: "SwarmCache", layer: int, seen: int = 0):
        super().__init__()
        self.cache, self.layer_idx, self.seen = cache, layer, int(seen)
        self.in_flight = False       # updated, not yet attended (misuse detection)

    def lazy_initialization(self, key_states, value_states) -> None:
        """transformers' Cache API: note the device on first update."""
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        """transformers' Cache API: take this step's K/V [1, H_kv, T, d] and
        return what attention reads (the SwarmCache lays out at prefill,
        retrieves at decode)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self.cache._update(self, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """transformers' Cache API: (kv length, kv offset) for the attention mask.

        Raises:
            ShapeError: no new token to attend (a request whose input ids
                are shorter than the stored prefix: generate() feeds the
                ids after the cache's length, here none)."""
        if int(query_length) <= 0:
            raise errors.ShapeError(
                f"the request gives no token after the {self.seen} the cache holds: input "
                f"ids must start with the stored prefix and may not be shorter than it",
                layer=self.layer_idx, store=self.cache.path)
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        """transformers' Cache API: tokens seen by this layer."""
        return self.seen

    def get_max_length(self) -> int:
        """transformers' Cache API: -1, no maximum length."""
        return -1

    def reset(self) -> None:
        """Not supported: raises ConfigError (the prefix is on the disks)."""
        raise errors.ConfigError("a SwarmCache cannot be reset; make a new one (or from_store)",
                                 layer=self.layer_idx)

    def crop(self, tokens_to_remove: int) -> None:
        """Not supported: raises ConfigError (the prefix is on the disks)."""
        raise errors.ConfigError("a SwarmCache cannot be cropped (its prefix is on the disks)",
                                 layer=self.layer_idx)

    def reorder_cache(self, beam_idx) -> None:
        """Not supported (beam search): raises ConfigError."""
        raise errors.ConfigError("a SwarmCache serves one sequence; beam search is not supported",
                                 layer=self.layer_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Batch size 1 only: ConfigError unless ``repeats`` is 1."""
        if repeats != 1:
            raise errors.ConfigError("a SwarmCache serves batch size 1", layer=self.layer_idx)

    def batch_select_indices(self, indices) -> None:
        """Not supported (batch size 1): raises ConfigError."""
        raise errors.ConfigError("a SwarmCache serves batch size 1", layer=self.layer_idx)


@V.checked_methods
class SwarmCache(Cache):
    """A transformers ``Cache`` whose prefix KV lives on a swarmfs store.

    Args:
        store: a store directory (created at prefill; see ``force``) or a
            :class:`Store` opened writable and empty.
        config: the model's config (``num_hidden_layers``,
            ``num_key_value_heads``, ``head_dim``, ``num_attention_heads``);
            required for a new store, checked against a stored one.
        ratio: sparsity ratio r for profiling and retrieval (entry budget
            ceil(r x S), local window included; §8.1 uses 0.10).  r = 1
            attends to the whole context (exactly dense attention).
        disks: N file disks or a list of disk paths (as ``Store.create``).
        layout: :class:`swarmfs.layout.LayoutParams` (tau, local window,
            hot fraction, eq. 6 costs); its ratio is replaced by ``ratio``,
            and a tau of None by ``defaults.DECODER_TAU`` (0.3).
        prefetch: ``"none"`` or ``"previous"`` (§7, see the module docstring).
        method: ``"swarm"`` (co-activation clusters, medoid index), or one of
            the evaluation's baselines laid out by ``swarmfs.layout._baselines``
            on the same store and Retriever: ``"quest"`` (pages of 16, min/max
            bounds), ``"infllm"`` (blocks of 64, 4 representative keys),
            ``"pqcache"`` (k-means per 4,096-token chunk, centroids).  While
            decoding (``append=True``) a baseline grows by its own rule
            (``swarmfs.layout._baselines.append_rule``): Quest appends pages,
            InfLLM blocks, PQCache assigns new keys to its centroids.
        hot_budget: DRAM for hot clusters per layer, as a fraction of the
            layer's stored KV bytes; §6.2 replacement fills it while decoding
            (default: what the layout's eq. 6 choice takes,
            ``LayoutParams.hot_fraction``).
        append: new tokens join clusters and are appended to the store
            (§6.2, eq. 9); False keeps them in DRAM for the whole request.
        tau: eq. 9 radius of the DecodeSessions.
        record: keep each step's query and retrieved positions per layer
            (``records``) for recall against the oracle; costs RAM.
        force: replace an existing store at ``store``.
        engine: I/O engine name (``"io_uring"``, ``"threads"``, auto).

    Raises:
        InvalidRatioError: ratio or tau outside (0, 1].
        InvalidChoiceError: an unknown prefetch or method.
        InvalidFractionError: hot_budget outside [0, 1].
        InvalidBoolError: append, record or force not True or False.
        InvalidCallError: an unknown keyword argument.
        InvalidArgumentError: other bad arguments.  ConfigError: no config for a new
        store, or an unsupported model (sliding windows smaller than the
        context).  StoreExistsError: ``store`` holds a store and ``force`` is
        False.
    """

    #: the DecodeSession class each layer uses (a benchmark may substitute a
    #: subclass with another cache-replacement policy)
    session_class = DecodeSession

    def __init__(self, store, config=None, *, ratio: float = defaults.RATIO, disks=4,
                 layout: LayoutParams | None = None, prefetch: str = "none",
                 append: bool = True, tau: float = defaults.ONLINE_TAU, record: bool = False,
                 method: str = "swarm", hot_budget: float | None = None, force: bool = False,
                 engine: str | None = None, _opened: Store | None = None):
        register()
        V.parse_choice(method, "method", METHODS)
        if method != "swarm" and _opened is not None:
            raise errors.InvalidArgumentError("from_store serves swarm layouts only (the "
                                              "baselines' indexes are not stored)")
        self.method = method
        if hot_budget is not None:
            V.parse_fraction(hot_budget, "hot_budget")
        self.hot_budget = hot_budget
        self._index: dict[int, object] = {}
        self._rules: dict[int, object] = {}       # a baseline's append rule per layer
        V.parse_ratio(ratio, "ratio")
        # the DecodeSessions' rule, checked now: they start only at the first
        # decode step, after the prefill has written the store
        V.parse_ratio(tau, "tau")
        V.parse_choice(prefetch, "prefetch", ("none", "previous"))
        for name, v in (("append", append), ("record", record), ("force", force)):
            V.parse_bool(v, name)
        if layout is not None:
            V.parse_instance(layout, "layout", LayoutParams)
        self.ratio = float(ratio)
        layout = layout or LayoutParams()
        self.params = dataclasses.replace(
            layout, ratio=self.ratio,
            tau=defaults.DECODER_TAU if layout.tau is None else layout.tau)
        self.prefetch_mode = prefetch
        self.append, self.tau, self.record = bool(append), float(tau), bool(record)
        self._disks, self._force, self._engine = disks, force, engine
        self.config = config.get_text_config(decoder=True) if config is not None and \
            hasattr(config, "get_text_config") else config
        self.store: Store | None = None
        self.path = None
        seen = 0
        if _opened is not None:
            self.store = _opened
            self.path = _opened.path
            seen = self._stored_length()
            num_layers = _opened.num_layers
            if self.config is not None:
                self._check_config_against_store()
        elif isinstance(store, Store):
            self.store, self.path = store, store.path
            if store.layers:
                raise errors.StoreExistsError("the Store given to SwarmCache already holds layers; "
                                              "use SwarmCache.from_store", store=store.path)
            if not store.writable:
                raise errors.InvalidArgumentError("the Store must be open writable",
                                                  store=store.path)
            if self.config is None:
                raise errors.ConfigError("SwarmCache needs the model config for a new store")
            num_layers = int(self.config.num_hidden_layers)
            self._check_config_against_store()
        elif isinstance(store, (str, os.PathLike)):
            self.path = os.path.abspath(os.fspath(store))
            if self.config is None:
                raise errors.ConfigError("SwarmCache needs the model config for a new store "
                                         "(SwarmCache(path, model.config)); reopen a stored prefix "
                                         "with SwarmCache.from_store(path)", store=self.path)
            if not force and os.path.exists(os.path.join(self.path, "manifest.json")):
                raise errors.StoreExistsError("a store already exists here (reopen it with "
                                              "SwarmCache.from_store; to replace it: force=True, "
                                              "or --force on the command line)",
                                              store=self.path)
            num_layers = int(self.config.num_hidden_layers)
        else:
            raise errors.InvalidArgumentError(f"store must be a path or a Store, got {store!r}")
        super().__init__(layers=[SwarmLayer(self, i, seen) for i in range(num_layers)])
        self.prefix_length = seen
        self.retriever: Retriever | None = None
        self.sessions: dict[int, DecodeSession] = {}
        self.stats: list[StepStats] = []
        self.records: dict[int, list] = {}
        self.layout_report: dict[int, dict] = {}
        self._futures: dict = {}
        self._prev_q: dict[int, np.ndarray] = {}
        self._steps: dict[int, int] = {}
        self._closed = False

    # -- construction from a stored prefix ------------------------------------
    @classmethod
    def from_store(cls, path, config=None, *, ratio: float = defaults.RATIO, append: bool = False,
                   verify: bool = True, engine: str | None = None, input_ids=None,
                   **kw) -> "SwarmCache":
        """Reopen a stored prefix: decoding continues from the disks, no prefill.

        The request's input ids must start with the stored tokens; generate()
        then feeds only the tokens after them, so the model never sees the
        stored part of the request again.  Pass the request's ``input_ids``
        (the same tensor given to ``generate``) and they are checked: the
        store's prefill recorded a fingerprint of its prompt's ids (xxh3 of
        the int64 ids, layer 0's ``extra["prefix"]``), and a request that
        does not start with them, or has no token after the stored tokens,
        is refused.  Tokens a request appended after the prompt
        (``append=True``) are counted but not fingerprinted.
        Without ``input_ids`` nothing checks that the request continues the
        stored document: another document would attend to its KV.

        Args:
            path: the store directory a SwarmCache prefilled.
            config: the model config (checked against the store's shape).
            ratio: sparsity ratio r of this request.
            append: append this request's tokens to the store (default False:
                the stored document stays as it is for other requests).
            verify: verify checksums on reads.

        Raises:
            StoreNotFoundError, ManifestError, DiskError: as ``Store.open``.
            ShapeError: the store's shape or dtype differs from the config's,
            or its layers hold different numbers of tokens; ``input_ids``
            that do not start with the stored prompt, have no token after
            it, hold more than one sequence, or meet a store whose prefill
            recorded no fingerprint.
        """
        store = Store.open(path, writable=bool(append), verify=verify, engine=engine)
        try:
            cache = cls(path, config, ratio=ratio, append=append, engine=engine,
                        _opened=store, **kw)
            if input_ids is not None:
                cache._check_request(input_ids)
            return cache
        except BaseException:
            store.close()
            raise

    def _check_request(self, input_ids) -> None:
        """Refuse request ids that do not continue the stored prompt."""
        st = self.store
        try:
            ids = np.asarray(input_ids.cpu() if hasattr(input_ids, "cpu") else input_ids)
        except (TypeError, ValueError) as exc:
            raise errors.ShapeError(f"input_ids: {exc}", store=st.path) from None
        if ids.dtype.kind not in "iu" or ids.ndim not in (1, 2) or \
                (ids.ndim == 2 and ids.shape[0] != 1):
            raise errors.ShapeError(f"input_ids must be one sequence of token ids, got "
                                    f"{ids.dtype} {ids.shape}", store=st.path)
        ids = ids.reshape(-1)
        n = self.prefix_length
        rec = st.layer_record(0).extra.get("prefix") if 0 in st.layers else None
        if not isinstance(rec, dict) or not isinstance(rec.get("tokens"), int) or \
                not 0 < rec["tokens"] <= n:
            raise errors.ShapeError("the store records no fingerprint of its prompt's token "
                                    "ids (prefilled without swarmfs.hf.enable's hook); open "
                                    "it without input_ids", store=st.path)
        if ids.shape[0] <= n:
            raise errors.ShapeError(f"the request has {ids.shape[0]} tokens; it must continue "
                                    f"the {n} stored tokens with at least one more",
                                    store=st.path)
        p = rec["tokens"]
        if prefix_fingerprint(ids[:p]) != rec:
            raise errors.ShapeError(f"the request's first {p} token ids are not the stored "
                                    f"prompt's (fingerprint differs): it does not continue "
                                    f"the stored document", store=st.path)

    def _stored_length(self) -> int:
        st = self.store
        if sorted(st.layers) != list(range(st.num_layers)):
            raise errors.ShapeError(f"the store holds layers {st.layers}, not all "
                                    f"{st.num_layers}: the prefill did not finish", store=st.path)
        lens = {st.num_tokens(i) for i in st.layers}
        if len(lens) != 1:
            raise errors.ShapeError(f"the store's layers hold different token counts "
                                    f"{sorted(lens)}", store=st.path)
        return lens.pop()

    def _model_shape(self):
        c = self.config
        Hq = int(c.num_attention_heads)
        Hkv = int(getattr(c, "num_key_value_heads", None) or Hq)
        d = int(getattr(c, "head_dim", None) or c.hidden_size // Hq)
        return int(c.num_hidden_layers), Hkv, d, Hq

    def _check_config_against_store(self) -> None:
        L, Hkv, d, Hq = self._model_shape()
        st = self.store
        stored_q = st.model.num_query_heads
        diffs = [f"{what}: store {a}, model {b}" for what, a, b in (
            ("layers", st.num_layers, L), ("KV heads", st.num_kv_heads, Hkv),
            ("head_dim", st.head_dim, d), ("query heads", stored_q, Hq)) if a != b]
        if diffs:
            raise errors.ShapeError("the store's entry shape differs from the model's (" +
                                    "; ".join(diffs) + ")", store=st.path)

    # -- per-layer update -----------------------------------------------------
    def _check_kv(self, layer: int, k, v) -> None:
        if k.ndim != 4 or k.shape != v.shape:
            raise errors.ShapeError(f"key/value shapes {tuple(k.shape)} / {tuple(v.shape)} are "
                                    "not [B, H_kv, T, d]", layer=layer, store=self.path)
        if k.shape[0] != 1:
            raise errors.ShapeError(f"a SwarmCache serves batch size 1, got {k.shape[0]}",
                                    layer=layer, store=self.path)
        if self.store is None:
            return
        st = self.store
        diffs = []
        if k.shape[1] != st.num_kv_heads:
            diffs.append(f"KV heads: store {st.num_kv_heads}, model {k.shape[1]}")
        if k.shape[3] != st.head_dim:
            diffs.append(f"head_dim: store {st.head_dim}, model {k.shape[3]}")
        name = str(k.dtype).removeprefix("torch.")
        if name != st.dtype:
            diffs.append(f"dtype: store {st.dtype}, model {name}")
        if diffs:
            raise errors.ShapeError("the store's entries differ from the model's (" +
                                    "; ".join(diffs) + ")", layer=layer, store=st.path)

    def _check_window(self, layer: int, total: int) -> None:
        sw = getattr(self.config, "sliding_window", None) if self.config is not None else None
        use = getattr(self.config, "use_sliding_window", True) if self.config is not None \
            else False
        if sw and use and total > int(sw):
            raise errors.ConfigError(f"context of {total} tokens exceeds the model's sliding "
                                     f"window {sw}; SwarmCache serves full-attention layers "
                                     "only",
                                     layer=layer, store=self.path)

    def _update(self, lay: SwarmLayer, k, v):
        if self._closed:
            raise errors.SwarmError("the SwarmCache is closed", store=self.path)
        layer = lay.layer_idx
        self._check_kv(layer, k, v)
        T = int(k.shape[2])
        self._check_window(layer, lay.seen + T)
        mode = "decode" if lay.seen > 0 else "prefill"
        if lay.in_flight or (mode == "decode" and (
                self.store is None or layer not in self.store.layers)):
            raise errors.ConfigError(
                "the previous call of this layer did not attend through swarmfs: load the "
                "model with attn_implementation='swarm' (after import swarmfs.hf) or call "
                "swarmfs.hf.enable(model); a SwarmCache also serves one thread at a time",
                layer=layer, store=self.path)
        lay.seen += T
        lay.in_flight = True
        k._swarm = (self, layer, mode)
        return k, v

    # -- prefill: layout and write ---------------------------------------------
    def _create_store(self, k) -> None:
        L, Hkv, d, Hq = self._model_shape()
        if k.shape[1] != Hkv or k.shape[3] != d:
            raise errors.ShapeError(f"key shape {tuple(k.shape)} does not match the config "
                                    f"(H_kv {Hkv}, head_dim {d})", layer=0, store=self.path)
        self.store = Store.create(self.path, disks=self._disks, num_layers=L,
                                  num_kv_heads=Hkv, head_dim=d, dtype=_dtype_name(k),
                                  num_query_heads=Hq, force=self._force, engine=self._engine,
                                  model_name=getattr(self.config, "_name_or_path", None) or
                                  getattr(self.config, "model_type", None))

    def _lay_out(self, layer: int, query, key, value, scaling) -> None:
        """SWARM §5: profile the prompt's own queries, Algorithm 1, eq. 6,
        eq. 7; write the layer; keep nothing of it in RAM."""
        torch = _torch()
        t0 = time.perf_counter()
        if self.store is None:
            self._create_store(key)
        self._check_kv(layer, key, value)
        S = int(key.shape[2])
        ids = getattr(_FORWARD, "ids", None)
        prefix = ({"prefix": prefix_fingerprint(ids[0].cpu().numpy())}
                  if layer == 0 and ids is not None and tuple(ids.shape) == (1, S) else {})
        q = query[0].detach().float().cpu().numpy()           # [H_q, S, d]
        k32 = key[0].detach().float().cpu().numpy()           # [H_kv, S, d]
        kv = torch.stack([key[0], value[0]], 0).permute(2, 0, 1, 3).contiguous()
        W = stored_window(self.params.local_window, self.params.ratio, S)
        if self.method == "swarm":
            cl, hot = lay_out_layer(q, k32, params=self.params, scaling=float(scaling),
                                    layer=layer, entry_bytes=self.store.entry_bytes)
            del q, k32
            t1 = time.perf_counter()
            self.store.write_layer(layer, kv, (cl.ptr, cl.members), cl.medoids, hot=hot,
                                   freq=cl.freq, local_window=W,
                                   extra={"layout": {"tau": cl.stats.tau,
                                                     "metric": cl.stats.metric,
                                                     "ratio": self.ratio}, **prefix})
            rep = {"clusters": cl.stats.num_clusters, "mean_size": cl.stats.size_mean,
                   "replication": cl.stats.replication, "hot_clusters": int(hot.sum())}
        else:
            lay = _baseline_layout(self.method, q, k32)
            del q, k32
            t1 = time.perf_counter()
            self.store.write_layer(layer, kv, (lay.ptr, lay.members), lay.medoids,
                                   freq=lay.freq, local_window=W,
                                   extra={"layout": {"method": self.method}, **prefix})
            self._index[layer] = lay.index
            self._rules[layer] = _baseline_rule(lay)
            rep = {"clusters": lay.num_clusters, "mean_size": float(lay.sizes.mean()),
                   "replication": float(lay.members.shape[0] / S), "hot_clusters": 0}
        del kv
        self.layout_report[layer] = {**rep, "layout_s": t1 - t0,
                                     "write_s": time.perf_counter() - t1}
        self.prefix_length = S

    # -- decode ----------------------------------------------------------------
    def _ensure_retriever(self) -> Retriever:
        if self.retriever is None:
            if self.store is None:
                raise errors.InternalError("decode before prefill", store=self.path)
            self.prefix_length = self._stored_length()
            self.retriever = Retriever(self.store, ratio=self.ratio,
                                       selector=_baseline_selector(self.method, self._index))
            self._index.clear()     # the selector holds the indexes now, and grows them
        return self.retriever

    def _session(self, layer: int) -> DecodeSession:
        s = self.sessions.get(layer)
        if s is None:
            r = self._ensure_retriever()
            kw = {"reuse_outputs": True}           # K/V built in place, no copies per step
            if not self.append:
                kw["flush_batch"] = 1 << 62
            if self.hot_budget is not None:
                kw["hot_budget_bytes"] = int(self.hot_budget * self.store.num_tokens(layer) *
                                             self.store.entry_bytes)
            if self.method != "swarm":             # new tokens grow the baseline's index
                kw["baseline"] = self._rules[layer]
            s = self.session_class(r, layer, tau=self.tau, **kw)
            self.sessions[layer] = s
        return s

    def _exact_entries(self, layer: int, q: np.ndarray) -> np.ndarray:
        """Entries the exact query selects (its clusters and the window), for
        the §7 prefetch hit rate."""
        r = self.retriever
        li = r.index(layer)
        sel = r.select(layer, q)
        return union_ints(li.members[li.cluster_copies(sel)], r.window(layer))

    def _decode(self, layer: int, module, query, key, value, scaling, mask=None):
        torch = _torch()
        st = self.store
        sess = self._session(layer)
        r = self.retriever
        T = int(query.shape[2])
        first = self.layers[layer].seen - T        # position of the first new token
        outs = []
        for t in range(T):
            q = query[0, :, t, :].detach().float().cpu().numpy().copy()   # [H_q, d]
            k_new = _to_numpy(key[0, :, t, :], st.dtype)              # [H_kv, d]
            v_new = _to_numpy(value[0, :, t, :], st.dtype)
            fut = self._futures.pop(layer, None)
            prefetched, hit, wait_us, measure_us = False, float("nan"), 0.0, 0.0
            ret = None
            if fut is not None:
                tw = time.perf_counter()
                pre = fut.result()
                tm = time.perf_counter()
                if T == 1:
                    exact = self._exact_entries(layer, q)
                    hit = float(np.isin(exact, pre.positions).mean()) if exact.size else 1.0
                    prefetched, ret = True, pre
                wait_us = (tm - tw) * 1e6
                measure_us = (time.perf_counter() - tm) * 1e6
            t0 = time.perf_counter()
            res = sess.step(q, k_new, v_new, retrieval=ret, include_new=True)
            t1 = time.perf_counter()
            if self.prefetch_mode == "previous" and T == 1:
                # §7: start layer L+1's retrieval now, with its previous query
                self._prev_q[layer] = q
                nxt = (layer + 1) % len(self.layers)
                if nxt in self._prev_q and nxt not in self._futures:
                    self._futures[nxt] = r.prefetch(nxt, self._prev_q[nxt], torch=False)
            kk = to_torch(res.k, st.dtype)[None]       # retrieved, pending, this token
            vv = to_torch(res.v, st.dtype)[None]
            m = None
            if mask is not None:      # e.g. padding in the prompt: the mask's columns
                cols = torch.from_numpy(np.append(res.positions[:-1], first + t))
                m = mask[:, :, t:t + 1, :].index_select(-1, cols.to(mask.device))
                if m.dtype == torch.bool and bool(m.all()):
                    m = None
            out, _ = _sdpa(module, query[:, :, t:t + 1, :], kk, vv, m, scaling=scaling,
                           is_causal=False)
            outs.append(out)
            t2 = time.perf_counter()
            rs = res.retrieval.stats
            step = self._steps.get(layer, 0)
            self._steps[layer] = step + 1
            retrieval_us = 0.0 if prefetched else rs.total_us
            self.stats.append(StepStats(
                step=step, layer=layer, clusters=rs.clusters_selected,
                hot=rs.hot_clusters_selected, entries=rs.entries,
                entries_ssd=rs.entries_ssd, pending=int(res.positions.shape[0] - rs.entries - 1),
                bytes_read=rs.bytes_read, requests=rs.requests, score_us=rs.score_us,
                select_us=rs.select_us, plan_us=rs.plan_us, io_us=rs.io_us,
                assemble_us=rs.assemble_us,
                session_us=max((t1 - t0) * 1e6 - retrieval_us, 0.0),
                attend_us=(t2 - t1) * 1e6, wait_us=wait_us, measure_us=measure_us,
                prefetched=prefetched, prefetch_hit=hit,
                cache_hit_rate=sess.hit_rate))
            if self.record:
                self.records.setdefault(layer, []).append(
                    (q, res.retrieval.positions.copy(), float(scaling)))
        return torch.cat(outs, dim=1), None

    # -- reporting and lifetime ---------------------------------------------------
    def step_table(self) -> list[dict]:
        """Per decode step, the sums (bytes, entries, µs) and means (hit
        rates) over layers: a list of dicts, one per step."""
        by: dict[int, list[StepStats]] = {}
        for s in self.stats:
            by.setdefault(s.step, []).append(s)
        rows = []
        for step in sorted(by):
            ss = by[step]
            row = {"step": step}
            for f in ("clusters", "hot", "entries", "entries_ssd", "pending", "bytes_read",
                      "requests", "score_us", "select_us", "plan_us", "io_us", "assemble_us",
                      "session_us", "attend_us", "wait_us", "measure_us"):
                row[f] = sum(getattr(s, f) for s in ss)
            row["pending"] = ss[0].pending
            row["cache_hit_rate"] = float(np.mean([s.cache_hit_rate for s in ss]))
            hits = [s.prefetch_hit for s in ss if s.prefetched]
            row["prefetch_hit"] = float(np.mean(hits)) if hits else None
            rows.append(row)
        return rows

    def summary(self) -> dict:
        """Medians over decode steps of :meth:`step_table`, the §6.2 cache
        hit rate, the §7 prefetch hit rate and the DRAM bytes held."""
        rows = self.step_table()
        out = {"steps": len(rows), "prefix_tokens": self.prefix_length, "ratio": self.ratio,
               "prefetch": self.prefetch_mode}
        if rows:
            for f in ("clusters", "entries", "entries_ssd", "bytes_read", "requests",
                      "score_us", "select_us", "plan_us", "io_us", "assemble_us",
                      "session_us", "attend_us", "wait_us", "measure_us"):
                out[f] = float(np.median([r[f] for r in rows]))
            sess = list(self.sessions.values())
            lookups = sum(s.lookups for s in sess)
            out["cache_hit_rate"] = sum(s.hits for s in sess) / lookups if lookups else 0.0
            ph = [s.prefetch_hit for s in self.stats if s.prefetched]
            out["prefetch_hit"] = float(np.mean(ph)) if ph else None
        out["dram_bytes"] = self.dram_bytes()
        return out

    def dram_bytes(self) -> int:
        """Bytes of the prefix held in DRAM: medoid indexes, local windows, hot
        clusters (the Retriever's partition) and pending new entries."""
        if self.retriever is None:
            return 0
        pend = sum(s.pending for s in self.sessions.values()) * self.store.entry_bytes
        return int(self.retriever.dram_bytes() + pend)

    def close(self) -> None:
        """Write pending new tokens (``append=True``), stop the prefetch
        thread and close the store.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            for f in self._futures.values():
                f.cancel()
                if not f.cancelled():
                    try:
                        f.result()
                    except Exception:                       # noqa: BLE001 - only draining
                        pass
            self._futures.clear()
            if self.append:
                for s in self.sessions.values():
                    s.flush()
        finally:
            if self.retriever is not None:
                self.retriever.close()
            if self.store is not None:
                self.store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return (f"SwarmCache(store={self.path!r}, ratio={self.ratio}, "
                f"layers={len(self.layers)}, seen={self.get_seq_length()})")


register()
