"""Defaults have one home (swarmfs/_defaults.py): every signature that takes
one uses that value."""

import inspect

from click.testing import CliRunner

from swarmfs import DecodeSession, Retriever
from swarmfs import _defaults as d
from swarmfs.layout import LayoutParams


def _default(fn, name):
    return inspect.signature(fn).parameters[name].default


def test_session_and_layout_defaults_are_the_module_values():
    assert _default(DecodeSession, "tau") == d.ONLINE_TAU
    assert _default(DecodeSession, "max_joins") == d.MAX_JOINS
    assert _default(DecodeSession, "flush_batch") == d.FLUSH_BATCH
    assert _default(DecodeSession, "t_base_us") == d.T_BASE_US
    assert _default(DecodeSession, "t_transfer_us") == d.T_TRANSFER_US
    p = LayoutParams()
    assert (p.ratio, p.local_window, p.hot_fraction, p.t_base_us, p.t_transfer_us) == \
        (d.RATIO, d.LOCAL_WINDOW, d.HOT_FRACTION, d.T_BASE_US, d.T_TRANSFER_US)
    from swarmfs.layout import _profile, _quality
    assert _default(_quality.evaluate_recall, "local_window") == d.LOCAL_WINDOW == 256
    assert _profile.DEFAULT_RATIO == d.RATIO == 0.1
    assert _default(_quality.evaluate_recall, "ratio") == d.RATIO
    assert _default(_quality.evaluate_recall, "local_window") == d.LOCAL_WINDOW
    from swarmfs import hf
    assert _default(hf.SwarmCache, "ratio") == d.RATIO
    assert _default(hf.SwarmCache, "tau") == d.ONLINE_TAU


def test_retriever_default_ratio(tmp_path):
    from swarmfs import Store
    s = Store.create(tmp_path / "st", disks=1, num_layers=1, num_kv_heads=1, head_dim=8,
                     dtype="float16")
    assert Retriever(s).ratio == d.RATIO
    s.close()


def test_cli_help_shows_the_module_values():
    from swarmfs._cli import main
    out = CliRunner().invoke(main, ["demo", "--help"], terminal_width=200).output
    assert f"[default: {d.RATIO}]" in out
    assert f"[default: {d.LOCAL_WINDOW}]" in out
    assert f"[default: {d.HOT_FRACTION}]" in out


def test_new_cluster_size_default_and_no_deprecated_alias(tmp_path):
    import numpy as np
    import pytest

    from swarmfs import InvalidCallError, Store
    s = Store.create(tmp_path / "st", disks=1, num_layers=1, num_kv_heads=1, head_dim=8,
                     dtype="float16")
    kv = np.ones((64, 2, 1, 8), np.float16)
    s.write_layer(0, kv, np.array_split(np.arange(64), 4))
    r = Retriever(s)
    assert DecodeSession(r, 0).new_cluster_size == d.NEW_CLUSTER_SIZE
    assert DecodeSession(r, 0, new_cluster_size=5).new_cluster_size == 5
    # the deprecated alias group= is gone (0.1.0): an unknown keyword now
    with pytest.raises(InvalidCallError, match="group"):
        DecodeSession(r, 0, group=7)
    s.close()
