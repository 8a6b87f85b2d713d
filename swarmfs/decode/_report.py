"""Retrieval quality against the oracle, and the demo's report table.

Accuracy follows SWARM §8.1-8.2: for a query, the *oracle* takes the exact
top-k entries (k = ceil(r x S)) by attention; a method's **attention-mass
recall** (:func:`attention_recall`, the one definition: the demo, the
evaluation and ``layout._quality`` use it) is the attention mass of its
distinct retrieved entries (a position counts once, however many copies were
read) divided by the mass of the oracle's top max(k, n) entries, n the
distinct entries retrieved (so recall <= 1 and an overshooting last cluster
earns nothing it did not pay for); the **relative error** is
||o_sparse - o_full|| / ||o_full|| of the attention output over all query heads,
where o_sparse is softmax attention restricted to the retrieved entries.

The attention mass of a token is the softmax probability summed over all query
heads and divided by their number (an entry holds every KV head).
"""

from __future__ import annotations

import numpy as np

from .._errors import ShapeError
from .._validate import parse_number
from ..store._index import unique_ints
from ._window import entry_budget

__all__ = ["attention_logits", "token_mass", "oracle_mass", "attention_recall",
           "evaluate_query", "evaluate_queries", "summarize", "query_token_mass"]


def _f32(x):
    if hasattr(x, "detach"):
        x = x.detach().float().cpu().numpy()
    return np.asarray(x, dtype=np.float32)


def attention_logits(q, k, scaling: float) -> np.ndarray:
    """Scaled logits of queries against keys with GQA head mapping.

    Args:
        q: [H_q, n, d] queries.
        k: [H_kv, S, d] keys.
        scaling: softmax scale (usually d**-0.5).

    Returns:
        float32 [H_q, n, S]; query head h uses KV head h // (H_q / H_kv).
    """
    q, k = _f32(q), _f32(k)
    Hq, H = q.shape[0], k.shape[0]
    g = Hq // H
    # one batched GEMM per KV head (BLAS), its g query heads' rows stacked
    out = np.matmul(q.reshape(H, g * q.shape[1], q.shape[2]), k.transpose(0, 2, 1))
    out *= np.float32(scaling)
    return out.reshape(Hq, q.shape[1], k.shape[1])


def query_token_mass(q, k, scaling: float) -> np.ndarray:
    """Attention mass per token of one query, :func:`token_mass` of
    :func:`attention_logits` for a single query: float32 [S].

    Args:
        q: float32 [H_q, d], one query (H_q a multiple of H_kv).
        k: [H_kv, S, d] keys; float16 or bfloat16 keys are scored by the C
            kernels straight from their dtype (``head_logits_half`` per KV
            head, then ``softmax_sum``), with no float32 copy of K (numpy's
            conversion alone took 5.8 ms at 3,400 Qwen3-32B-shaped
            entries); other keys by numpy.  The two forms agree up to float
            rounding; logits that are not finite (keys or queries so large
            that they overflow) take the numpy form on every kernel path, so
            the result does not depend on the path.
        scaling: softmax scale (usually d**-0.5), finite and > 0.

    Raises:
        ShapeError: q and k do not fit (dimensions, head counts).
        InvalidNumberError: scaling not a finite positive number.
    """
    q = _f32(q)
    if not isinstance(k, np.ndarray):
        k = _f32(k)
    if q.ndim != 2 or k.ndim != 3 or q.shape[1] != k.shape[2] or k.shape[0] == 0 or \
            q.shape[0] == 0 or q.shape[0] % k.shape[0]:
        raise ShapeError(f"query {q.shape} and keys {k.shape} do not fit: need q [H_q, d] "
                         f"and k [H_kv, S, d] with H_q a multiple of H_kv")
    scaling = parse_number(scaling, "scaling", 0, lo_open=True)
    H, n, d = k.shape
    if n == 0:
        return np.zeros(0, dtype=np.float32)
    if k.dtype.name not in ("float16", "bfloat16"):
        return token_mass(attention_logits(q[:, None, :], k, scaling))[0]
    from ..store._kernels import head_logits_half, softmax_sum
    bf16 = k.dtype.name == "bfloat16"
    it = k.itemsize
    if k.strides[0] == d * it and k.strides[2] == it and k.strides[1] >= H * d * it:
        # K as strided views of stored entry rows (an EntryBuffer): each
        # token's H_kv heads lie side by side, so one pass reads them in place
        rows = np.lib.stride_tricks.as_strided(k, (n, H * d), (k.strides[1], it))
        lg = head_logits_half(rows, q[None], H, bf16=bf16)[0]
    else:
        g = q.shape[0] // H
        lg = np.empty((q.shape[0], n), dtype=np.float32)
        for h in range(H):                      # one pass over each KV head's rows
            lg[h * g:(h + 1) * g] = head_logits_half(np.ascontiguousarray(k[h]),
                                                     q[None, h * g:(h + 1) * g], 1,
                                                     bf16=bf16)[0]
    if not np.isfinite(lg).all():
        with np.errstate(invalid="ignore", over="ignore"):
            return token_mass(lg[:, None, :] * np.float32(scaling))[0]
    return softmax_sum(lg, scaling) / np.float32(q.shape[0])


