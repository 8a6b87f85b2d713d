"""The entry budget and the local window: one rule each (SWARM §5.2).

* :func:`entry_budget` -- k = ceil(r x S) distinct entries a query may use,
  local window included.
* :func:`window_size` -- the tokens of the local window a query uses:
  min(W, S, budget // 4).
* :func:`window_positions` / :func:`window_mask` -- which tokens those are
  (the last ones of the context).

The Retriever, the decode session, the demo's layout, the layout's quality
evaluation and the report all use these.
"""

from __future__ import annotations

import math

import numpy as np

from .._defaults import LOCAL_WINDOW
from .._validate import checked, parse_nonneg_int

__all__ = ["entry_budget", "window_size", "stored_window", "window_positions", "window_mask"]


def entry_budget(ratio: float, num_tokens: int) -> int:
    """Entry budget k = ceil(r x S) of a context of S tokens (SWARM §5.2,
    §8.1): distinct entries a query may use, local window included."""
    return int(math.ceil(float(ratio) * int(num_tokens)))


def window_size(local_window: int, budget: int, num_tokens: int) -> int:
    """Tokens of the local window a query uses: min(W, S, budget // 4).

    W is the layer's local window (§5.2, :data:`~swarmfs._defaults.LOCAL_WINDOW`
    by default); the quarter-budget cap only acts on short contexts, where a
    256-token window would otherwise take the whole budget and no cluster
    would be read.
    """
    return int(max(0, min(int(local_window), int(num_tokens), int(budget) // 4)))


def stored_window(local_window: int, ratio: float, num_tokens: int) -> int:
    """W to store with a layer of S tokens laid out for ratio r:
    :func:`window_size` at the budget :func:`entry_budget` (on short contexts
    the clusters a query selects, not the recency window, fill the budget; the
    paper's 256-token window is under 1% of its 32K-1M contexts)."""
    return window_size(local_window, entry_budget(ratio, num_tokens), num_tokens)


@checked
def window_positions(num_tokens: int, window: int = LOCAL_WINDOW) -> np.ndarray:
    """Token positions of the local window kept in DRAM (SWARM §5.2).

    Returns:
        int64 ``[max(0, S - W), S)`` ascending (all tokens if S <= W).

    Raises:
        InvalidIntegerError: S or W negative or not integers.
        InvalidCallError: an unknown keyword argument.
    """
    num_tokens = parse_nonneg_int(num_tokens, "num_tokens")
    window = parse_nonneg_int(window, "window")
    return np.arange(max(0, num_tokens - window), num_tokens, dtype=np.int64)


@checked
def window_mask(num_tokens: int, window: int = LOCAL_WINDOW) -> np.ndarray:
    """bool [S]: True for the last ``window`` tokens (see :func:`window_positions`).

    Raises:
        InvalidIntegerError: S or W negative or not integers.
        InvalidCallError: an unknown keyword argument.
    """
    num_tokens = parse_nonneg_int(num_tokens, "num_tokens")
    mask = np.zeros(num_tokens, bool)
    mask[window_positions(num_tokens, window)] = True
    return mask
