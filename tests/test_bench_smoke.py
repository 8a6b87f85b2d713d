"""Smoke runs of the evaluation benchmarks (tools/bench), so the harness cannot rot.

Every figure runs at tiny size on two plain disk files (no root, no testbed),
on a real MiniLM trace of 4096 tokens captured into a temporary cache, and
must write its JSON and PNG with sane fields; Figs. 11 and 20 also run on the
decoder trace (swarm-llama, ``--trace decoder``).  Nothing here looks at
timings.  (The widening itself is tested in ``test_bench_widening.py``.)
"""

import importlib
import json
import math
import re

import numpy as np
import pytest

pytestmark = [pytest.mark.model, pytest.mark.slow]

FIGURES = ["fig11_methods", "fig12_clustering", "fig13_placement", "fig14_retrieval",
           "fig16_prefix_batch", "fig17_ssd_type", "fig18_num_disks", "fig19_tau",
           "fig20_sparsity", "table4_selection"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    from swarmfs._errors import ModelError
    from swarmfs.layout._capture import default_model_path
    from tools.bench import _common as C
    try:
        default_model_path()
    except ModelError as exc:  # the model package is missing
        pytest.skip(str(exc))
    if not (C.DATA / "wikitext2_raw_test.raw").exists():
        pytest.skip("../shared/data not found")
    cache = tmp_path_factory.mktemp("evalcache")
    out = tmp_path_factory.mktemp("evalout")
    C.load_trace(4096, cache=cache, progress=False)
    return C, cache, out


def finite(x):
    return isinstance(x, (int, float)) and math.isfinite(x)


def test_truncated_model_gives_the_full_models_layer_2(env):
    C, cache, _ = env
    from swarmfs.layout._capture import capture
    ids, seg = C.trace_tokens(600)
    assert seg["wikitext2"][0] == 0 and seg["shakespeare"][0] == seg["wikitext2"][1]
    full = capture(None, token_ids=ids, layers=[2], dtype="float16", progress=False)
    cut = capture(C.truncated_model(3, cache), token_ids=ids, layers=[2], dtype="float16",
                  progress=False)
    for name in "qkv":
        assert np.array_equal(getattr(full, name), getattr(cut, name))


@pytest.mark.parametrize("name", FIGURES)
def test_figure_smoke_run(env, name):
    C, cache, out = env
    mod = importlib.import_module(f"tools.bench.{name}")
    prefix = out / f"{name}-smoke"
    p = mod.main(["--smoke", "--disks", "files:2", "--cache", str(cache),
                  "--out", str(prefix)])
    j = json.loads(prefix.with_suffix(".json").read_text())
    assert prefix.with_suffix(".png").stat().st_size > 1000
    assert j["figure"] == name.split("_")[0] and "command" in j and "machine" in j
    assert j["command"].startswith(f"python -m tools.bench.{name} --smoke")
    from tools.bench._common.output import _json_default
    same = json.loads(json.dumps(p, default=_json_default))
    assert all(j[k] == v for k, v in same.items() if k not in ("command", "machine"))
    check = globals().get(f"_check_{name.split('_')[0]}")
    if check:
        check(j)


def _check_method_summary(x):
    for k in ("io_us_median", "eff_gbps_median", "bytes_read_median", "requests_median"):
        assert finite(x[k]) and x[k] > 0, k
    assert 0 < x["recall_mean"] <= 1.0 + 1e-6
    assert x["rel_error_mean"] >= 0 and x["index_bytes"] > 0


def _check_fig11(j):
    r = j["datasets"]["wikitext2"]
    assert set(r["methods"]) == {"swarm", "no_cluster", "infllm", "pqcache", "quest"}
    for x in r["methods"].values():
        _check_method_summary(x)
        # every step read at most its budget plus whole clusters, at least the budget
        assert x["entries_median"] >= r["budget"]
    assert r["methods"]["no_cluster"]["layout"]["replication"] == 1.0
    assert set(r["ratios"]) == {"no_cluster", "infllm", "pqcache", "quest"}
    assert all(finite(v["bw_ratio"]) for v in r["ratios"].values())


def _check_fig12(j):
    assert set(j["variants"]) == {"swarm", "medoid_only", "no_replica"}
    for x in j["variants"].values():
        _check_method_summary(x)
    assert j["variants"]["no_replica"]["layout"]["replication"] == 1.0


def _check_fig13(j):
    v = j["variants"]
    assert set(v) == {"swarm", "sequential", "no_balance"}
    # the same entries are read three ways
    assert v["swarm"]["useful_entries_median"] == v["sequential"]["useful_entries_median"]
    assert v["no_balance"]["useful_entries_median"] == v["swarm"]["useful_entries_median"]


def _check_fig14(j):
    v = j["variants"]
    assert set(v) == {"swarm", "static", "no_balance", "no_dedup"}
    assert v["no_dedup"]["bytes_read_median"] >= v["swarm"]["bytes_read_median"]
    assert v["no_balance"]["useful_entries_median"] == v["swarm"]["useful_entries_median"]


def _check_fig16(j):
    assert {(r["tokens"], r["batch"]) for r in j["rows"]} == \
        {(t, b) for t in (1024, 2048) for b in (1, 4, 8)}
    for r in j["rows"]:
        assert finite(r["io_us_median"]) and r["index_bytes"] > 0


def _check_fig17(j):
    assert "files" in j["profiles"]
    assert len(j["profiles"]["files"]["points"]) == 2


def _check_fig18(j):
    assert [p["disks"] for p in j["points"]] == [1, 2]
    assert finite(j["targets"]["swarm_scaling"]["ratio"])


def _check_fig19(j):
    assert {r["tau"] for r in j["rows"]} == {0.5, 0.7}
    for r in j["rows"]:
        assert r["replication"] >= 1.0 and 0 < r["recall_mean"] <= 1.0 + 1e-6


def _check_fig20(j):
    assert [p["ratio"] for p in j["points"]] == [0.05, 0.1]
    assert j["iso_accuracy"]["swarm_recall"] > 0


def _check_table4(j):
    for r in j["rows"]:
        assert r["naive_ms"] > 0 and r["swarm_ms"] > 0 and r["swarm_index_bytes"] > 0
        assert "synthetic" in r


def test_summary_tables_from_smoke_outputs(env):
    _, _, out = env
    from tools.bench import run_all
    if not (out / "fig11_methods-smoke.json").exists():
        pytest.skip("runs after the figure smoke runs")
    md = run_all.summary(smoke=True, outdir=out)
    assert "### Fig. 11" in md and "### Table 4" in md
    # Fig. 11's table: a header, the alignment row, one row per method
    lines = md.split("### Fig. 11")[1].split("\n\n")[1].splitlines()
    assert lines[0].startswith("| dataset") and re.fullmatch(r"\|(:?-+:?\|)+", lines[1])
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]
    assert [c[1] for c in cells] == ["SWARM", "No Cluster", "InfLLM", "PQCache", "Quest"]
    assert all(len(c) == 13 for c in cells)