def _softmax(x, axis=-1):
    m = x.max(axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / e.sum(axis=axis, keepdims=True)


def token_mass(logits: np.ndarray) -> np.ndarray:
    """Attention mass per token: softmax over keys, mean over heads: [n, S]."""
    return _softmax(logits, -1).mean(axis=0)


def oracle_mass(mass: np.ndarray, k: int) -> float:
    """Attention mass of the oracle: the sum of the ``k`` largest of ``mass``
    float [S] (float64; 0.0 for k <= 0; all of it for k >= S)."""
    mass = np.asarray(mass)
    S = mass.shape[0]
    k = min(int(k), S)
    return float(np.partition(mass, S - k)[S - k:].sum(dtype=np.float64)) if k > 0 else 0.0


def attention_recall(mass: np.ndarray, positions, budget: int) -> tuple[float, float, float]:
    """Attention-mass recall of a selection (SWARM §8.2; see the module doc).

    Args:
        mass: float [S] attention mass per token (e.g. :func:`token_mass`).
        positions: int [n] selected positions; duplicates count once.
        budget: k = ceil(r x S), the oracle's size at least.

    Returns:
        (recall, selected mass, oracle mass) with the oracle the top
        max(budget, distinct n) tokens by mass; recall is 1.0 when the
        oracle's mass is 0.
    """
    mass = np.asarray(mass, dtype=np.float64)
    S = mass.shape[0]
    pos = unique_ints(np.asarray(positions, dtype=np.int64))
    m = min(max(int(budget), pos.shape[0]), S)
    got = float(mass[pos].sum())
    top = oracle_mass(mass, m)
    return (got / top if top > 0 else 1.0), got, top


def _attend(logits, v, g):
    """softmax(logits) @ v per head: logits [H_q, n, S'], v [H_kv, S', d]."""
    p = _softmax(logits, -1)
    Hq, n, _ = p.shape
    H = v.shape[0]
    return np.einsum("hgns,hsd->hgnd", p.reshape(H, g, n, -1), v).reshape(Hq, n, -1)


def evaluate_query(q, k_ctx, v_ctx, positions, *, k_ret=None, v_ret=None,
                   scaling: float, ratio: float) -> dict:
    """Accuracy of one retrieval for one query against the oracle.

    Args:
        q: [H_q, d] the query.
        k_ctx, v_ctx: [H_kv, S, d] the full context (ground truth).
        positions: int [n] token positions the method retrieved.
        k_ret, v_ret: [H_kv, n, d] the K/V the method returned for those
            positions (read from the store); default taken from the context.
        scaling: softmax scale.
        ratio: sparsity ratio r (oracle budget k = ceil(r x S)).

    Returns:
        dict with ``recall`` (:func:`attention_recall`), ``mass``,
        ``oracle_mass`` (of the top ``budget``), ``rel_error``,
        ``oracle_rel_error``, ``entries`` (distinct) and ``budget``.
    """
    return evaluate_queries(_f32(q)[None], k_ctx, v_ctx, [positions],
                            k_ret=None if k_ret is None else [k_ret],
                            v_ret=None if v_ret is None else [v_ret],
                            scaling=scaling, ratio=ratio)[0]


def evaluate_queries(qs, k_ctx, v_ctx, positions, *, k_ret=None, v_ret=None,
                     scaling: float, ratio: float, chunk: int = 64) -> list[dict]:
    """:func:`evaluate_query` for many queries over one context: the dense
    attention of up to ``chunk`` queries at a time in one GEMM per KV head,
    then each query's retrieval against it.

    Args:
        qs: [n, H_q, d] queries.
        k_ctx, v_ctx: [H_kv, S, d] the context.
        positions: n int arrays, each query's retrieved positions.
        k_ret, v_ret: None, or n arrays [H_kv, n_i, d] (as evaluate_query).
        scaling, ratio: as evaluate_query.

    Returns:
        n dicts, as :func:`evaluate_query` returns.
    """
    qs = _f32(qs)
    k_ctx, v_ctx = _f32(k_ctx), _f32(v_ctx)
    S = k_ctx.shape[1]
    g = qs.shape[1] // k_ctx.shape[0]
    budget = entry_budget(ratio, S)
    out = []
    for a in range(0, qs.shape[0], chunk):
        q = np.ascontiguousarray(qs[a:a + chunk].transpose(1, 0, 2))    # [H_q, m, d]
        logits = attention_logits(q, k_ctx, scaling)                    # [H_q, m, S]
        masses = token_mass(logits)                                     # [m, S]
        fulls = _attend(logits, v_ctx, g)                               # [H_q, m, d]
        for j in range(q.shape[1]):
            i = a + j
            mass, lg, full = masses[j], logits[:, j:j + 1], fulls[:, j:j + 1]
            top = np.argpartition(-mass, budget - 1)[:budget]
            pos = np.asarray(positions[i], dtype=np.int64)
            kr = k_ctx[:, pos] if k_ret is None else _f32(k_ret[i])
            vr = v_ctx[:, pos] if v_ret is None else _f32(v_ret[i])
            sparse = _attend(attention_logits(q[:, j:j + 1], kr, scaling), vr, g)
            oracle = _attend(lg[:, :, top], v_ctx[:, top], g)
            nrm = float(np.linalg.norm(full))
            recall, m_ret, _ = attention_recall(mass, pos, budget)
            out.append({"recall": recall, "mass": m_ret,
                        "oracle_mass": oracle_mass(mass, budget),
                        "rel_error": float(np.linalg.norm(sparse - full)) / nrm,
                        "oracle_rel_error": float(np.linalg.norm(oracle - full)) / nrm,
                        "entries": int(unique_ints(pos).shape[0]), "budget": budget})
    return out


def summarize(rows: list[dict]) -> dict:
    """Mean of each numeric field over per-query result dicts."""
    out = {}
    for key in rows[0]:
        vals = [r[key] for r in rows if isinstance(r[key], (int, float))]
        if vals:
            out[key] = float(np.mean(vals))
    return out
