"""Qwen3-32B-sized entries: how a traced model's heads become 4 KiB store
entries (see the package docstring, "Stretching to Qwen3-32B entries")."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Widening:
    """How a traced model's attention heads become Qwen3-32B-sized store entries.

    Model KV head h is store KV head h (its ``head_dim`` values first, zeros
    after); model query head j, of GQA group j // g (g = query_heads /
    kv_heads), is store query head G (j // g) + j mod g (G = store_query_heads
    / store_kv_heads), so it meets its own KV head's keys; every other store
    head is zeros.  Queries are multiplied by scaling / store_head_dim**-0.5,
    so every logit at the store's softmax scale equals the model's.

    Attributes:
        kv_heads, query_heads, head_dim: the model's attention shape.
        store_kv_heads, store_query_heads, store_head_dim: the store's.

    Raises:
        ShapeError: the model's heads do not fit into the store's.
    """
    kv_heads: int
    query_heads: int
    head_dim: int
    store_kv_heads: int
    store_query_heads: int
    store_head_dim: int

    def __post_init__(self):
        from swarmfs._errors import ShapeError
        if (self.query_heads % self.kv_heads or self.store_query_heads % self.store_kv_heads
                or self.kv_heads > self.store_kv_heads or self.head_dim > self.store_head_dim
                or self.query_heads // self.kv_heads >
                self.store_query_heads // self.store_kv_heads):
            raise ShapeError(f"{self}: the model's heads do not fit into the store's")

    @property
    def entry_bytes(self) -> int:
        """Bytes of one stored entry (K and V, fp16)."""
        return 2 * self.store_kv_heads * self.store_head_dim * 2

    def query_slots(self) -> np.ndarray:
        """int64 [query_heads]: the store query head of each model query head."""
        j = np.arange(self.query_heads, dtype=np.int64)
        g = self.query_heads // self.kv_heads
        return (self.store_query_heads // self.store_kv_heads) * (j // g) + j % g


#: all-MiniLM-L6-v2 (12 heads x 32, no GQA) as 16 store heads x 64, one query
#: head each: every MiniLM head is its own store head (the medoid score is a
#: per-head softmax), 4 KiB per entry
MINILM_WIDENING = Widening(12, 12, 32, 16, 16, 64)
#: swarm-llama (8 query heads over 2 KV heads x 64) as Qwen3-32B: 64 query
#: heads over 8 KV heads x 128 (GQA group 8), 4 KiB per entry
DECODER_WIDENING = Widening(2, 8, 64, 8, 64, 128)


def _check_model_shape(x, heads: int, dim: int, what: str, wide: Widening):
    from swarmfs._errors import ShapeError
    if x.ndim < 2 or x.shape[-2:] != (heads, dim):
        raise ShapeError(f"{what} {x.shape} is not [..., {heads}, {dim}] ({wide})")


def widen_flat(x: np.ndarray, wide: Widening, dtype=np.float16) -> np.ndarray:
    """Index vectors [..., kv_heads x head_dim] (head-major, as
    ``layout._baselines.flat_keys``) -> [..., store_kv_heads x store_head_dim]:
    model head h in slots [D h, D h + d) (D the store's head_dim), zeros
    elsewhere."""
    x = np.asarray(x)
    lead = x.shape[:-1]
    out = np.zeros(lead + (wide.store_kv_heads, wide.store_head_dim), dtype)
    y = x.reshape(lead + (-1, x.shape[-1] // wide.kv_heads if x.shape[-1] else 0))
    _check_model_shape(y, wide.kv_heads, wide.head_dim, "index vectors", wide)
    out[..., :wide.kv_heads, :wide.head_dim] = y
    return out.reshape(lead + (wide.store_kv_heads * wide.store_head_dim,))


def widen_kv(k: np.ndarray, v: np.ndarray, wide: Widening, *, path=None) -> np.ndarray:
    """K, V [kv_heads, S, head_dim] -> store entries [S, 2, store_kv_heads,
    store_head_dim] fp16: model KV head h is store head h (first head_dim
    values), the rest are zeros.

    With ``path`` the array is a file-backed memmap (large contexts: 4 GiB at
    1M tokens), else in memory.
    """
    H, S, d = k.shape
    _check_model_shape(np.empty((H, d)), wide.kv_heads, wide.head_dim, "keys", wide)
    shape = (S, 2, wide.store_kv_heads, wide.store_head_dim)
    if path is None:
        out = np.zeros(shape, np.float16)
    else:
        out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float16, shape=shape)
    step = 1 << 16
    for a in range(0, S, step):
        b = min(a + step, S)
        out[a:b, 0, :H, :d] = k[:, a:b].transpose(1, 0, 2)
        out[a:b, 1, :H, :d] = v[:, a:b].transpose(1, 0, 2)
    return out


def widen_q(q: np.ndarray, scaling: float, wide: Widening) -> np.ndarray:
    """Model query [query_heads, head_dim] (or a batch [B, ...]) -> float32
    [.., store_query_heads, store_head_dim]: query head j in store head
    ``wide.query_slots()[j]``, times scaling / store_head_dim**-0.5 (the
    store's per-head softmax scale is head_dim**-0.5, so the medoid "prob"
    score sees the model's scaled logits; dot-product rankings do not change
    with the factor)."""
    q = np.asarray(q, np.float32)
    _check_model_shape(q, wide.query_heads, wide.head_dim, "queries", wide)
    lead = q.shape[:-2]
    out = np.zeros(lead + (wide.store_query_heads, wide.store_head_dim), np.float32)
    out[..., wide.query_slots(), :wide.head_dim] = \
        q * np.float32(scaling / wide.store_head_dim ** -0.5)
    return out


def narrow(x, wide: Widening) -> np.ndarray:
    """Retrieved K or V [store_kv_heads, n, store_head_dim] -> the model's
    [kv_heads, n, head_dim]."""
    return np.asarray(x)[:wide.kv_heads, :, :wide.head_dim]