@pytest.mark.parametrize("name", ["fig11_methods", "fig20_sparsity"])
def test_step_view_smoke_run(env, name):
    """The step-time view (selection + planning + I/O + assembly per method)
    on two 'profiles' of plain file disks, side by side."""
    C, cache, out = env
    mod = importlib.import_module(f"tools.bench.{name}")
    prefix = out / f"{name}-step-smoke"
    mod.main(["--smoke", "--cache", str(cache), "--out", str(prefix),
              "--step-profiles", "two=files:2,one=files:1"])
    j = json.loads(prefix.with_suffix(".json").read_text())
    assert j["view"] == "step" and set(j["profiles"]) == {"two", "one"}
    assert j["profiles"]["two"]["count"] == 2 and j["profiles"]["one"]["count"] == 1
    assert prefix.with_suffix(".png").stat().st_size > 1000
    points = list(j["datasets"].values()) if name == "fig11_methods" else j["points"]
    if name == "fig20_sparsity":
        assert [p["ratio"] for p in points] == [0.05, 0.1]
    for p in points:
        for pn, pr in p["profiles"].items():
            ms = pr["methods"]
            assert set(ms) == {"swarm", "no_cluster", "infllm", "pqcache", "quest"}
            for m, x in ms.items():
                parts = [x[f"{k}_median"] for k in ("select_us", "plan_us", "io_us",
                                                    "assemble_us")]
                assert all(finite(v) and v > 0 for v in parts), (pn, m, parts)
                # every block timed at least one pass; a retrieval's wall time
                # holds its I/O; a step's wall time holds the retrieval
                assert x["reps"] == j["reps"] and x["timed_steps"] >= j["reps"]
                assert x["total_us_median"] >= x["io_us_median"]
                assert x["step_us_median"] >= 0.5 * x["parts_sum_us_median"]
                assert x["cpu_us_median"] > 0 and 0 < x["recall_mean"] <= 1.0 + 1e-6
            assert set(pr["ratios"]) == {"no_cluster", "infllm", "pqcache", "quest"}
            assert all(finite(v["step_ratio"]) and v["step_ratio"] > 0
                       for v in pr["ratios"].values())
    if name == "fig20_sparsity":
        for pn in ("two", "one"):
            iso = j["iso_accuracy"][pn]
            assert finite(iso["swarm_step_us"]) and set(iso["methods"]) == \
                {"no_cluster", "infllm", "pqcache", "quest"}
            for res in iso["methods"].values():
                for v in res.values():
                    assert ("step_ratio_vs_swarm" in v) == v["reached"]
                    assert ("step_ratio_lower_bound" in v) == (not v["reached"])


@pytest.fixture(scope="module")
def decoder_env(env):
    """The decoder trace (4096 tokens, layer by the rule) in the same cache."""
    C, cache, out = env
    from swarmfs.models import DEFAULT_DECODER
    if not (DEFAULT_DECODER / "model.safetensors").is_file():
        pytest.skip("the decoder checkpoint is missing")
    tr = C.load_trace(4096, kind="decoder", cache=cache, progress=False)
    return C, cache, out, tr


