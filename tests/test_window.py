"""The entry budget and the local window (swarmfs/_window.py): one rule each."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarmfs._errors import InvalidIntegerError
from swarmfs.decode._window import (
    entry_budget,
    stored_window,
    window_mask,
    window_positions,
    window_size,
)


def test_entry_budget_is_ceil_r_s():
    assert entry_budget(0.1, 8192) == 820          # 819.2 -> 820
    assert entry_budget(0.1, 1000) == 100
    assert entry_budget(1.0, 77) == 77
    assert entry_budget(0.02, 16384) == 328        # 327.68
    assert entry_budget(0.5, 1) == 1


def test_window_size_hand_checked():
    assert window_size(256, 1000, 10_000) == 250   # a quarter of the budget
    assert window_size(256, 4000, 10_000) == 256   # W
    assert window_size(256, 4000, 100) == 100      # the context
    assert window_size(0, 4000, 100) == 0
    assert window_size(256, 3, 100) == 0           # budget // 4 == 0


def test_stored_window_is_the_rule_at_the_layout_budget():
    # S = 2000, r = 0.1: budget 200, a quarter of it is 50 < W = 256
    assert stored_window(256, 0.1, 2000) == 50
    assert stored_window(256, 0.1, 100_000) == 256
    assert stored_window(64, 1.0, 10) == 2


@given(W=st.integers(0, 600), S=st.integers(0, 5000), r=st.floats(0.001, 1.0))
def test_window_never_exceeds_w_s_or_a_quarter_budget(W, S, r):
    b = entry_budget(r, S)
    w = window_size(W, b, S)
    assert 0 <= w <= min(W, S, b // 4)
    assert w == min(W, S, b // 4)
    assert stored_window(W, r, S) == w


@given(S=st.integers(0, 3000), W=st.integers(0, 600))
def test_window_positions_are_the_last_tokens(S, W):
    pos = window_positions(S, W)
    assert pos.dtype == np.int64 and pos.shape[0] == min(S, W)
    if pos.size:
        assert pos[-1] == S - 1 and np.all(np.diff(pos) == 1)
    m = window_mask(S, W)
    assert m.shape == (S,) and m.sum() == pos.shape[0] and m[pos].all()


def test_window_refuses_negative_sizes():
    with pytest.raises(InvalidIntegerError, match="num_tokens"):
        window_positions(-1)
    with pytest.raises(InvalidIntegerError, match="window"):
        window_positions(10, -1)
