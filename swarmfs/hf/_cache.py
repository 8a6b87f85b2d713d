"""The transformers Cache of :mod:`swarmfs.hf` (its docstring tells the whole
story; SWARM §5-§7): :class:`SwarmCache`, its rows (``_batch``) and its
layers."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Any

import numpy as np
from transformers.cache_utils import Cache, CacheLayerMixin

from .. import _defaults as defaults
from .. import _errors as errors
from .. import _validate as V
from ..decode._online import DecodeSession
from ..decode._retrieve import Retriever
from ..decode._window import stored_window
from ..layout._layer import LayoutParams, lay_out_layer
from ..store._store import Store
from . import _batch
from ._attention import forward_ids, prefix_fingerprint, register
from ._decode import DecodeMixin, StepStats

__all__ = ["METHODS", "SwarmCache", "SwarmLayer", "StepStats"]   # StepStats: from _decode

_TORCH_DTYPES = _batch.KV_DTYPES

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


@V.checked_methods
class SwarmLayer(CacheLayerMixin):
    """One layer of a :class:`SwarmCache` (it holds no KV tensors: they are
    in the stores, the Retrievers' DRAM partitions and the DecodeSessions)."""

    is_sliding = False
    is_compileable = False
    #: new tokens still in DRAM can be removed (assisted decoding's drafts)
    is_croppable = True

    def __init__(self, cache: SwarmCache, layer: int, seen: int = 0):
        super().__init__()
        self.cache, self.layer_idx, self.seen = cache, layer, int(seen)
        self.in_flight = False       # updated, not yet attended (misuse detection)

    def lazy_initialization(self, key_states, value_states) -> None:
        """transformers' Cache API: note the device on first update."""
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        """transformers' Cache API: take this step's K/V [B, H_kv, T, d] (B
        rows, one request each) and return what attention reads (the
        SwarmCache lays out at prefill, retrieves at decode)."""
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
        """transformers' Cache API: columns seen by this layer (a batch's
        left padding included)."""
        return self.seen

    def get_max_length(self) -> int:
        """transformers' Cache API: -1, no maximum length."""
        return -1

    def reset(self) -> None:
        """Not supported: raises ConfigError (the prefix is on the disks)."""
        raise errors.ConfigError("a SwarmCache cannot be reset; make a new one (or from_store)",
                                 layer=self.layer_idx)

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' Cache API: remove this layer's ``-tokens_to_remove``
        newest tokens (see :meth:`SwarmCache.crop`)."""
        self.cache._crop([self], tokens_to_remove)

    def reorder_cache(self, beam_idx) -> None:
        """Not supported (beam search): raises ConfigError (see
        :meth:`SwarmCache.reorder_cache`)."""
        self.cache.reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Rows are fixed when the cache is made: ConfigError unless ``repeats`` is 1."""
        if repeats != 1:
            raise errors.ConfigError("a SwarmCache's rows are fixed when it is made (one store "
                                     "per row); it cannot repeat them", layer=self.layer_idx)

    def batch_select_indices(self, indices) -> None:
        """Not supported (rows are fixed): raises ConfigError."""
        raise errors.ConfigError("a SwarmCache's rows are fixed when it is made (one store per "
                                 "row); it cannot select among them", layer=self.layer_idx)


@V.checked_methods
class SwarmCache(DecodeMixin, Cache):
    """A transformers ``Cache`` whose prefix KV lives on swarmfs stores.

    Each row of the model's input is its own request with its own store
    (``SwarmCache([path, ...])``) or stored document
    (``SwarmCache.from_store([path, ...])``; rows may share a document,
    read-only).  Rows of different lengths are padded on the left (the
    tokenizer's ``padding_side="left"`` with an ``attention_mask``): padding
    is neither profiled, clustered, stored nor counted in a budget, and each
    row decodes as it would alone.

    Args:
        store: a store directory (created at prefill; see ``force``), a
            :class:`Store` opened writable and empty, or a list of
            directories, one per row (distinct).
        config: the model's config (``num_hidden_layers``,
            ``num_key_value_heads``, ``head_dim``, ``num_attention_heads``);
            required for a new store, checked against a stored one.
        ratio: sparsity ratio r for profiling and retrieval (entry budget
            ceil(r x S) of the S stored tokens, local window included, as S
            grows; §8.1 uses 0.10).  r = 1 attends to the whole context
            (exactly dense attention).
        disks: N file disks or a list of disk paths (as ``Store.create``;
            each row's store gets its own).
        layout: :class:`swarmfs.layout.LayoutParams` (tau, local window W,
            hot fraction, eq. 6 costs, representative); its ratio is
            replaced by ``ratio``, and a tau, max_cluster_size or
            representative of None by ``defaults.DECODER_TAU``,
            ``DECODER_MAX_CLUSTER_SIZE`` and ``DECODER_REPRESENTATIVE``.  W is the
            DRAM window (the last min(W, S) stored tokens, §5.2) and the
            steps a new token stays in DRAM before it joins clusters (§6.2);
            a query uses the last min(W, S, ceil(rS) // 4) stored tokens, S
            the current stored length.
        prefetch: ``"none"`` or ``"previous"`` (§7, see the module
            docstring; one row only).
        upkeep: ``"inline"`` (default): each layer's session upkeep (eq. 9
            counts, §6.2 replacement, pending entries, flushes) runs inside
            its decode step.  ``"background"``: it runs on a worker thread
            after the layer's attention, overlapping the next layers'
            compute, and the layer's next step waits for it
            (``DecodeSession(defer_upkeep=True)``; the same tokens and
            store; issue 26).  Needs ``prefetch="none"``.
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
        record: keep each step's query, selected and attended positions
            per row and layer (``records``, :meth:`records_of`) for recall
            against the oracle; costs RAM.
        force: replace an existing store at ``store``.
        engine: I/O engine name (``"io_uring"``, ``"threads"``, auto).
        sinks: attention sinks: the first ``sinks`` tokens of each document
            stay in DRAM and are attended at every step, beside the budget
            (StreamingLLM); 0 turns them off.  The default,
            ``defaults.ATTENTION_SINKS``, is measured on the shipped decoder
            (docs/hf.md).
        eos_token_id: token id(s) that end a row: a row fed one at a decode
            step has finished (``generate`` keeps feeding a finished row
            padding); that token and all later ones of the row are neither
            attended, kept nor written.  Default: the config's
            ``eos_token_id`` when the cache serves several rows (a single
            row is never fed its end-of-text by ``generate``); ``False``:
            never.  Needs :func:`swarmfs.hf.enable`'s hook (the fed ids).
        progress: ``progress(stage, done, total)`` called during a prefill,
            stage ``"prefill"`` (a layer's dense attention, per layer),
            ``"layout"`` and ``"write"`` (per layer and row).

    Raises:
        InvalidRatioError: ratio or tau outside (0, 1].
        InvalidChoiceError: an unknown prefetch or method.
        InvalidFractionError: hot_budget outside [0, 1].
        InvalidBoolError: append, record or force not True or False.
        InvalidIntegerError: sinks negative or not an integer.
        InvalidCallError: an unknown keyword argument.
        InvalidArgumentError: other bad arguments (eos_token_id, progress,
        the store list).
        ConfigError: no config for a new store, or an unsupported model
        (sliding windows smaller than the context).  StoreExistsError:
        ``store`` holds a store and ``force`` is False.
    """

    #: the DecodeSession class each layer uses (a benchmark may substitute a
    #: subclass with another cache-replacement policy)
    session_class = DecodeSession

    def __init__(self, store, config=None, *, ratio: float = defaults.RATIO, disks=4,
                 layout: LayoutParams | None = None, prefetch: str = "none",
                 append: bool = True, tau: float = defaults.ONLINE_TAU, record: bool = False,
                 method: str = "swarm", hot_budget: float | None = None, force: bool = False,
                 engine: str | None = None, sinks: int = defaults.ATTENTION_SINKS,
                 eos_token_id=None, progress=None, upkeep: str = "inline",
                 _opened: list | None = None):
        register()
        V.parse_choice(method, "method", METHODS)
        if method != "swarm" and _opened is not None:
            raise errors.InvalidArgumentError("from_store serves swarm layouts only (the "
                                              "baselines' indexes are not stored)")
        self.method = method
        if hot_budget is not None:
            V.parse_fraction(hot_budget, "hot_budget")
        self.hot_budget = hot_budget
        V.parse_ratio(ratio, "ratio")
        # the DecodeSessions' rule, checked now: they start only at the first
        # decode step, after the prefill has written the store
        V.parse_ratio(tau, "tau")
        V.parse_choice(prefetch, "prefetch", ("none", "previous"))
        V.parse_choice(upkeep, "upkeep", ("inline", "background"))
        if upkeep == "background" and prefetch != "none":
            raise errors.InvalidArgumentError(
                "upkeep='background' needs prefetch='none': a retrieval made ahead must "
                "see the layer after its last upkeep", argument="upkeep")
        for name, v in (("append", append), ("record", record), ("force", force)):
            V.parse_bool(v, name)
        if layout is not None:
            V.parse_instance(layout, "layout", LayoutParams)
        sinks = V.parse_nonneg_int(sinks, "sinks")
        if progress is not None:
            V.parse_callable(progress, "progress")
        self.ratio = float(ratio)
        layout = layout or LayoutParams()
        self.params = dataclasses.replace(
            layout, ratio=self.ratio,
            tau=defaults.DECODER_TAU if layout.tau is None else layout.tau,
            max_cluster_size=defaults.DECODER_MAX_CLUSTER_SIZE
            if layout.max_cluster_size is None else layout.max_cluster_size,
            representative=defaults.DECODER_REPRESENTATIVE
            if layout.representative is None else layout.representative)
        self.prefetch_mode, self.upkeep_mode = prefetch, upkeep
        self.append, self.tau, self.record = bool(append), float(tau), bool(record)
        self.sinks, self.progress = int(sinks), progress
        self._disks, self._force, self._engine = disks, force, engine
        self.config = config.get_text_config(decoder=True) if config is not None and \
            hasattr(config, "get_text_config") else config
        self._docs: list[_batch.Doc] = []
        self._rows: list[_batch.Row] = []
        self._kv_dtype: str | None = None
        seen = 0
        if _opened is not None:
            seen, num_layers = self._open_rows(_opened)
        else:
            num_layers = self._new_rows(store)
        if prefetch == "previous" and len(self._rows) > 1:
            raise errors.InvalidArgumentError("prefetch='previous' serves one row; a batch "
                                              "retrieves each layer with its exact queries",
                                              store=self.path)
        self._eos = self._eos_ids(eos_token_id)
        super().__init__(layers=[SwarmLayer(self, i, seen) for i in range(num_layers)])
        self.stats: list[StepStats] = []
        self._futures: dict = {}
        self._upkeeps: dict = {}             # (row, layer) -> Future of a session's upkeep
        self._upkeep_pool = None
        self._prev_q: dict[int, np.ndarray] = {}
        self._alive: np.ndarray | None = None      # rows x tokens of the running forward
        self._pads_checked = _opened is None
        self._prompt_tokens: int | None = None     # assisted decoding: the prompt's length
        self._drafts: dict[int, tuple] = {}           # ... and its first drafts' Q, K, V
        self._done = {"prefill": 0, "layout": 0, "write": 0}
        self._closed = False

    # -- rows -----------------------------------------------------------------
    def _new_rows(self, store) -> int:
        """One new store per row: paths checked, nothing created yet."""
        many = isinstance(store, (list, tuple))
        items = list(store) if many else [store]
        if not items:
            raise errors.InvalidArgumentError("store: an empty list (give one path per row)")
        seen_paths = set()
        for i, item in enumerate(items):
            if isinstance(item, Store) and not many:
                if item.layers:
                    raise errors.StoreExistsError("the Store given to SwarmCache already holds "
                                                  "layers; use SwarmCache.from_store",
                                                  store=item.path)
                if not item.writable:
                    raise errors.InvalidArgumentError("the Store must be open writable",
                                                      store=item.path)
                doc = _batch.Doc(item.path, item)
                self._kv_dtype = item.dtype
            elif isinstance(item, (str, os.PathLike)):
                path = os.path.abspath(os.fspath(item))
                if self.config is None:
                    raise errors.ConfigError("SwarmCache needs the model config for a new store "
                                             "(SwarmCache(path, model.config)); reopen a stored "
                                             "prefix with SwarmCache.from_store(path)",
                                             store=path)
                if not self._force and os.path.exists(os.path.join(path, "manifest.json")):
                    raise errors.StoreExistsError("a store already exists here (reopen it with "
                                                  "SwarmCache.from_store; to replace it: "
                                                  "force=True, or --force on the command line)",
                                                  store=path)
                if path in seen_paths:
                    raise errors.InvalidArgumentError(f"row {i}: the store {path} is given twice; "
                                                      "each row of a new prefill lays out its "
                                                      "own prompt in its own store", store=path)
                seen_paths.add(path)
                doc = _batch.Doc(path)
            else:
                raise errors.InvalidArgumentError(f"store must be a path, a Store or a list of "
                                                  f"paths (one per row), got {item!r}")
            row = _batch.Row(i, doc)
            doc.rows.append(row)
            self._docs.append(doc)
            self._rows.append(row)
        if self.config is None:
            raise errors.ConfigError("SwarmCache needs the model config for a new store")
        if self._docs[0].store is not None:
            self._check_config_against_store(self._docs[0].store)
        return int(self.config.num_hidden_layers)

    def _open_rows(self, opened: list) -> tuple[int, int]:
        """Rows over opened stores (a store given for several rows is one
        document they share): (columns before the first new token, layers)."""
        by: dict[int, _batch.Doc] = {}
        for i, st in enumerate(opened):
            doc = by.get(id(st))
            if doc is None:
                doc = by[id(st)] = _batch.Doc(st.path, st)
                doc.prefix_length = self._stored_length(st)
                self._docs.append(doc)
            row = _batch.Row(i, doc)
            doc.rows.append(row)
            self._rows.append(row)
        shapes = {(d.store.num_layers, d.store.num_kv_heads, d.store.head_dim, d.store.dtype)
                  for d in self._docs}
        if len(shapes) > 1:
            raise errors.ShapeError(f"the stores differ in layers, KV heads, head_dim or dtype "
                                    f"({sorted(shapes)}); one model serves them all",
                                    store=self.path)
        if self.config is not None:
            for d in self._docs:
                self._check_config_against_store(d.store)
        self._kv_dtype = self._docs[0].store.dtype
        seen = max(d.prefix_length for d in self._docs)
        for r in self._rows:            # shorter documents end where the longest does
            r.pad = seen - r.doc.prefix_length
        return seen, self._docs[0].store.num_layers

    def _eos_ids(self, eos) -> np.ndarray:
        if eos is False:
            return np.empty(0, np.int64)
        if eos is None:
            eos = getattr(self.config, "eos_token_id", None) if len(self._rows) > 1 else None
            if eos is None:
                return np.empty(0, np.int64)
        ids = np.atleast_1d(np.asarray(eos, dtype=object))
        if ids.ndim != 1 or not all(isinstance(x, (int, np.integer)) and not isinstance(
                x, bool) for x in ids):
            raise errors.InvalidArgumentError(f"eos_token_id must be a token id, a list of them "
                                              f"or False, got {eos!r}")
        return ids.astype(np.int64)

    @property
    def num_rows(self) -> int:
        """Rows (requests) this cache serves: the batch size of its forwards."""
        return len(self._rows)

    @property
    def stores(self) -> list:
        """Per row, its :class:`Store` (None before the prefill; rows that share
        a document share it)."""
        return [r.doc.store for r in self._rows]

    @property
    def store(self):
        """Row 0's :class:`Store` (None before the prefill)."""
        return self._rows[0].doc.store

    @property
    def path(self):
        """Row 0's store directory."""
        return self._rows[0].doc.path

    @property
    def retriever(self):
        """Row 0's :class:`Retriever` (None before the first decode step)."""
        return self._rows[0].doc.retriever

    @property
    def sessions(self) -> dict:
        """Row 0's DecodeSessions, by layer."""
        return self._rows[0].sessions

    @property
    def records(self) -> dict:
        """Row 0's records (``record=True``): layer -> [(query float32
        [H_q, d], the positions its retrieval selected int64 (the budget's
        entries), scale, every position it attended int64 (those, the
        attention sinks, the new tokens in DRAM and itself))]."""
        return self._rows[0].records

    def records_of(self, row: int) -> dict:
        """A row's records (as :attr:`records`).

        Raises:
            InvalidArgumentError: no such row."""
        return self._row(row).records

    @property
    def layout_report(self) -> dict:
        """Row 0's prefill layout per layer (clusters, sizes, seconds)."""
        return self._rows[0].doc.layout_report

    @property
    def layout_reports(self) -> list:
        """Per row, its prefill layout per layer (empty for a stored document)."""
        return [r.doc.layout_report for r in self._rows]

    @property
    def prefix_length(self) -> int:
        """Row 0's stored tokens when decoding started."""
        return self._rows[0].doc.prefix_length

    def _row(self, row):
        if isinstance(row, bool) or not isinstance(row, (int, np.integer)) or \
                not 0 <= row < len(self._rows):
            raise errors.InvalidArgumentError(f"row must be in [0, {len(self._rows)}), got "
                                              f"{row!r}", store=self.path)
        return self._rows[int(row)]

    # -- construction from a stored prefix ------------------------------------
    @classmethod
    def from_store(cls, path, config=None, *, ratio: float = defaults.RATIO, append: bool = False,
                   verify: bool = True, engine: str | None = None, input_ids=None,
                   attention_mask=None, **kw) -> SwarmCache:
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

        A batch: ``path`` is a list, one store per row; a path given for
        several rows opens one store they share, read-only (one retrieval
        per layer serves them).  The columns of every row's stored document
        must end at the same place, the longest's: a row of a shorter
        document is padded on the left by the difference (with an
        ``attention_mask``).

        Args:
            path: the store directory a SwarmCache prefilled, or a list of them.
            config: the model config (checked against the store's shape).
            ratio: sparsity ratio r of this request.
            append: append this request's tokens to the store (default False:
                the stored document stays as it is for other requests; a
                store shared by several rows is never appended to).
            verify: verify checksums on reads.
            input_ids: the request(s), int [rows, tokens] or [tokens].
            attention_mask: their mask [rows, tokens] (left padding), if padded.

        Raises:
            StoreNotFoundError, ManifestError, DiskError: as ``Store.open``.
            ShapeError: the store's shape or dtype differs from the config's,
            or its layers hold different numbers of tokens; ``input_ids``
            that do not start with the stored prompt, have no token after
            it, hold another number of sequences than rows, are not padded
            to end each document at the longest's, or meet a store whose
            prefill recorded no fingerprint.
            InvalidArgumentError: ``append`` with a store shared by rows.
        """
        many = isinstance(path, (list, tuple))
        paths = list(path) if many else [path]
        if not paths:
            raise errors.InvalidArgumentError("path: an empty list (give one store per row)")
        opened: dict[str, Store] = {}
        try:
            for p in paths:
                if not isinstance(p, (str, os.PathLike)):
                    raise errors.InvalidArgumentError(f"path must be a store directory or a list "
                                                      f"of them, got {p!r}")
                ap = os.path.abspath(os.fspath(p))
                if ap not in opened:
                    opened[ap] = Store.open(ap, writable=bool(append), verify=verify,
                                            engine=engine)
            if append and len(opened) < len(paths):
                raise errors.InvalidArgumentError("append=True needs one store per row: rows "
                                                  "sharing a stored document read it only",
                                                  store=next(iter(opened)))
            rows = [opened[os.path.abspath(os.fspath(p))] for p in paths]
            cache = cls(path, config, ratio=ratio, append=append, engine=engine,
                        _opened=rows, **kw)
            if input_ids is not None:
                cache._check_request(input_ids, attention_mask)
            return cache
        except BaseException:
            for st in opened.values():
                st.close()
            raise

    def _check_request(self, input_ids, attention_mask=None) -> None:
        """Refuse request ids that do not continue the stored prompts
        (:func:`swarmfs.hf._batch.check_request`)."""
        _batch.check_request(self, input_ids, attention_mask)

    def _stored_length(self, st: Store) -> int:
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

    def _check_config_against_store(self, st: Store) -> None:
        L, Hkv, d, Hq = self._model_shape()
        stored_q = st.model.num_query_heads
        diffs = [f"{what}: store {a}, model {b}" for what, a, b in (
            ("layers", st.num_layers, L), ("KV heads", st.num_kv_heads, Hkv),
            ("head_dim", st.head_dim, d), ("query heads", stored_q, Hq)) if a != b]
        if diffs:
            raise errors.ShapeError("the store's entry shape differs from the model's (" +
                                    "; ".join(diffs) + ")", store=st.path)

    # -- generate(): what it will run, before any token is fed ---------------------
    def _begin_generate(self, model, args, kwargs) -> None:
        """Called by the ``generate`` that :func:`swarmfs.hf.enable` wraps,
        before any token is fed (:func:`swarmfs.hf._batch.begin_generate`)."""
        if self._closed:
            raise errors.SwarmError("the SwarmCache is closed", store=self.path)
        _batch.begin_generate(self, model, args, kwargs)

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' Cache API (assisted decoding): remove the newest
        ``-tokens_to_remove`` tokens of every layer.  They must still be in
        DRAM (pending, never written): the tokens of a multi-token forward
        stay there until the next forward, so an assisted decoder's rejected
        drafts always are.  Checked on every layer before any changes.

        Raises:
            ConfigError: a positive count, several rows, or tokens already
                laid out on the disks.
        """
        self._crop(self.layers, tokens_to_remove)

    def reorder_cache(self, beam_idx) -> None:
        """Not supported (beam search): raises ConfigError.  Beams would share
        one stored prompt but each need their own new tokens in DRAM, copied
        and reordered at every step, and only the end tells which beam's
        tokens belong in the store; ``generate`` with a SwarmCache refuses
        beam search before any token is fed (:func:`swarmfs.hf.enable`)."""
        raise errors.ConfigError("a SwarmCache does not serve beam search (its rows' new "
                                 "tokens cannot be reordered)", store=self.path)

    def _crop(self, layers, tokens_to_remove) -> None:
        _batch.crop(self, layers, tokens_to_remove)

    # -- per-layer update -----------------------------------------------------
    def _check_kv(self, layer: int, k, v) -> None:
        if k.ndim != 4 or k.shape != v.shape:
            raise errors.ShapeError(f"key/value shapes {tuple(k.shape)} / {tuple(v.shape)} are "
                                    "not [B, H_kv, T, d]", layer=layer, store=self.path)
        if k.shape[0] != len(self._rows):
            n = len(self._rows)
            raise errors.ShapeError(f"the batch has {k.shape[0]} rows; this SwarmCache serves "
                                    f"{n} (one store per row: batch size {n}; give a list of "
                                    "paths, one per row, for a batch)",
                                    layer=layer, store=self.path)
        st = self._docs[0].store
        if st is None:
            return
        diffs = []
        if k.shape[1] != st.num_kv_heads:
            diffs.append(f"KV heads: store {st.num_kv_heads}, model {k.shape[1]}")
        if k.shape[3] != st.head_dim:
            diffs.append(f"head_dim: store {st.head_dim}, model {k.shape[3]}")
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
        k, v, name = _batch.cast_kv(k, v, self._kv_dtype, layer=layer, store=self.path)
        self._kv_dtype = name
        T = int(k.shape[2])
        self._check_window(layer, lay.seen + T)
        mode = "decode" if lay.seen > 0 else "prefill"
        if lay.in_flight or (mode == "decode" and any(
                d.store is None or layer not in d.store.layers for d in self._docs)):
            raise errors.ConfigError(
                "the previous call of this layer did not attend through swarmfs: load the "
                "model with attn_implementation='swarm' (after import swarmfs.hf) or call "
                "swarmfs.hf.enable(model); a SwarmCache also serves one thread at a time",
                layer=layer, store=self.path)
        if mode == "decode" and layer == 0:
            self._begin_forward(T)
        lay.seen += T
        lay.in_flight = True
        k._swarm = (self, layer, mode)
        return k, v

    def _begin_forward(self, T: int) -> None:
        """Which rows take each of this forward's tokens (bool [B, T]): a row
        fed an end-of-text token has finished, then and in every later
        forward."""
        alive = np.ones((len(self._rows), T), bool)
        alive[[r.finished for r in self._rows]] = False
        ids = forward_ids()
        if self._eos.size and ids is not None and tuple(ids.shape) == alive.shape:
            hit = np.isin(ids.detach().cpu().numpy(), self._eos)
            alive &= np.cumsum(hit, axis=1) == 0
            for r in self._rows:
                r.finished = r.finished or bool(hit[r.row].any())
        self._alive = alive

    def _progress(self, stage: str) -> None:
        self._done[stage] += 1
        if self.progress is not None:
            n = len(self.layers) * (1 if stage == "prefill" else len(self._rows))
            self.progress(stage, self._done[stage], n)

    # -- prefill: layout and write ---------------------------------------------
    def _create_store(self, doc: _batch.Doc, k) -> None:
        L, Hkv, d, Hq = self._model_shape()
        if k.shape[0] != Hkv or k.shape[2] != d:
            raise errors.ShapeError(f"key shape {tuple(k.shape)} does not match the config "
                                    f"(H_kv {Hkv}, head_dim {d})", layer=0, store=doc.path)
        doc.store = Store.create(doc.path, disks=self._disks, num_layers=L,
                                 num_kv_heads=Hkv, head_dim=d, dtype=_dtype_name(k),
                                 num_query_heads=Hq, force=self._force, engine=self._engine,
                                 model_name=getattr(self.config, "_name_or_path", None) or
                                 getattr(self.config, "model_type", None))

    def _lay_out(self, layer: int, query, key, value, scaling, mask=None) -> None:
        """SWARM §5 for each row: its real tokens only (the left padding is
        cut off first), laid out and written to its store.  Under assisted
        decoding the tokens after the prompt are drafts: they become pending
        decode steps (in DRAM until accepted), never laid out."""
        self._progress("prefill")
        B, S = int(key.shape[0]), int(key.shape[2])
        n = S if self._prompt_tokens is None else min(self._prompt_tokens, S)
        if layer == 0 or any(d.store is None for d in self._docs):
            pads = _batch.left_pads(mask[..., :n, :n] if mask is not None else None, B, n,
                                    store=self.path)         # before any store exists
            for r in self._rows:
                r.pad = int(pads[r.row])
        ids = forward_ids()
        ok = layer == 0 and ids is not None and tuple(ids.shape) == (B, S)
        for r in self._rows:
            p = r.pad
            self._lay_out_row(r.doc, layer, query[r.row, :, p:n], key[r.row, :, p:n],
                              value[r.row, :, p:n], scaling,
                              ids[r.row, p:n].cpu().numpy() if ok else None)
        if n < S:           # drafts: their outputs are SDPA's; kept for the steps below
            self._drafts[layer] = tuple(x[:, :, n:].detach().clone() for x in (query, key, value))
        if layer == len(self.layers) - 1:
            self._prompt_tokens = None
            drafts, self._drafts = self._drafts, {}
            for L, (q, k, v) in sorted(drafts.items()):     # every layer is stored now
                for t in range(q.shape[2]):
                    for doc in self._docs:
                        for _ in self._step_rows(L, doc, doc.rows, q, k, v, t, q.shape[2], None):
                            pass

    def _lay_out_row(self, doc: _batch.Doc, layer: int, query, key, value, scaling,
                     ids) -> None:
        """SWARM §5: profile the row's own queries, Algorithm 1, eq. 6, eq. 7;
        write the layer; keep nothing of it in RAM (but its attention sinks)."""
        torch = _torch()
        t0 = time.perf_counter()
        if doc.store is None:
            self._create_store(doc, key)
        S = int(key.shape[1])
        prefix = {"prefix": prefix_fingerprint(ids)} if ids is not None else {}
        q = query.detach().float().cpu().numpy()           # [H_q, S, d]
        k32 = key.detach().float().cpu().numpy()           # [H_kv, S, d]
        kv = torch.stack([key, value], 0).permute(2, 0, 1, 3).contiguous()
        if self.sinks:
            s = min(self.sinks, S)
            doc.sinks[layer] = (key[:, :s].detach().cpu().contiguous(),
                                value[:, :s].detach().cpu().contiguous())
        W = stored_window(self.params.local_window, self.params.ratio, S)
        if self.method == "swarm":
            cl, hot = lay_out_layer(q, k32, params=self.params, scaling=float(scaling),
                                    layer=layer, entry_bytes=doc.store.entry_bytes)
            del q, k32
            t1 = time.perf_counter()
            self._progress("layout")
            doc.store.write_layer(layer, kv, (cl.ptr, cl.members), cl.medoids, hot=hot,
                                  freq=cl.freq, local_window=W,
                                  representative=self.params.representative,
                                  extra={"layout": {"tau": cl.stats.tau,
                                                    "metric": cl.stats.metric,
                                                    "ratio": self.ratio}, **prefix})
            rep = {"clusters": cl.stats.num_clusters, "mean_size": cl.stats.size_mean,
                   "replication": cl.stats.replication, "hot_clusters": int(hot.sum())}
        else:
            lay = _baseline_layout(self.method, q, k32)
            del q, k32
            t1 = time.perf_counter()
            self._progress("layout")
            doc.store.write_layer(layer, kv, (lay.ptr, lay.members), lay.medoids,
                                  freq=lay.freq, local_window=W,
                                  extra={"layout": {"method": self.method}, **prefix})
            doc.index[layer] = lay.index
            doc.rules[layer] = _baseline_rule(lay)
            rep = {"clusters": lay.num_clusters, "mean_size": float(lay.sizes.mean()),
                   "replication": float(lay.members.shape[0] / S), "hot_clusters": 0}
        del kv
        self._progress("write")
        doc.layout_report[layer] = {**rep, "layout_s": t1 - t0,
                                    "write_s": time.perf_counter() - t1}
        doc.prefix_length = S

    # -- decode ----------------------------------------------------------------
    def _ensure_retriever(self, doc: _batch.Doc) -> Retriever:
        if doc.retriever is None:
            if doc.store is None:
                raise errors.InternalError("decode before prefill", store=doc.path)
            doc.prefix_length = self._stored_length(doc.store)
            doc.retriever = Retriever(doc.store, ratio=self.ratio,
                                      local_window=self._dram_window(doc.prefix_length),
                                      selector=_baseline_selector(self.method, doc.index))
            doc.index.clear()     # the selector holds the indexes now, and grows them
        return doc.retriever

    def _dram_window(self, tokens: int) -> int:
        """The DRAM window (§5.2) for a layer that may hold ``tokens`` stored
        tokens by the next refresh: min(W, S, ceil(rS) // 4) from the layout's
        W, not the prefill's stored value, so that it follows S as it grows
        (a query uses the last window_size(...) of it at the current S)."""
        return stored_window(self.params.local_window, self.ratio, int(tokens))

    def _session(self, row: _batch.Row, layer: int) -> DecodeSession:
        s = row.sessions.get(layer)
        if s is None:
            doc = row.doc
            r = self._ensure_retriever(doc)
            kw: dict[str, Any] = {
                "reuse_outputs": True,             # K/V built in place, no copies per step
                "window": max(1, int(self.params.local_window))}
            if not self.append or doc.shared:
                kw["flush_batch"] = 1 << 62
            if doc.shared and row is not doc.rows[0]:
                kw["adapt_cache"] = False          # one row keeps the shared hot set
            if self.hot_budget is not None:
                kw["hot_budget_bytes"] = int(self.hot_budget * doc.store.num_tokens(layer) *
                                             doc.store.entry_bytes)
            if self.method != "swarm":             # new tokens grow the baseline's index
                kw["baseline"] = doc.rules[layer]
            if self.upkeep_mode == "background":
                kw["defer_upkeep"] = True
            s = self.session_class(r, layer, tau=self.tau, **kw)
            row.sessions[layer] = s
        return s

    # -- reporting and lifetime ---------------------------------------------------
    def close(self) -> None:
        """Write pending new tokens (``append=True``; a finished row's end-of-text
        and padding were never kept), stop the prefetch threads and close
        the stores.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            for f in self._futures.values():
                f.cancel()
                if not f.cancelled():
                    with contextlib.suppress(Exception):     # only draining
                        f.result()
            self._futures.clear()
            upkeeps, self._upkeeps = list(self._upkeeps.values()), {}
            for f in upkeeps:        # an upkeep's error surfaces here, before the flush
                f.result()
            if self._upkeep_pool is not None:
                self._upkeep_pool.shutdown()
            if self.append:
                for r in self._rows:
                    if not r.doc.shared:
                        for s in r.sessions.values():
                            s.flush()
        finally:
            for d in self._docs:
                try:
                    if d.retriever is not None:
                        d.retriever.close()
                finally:
                    if d.store is not None:
                        d.store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return (f"SwarmCache(store={self.path!r}, rows={len(self._rows)}, ratio={self.ratio}, "
                f"layers={len(self.layers)}, seen={self.get_seq_length()})")