def test_decoder_trace_is_the_decoders_causal_capture(decoder_env):
    """The cached decoder trace is swarm-llama's layer ``rule["layer"]`` run
    causally: its K/Q equal a direct capture of the same tokens, and the
    decode queries past a window are its continuation."""
    C, cache, _, tr = decoder_env
    from swarmfs.layout._capture import capture
    rule = C.decoder_layer(cache)
    assert tr.meta["layer"] == rule["layer"] == int(np.argmax(rule["mass_outside_window"]))
    assert tr.meta["model_sha256"] == C.model_hash(C.decoder_model()) in tr.path.name
    assert tr.meta["window"] == C.DECODER_WINDOW and tr.wide == C.DECODER_WIDENING
    ids, _ = C.trace_tokens(4096 + C.DECODER_TAIL, C.decoder_model())
    cap = capture(C.decoder_model(), token_ids=ids, window=4096 + C.DECODER_TAIL,
                  layers=[rule["layer"]], dtype="float16", progress=False)
    np.testing.assert_allclose(tr.k.astype(np.float32), cap.k[0, :, :4096], atol=2e-2)
    np.testing.assert_allclose(tr.decode_queries([4096, 4100], 4096).astype(np.float32),
                               cap.q[0][:, [4096, 4100]].transpose(1, 0, 2), atol=2e-2)


@pytest.mark.parametrize("name", ["fig11_methods", "fig20_sparsity"])
def test_figure_smoke_run_on_the_decoder_trace(decoder_env, name):
    C, cache, out, _ = decoder_env
    mod = importlib.import_module(f"tools.bench.{name}")
    prefix = out / f"{name}-decoder-smoke"
    mod.main(["--smoke", "--disks", "files:2", "--cache", str(cache), "--trace", "decoder",
              "--out", str(prefix)])
    j = json.loads(prefix.with_suffix(".json").read_text())
    assert "--trace decoder" in j["command"] and j["trace"]["kind"] == "decoder"
    assert j["trace"]["widening"]["store_query_heads"] == 64
    assert "8,192" in j["trace_recipe"]
    globals()[f"_check_{name.split('_')[0]}"](j)


def test_summary_tables_from_decoder_smoke_outputs(decoder_env):
    _, _, out, _ = decoder_env
    from tools.bench import run_all
    if not (out / "fig11_methods-decoder-smoke.json").exists():
        pytest.skip("runs after the decoder figure smoke runs")
    md = run_all.summary(smoke=True, outdir=out, trace="decoder")
    assert md.startswith("Trace: `--trace decoder`")
    assert "### Fig. 11" in md and "### Fig. 20" in md and "### Fig. 12" not in md


def test_swarm_is_laid_out_at_the_decoder_paths_operating_point_on_its_trace():
    """On ``--trace decoder`` the figures lay SWARM out as ``SwarmCache`` lays
    out a prompt (``DECODER_TAU``, ``DECODER_MAX_CLUSTER_SIZE``); on MiniLM
    with the offline layout's defaults; explicit parameters win."""
    from types import SimpleNamespace

    from swarmfs import _defaults as D
    from tools.bench.fig11_methods import swarm_params
    assert swarm_params(SimpleNamespace(trace="decoder")) == {
        "tau": D.DECODER_TAU, "max_cluster_size": D.DECODER_MAX_CLUSTER_SIZE}
    assert swarm_params(SimpleNamespace(trace="minilm")) == {}
    assert swarm_params(SimpleNamespace(trace="decoder"), {"tau": 0.6}) == {"tau": 0.6}


def test_setup_checks_the_disks_before_the_trace_and_step_views_need_none(monkeypatch,
                                                                           tmp_path):
    """``--disks`` naming a testbed that is not up failed only after a trace
    capture of minutes, and the step views (whose disks are their
    ``--step-profiles``) failed on it too; now ``setup`` resolves the disks
    first and the step views load only the trace."""
    from types import SimpleNamespace

    from tools.bench._common import cli as CL
    calls = []

    def no_testbed(spec):
        calls.append("disks")
        raise SystemExit(f"testbed {spec!r} is not up")

    monkeypatch.setattr(CL, "resolve_disks", no_testbed)
    monkeypatch.setattr(CL, "load_trace", lambda *a, **k: calls.append("trace") or "trace")
    cfg = SimpleNamespace(prefix=lambda name: tmp_path / name, trace_tokens=0, trace="minilm",
                          cache=tmp_path, smoke=False, disks="testbed:down")
    with pytest.raises(SystemExit, match="is not up"):
        CL.setup(cfg, "fig", trace_tokens=0)
    assert calls == ["disks"]
    calls.clear()
    assert CL.setup_trace(cfg, "fig", trace_tokens=0) == ("trace", tmp_path / "fig")
    assert calls == ["trace"]
