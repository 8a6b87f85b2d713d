"""The developer tools' command lines (``tools/``): one click CLI, ``python -m tools``.

The tools' work is benchmarks (not run here); these tests check what their
command lines parse into and that ``python -m tools`` reaches every tool.
"""

import json
import os
import pathlib
import re

import numpy as np
import pytest
from click.testing import CliRunner

from tools import __main__ as T
from tools import bench_decode, bench_layout, fuzz_store

TOOLS_DIR = pathlib.Path(__file__).resolve().parents[1] / "tools"


class Parsed(Exception):
    """Raised by a stand-in for a tool's work, carrying what it was given."""


def _capture(monkeypatch, module, name):
    def stand_in(args, *rest):
        raise Parsed(vars(args))
    monkeypatch.setattr(module, name, stand_in)


def test_spread_lists_is_argparse_nargs_plus():
    S = bench_decode.spread_lists
    assert S(["quality", "--kinds", "python", "prose", "--ratios", "0.05", "0.2", "--out", "o"]) \
        == ["quality", "--kinds", "python", "--kinds", "prose",
            "--ratios", "0.05", "--ratios", "0.2", "--out", "o"]
    # a negative number is a value, an option ends the list, "--" ends parsing
    assert S(["--ratios", "-1", "2", "--steps", "3"]) == \
        ["--ratios", "-1", "--ratios", "2", "--steps", "3"]
    assert S(["--kinds", "--", "--kinds", "a", "b"]) == ["--kinds", "--", "--kinds", "a", "b"]
    assert S(["--steps", "3", "a", "b"]) == ["--steps", "3", "a", "b"]     # not a list option


def test_bench_decode_lists_and_defaults(monkeypatch):
    pytest.importorskip("torch")
    _capture(monkeypatch, bench_decode, "load")
    with pytest.raises(Parsed) as got:
        bench_decode.main(["throughput", "--kinds", "python", "prose", "--ratios", "0.1", "0.2",
                           "--disk-paths", "/dev/loop0", "/dev/loop1", "--steps", "8"])
    a = got.value.args[0]
    assert (a["what"], a["kinds"], a["ratios"], a["disk_paths"], a["steps"]) == \
        ("throughput", ["python", "prose"], [0.1, 0.2], ["/dev/loop0", "/dev/loop1"], 8)
    with pytest.raises(Parsed) as got:
        bench_decode.main(["throughput", "--batch", "1", "4", "8", "--steps", "8"])
    assert (got.value.args[0]["batch"], got.value.args[0]["steps"]) == ([1, 4, 8], 8)
    with pytest.raises(Parsed) as got:
        bench_decode.main(["quality"])
    a = got.value.args[0]
    assert a["methods"] == ["swarm", "quest", "infllm", "pqcache", "sinks", "oracle"]
    assert (a["ratios"], a["disk_paths"], a["dram_fractions"], a["context"]) == \
        ([0.05, 0.1, 0.2], None, [0.01, 0.02, 0.05, 0.1], 8192)
    with pytest.raises(Parsed) as got:                   # the same through python -m tools
        T.main(["bench_decode", "online", "--kinds", "prose", "python", "--ratios", "0.2"])
    a = got.value.args[0]
    assert (a["what"], a["kinds"], a["ratios"]) == ("online", ["prose", "python"], [0.2])


def test_bench_layout_comma_lists_and_out(monkeypatch, tmp_path):
    seen = {}

    def recall(args):
        seen.update(vars(args))
        return {"ok": 1}
    monkeypatch.setattr(bench_layout, "cmd_recall", recall)
    out = tmp_path / "sub" / "r.json"
    bench_layout.main(["recall", "--taus", "0.5,0.6", "--layers", "0,2", "--out", str(out)])
    assert (seen["taus"], seen["layers"], seen["eq2_counts"], seen["context"]) == \
        ([0.5, 0.6], [0, 2], [0.025, 0.05, 0.1], 3072)
    assert json.loads(out.read_text()) == {"ok": 1}
    with pytest.raises(Exception, match="comma list"):
        bench_layout.main(["recall", "--layers", "0,x"])


@pytest.mark.parametrize("outcomes,status", [({"equal": 3, "refused": 1}, 0),
                                             ({"equal": 3, "hang": 1}, 1)])
def test_fuzz_store_exit_status(monkeypatch, outcomes, status):
    res = {"outcomes": outcomes, "failures": [], "seconds": 0.0}
    monkeypatch.setattr(fuzz_store, "fuzz", lambda *a, **kw: res)
    assert fuzz_store.main(["--cases", "4"]) == status
    # the same through python -m tools
    assert T.main(["fuzz_store", "--cases", "4"]) == status


def test_python_m_tools_reaches_every_tool():
    tools = {p.stem for p in TOOLS_DIR.glob("*.py") if not p.stem.startswith("_")}
    assert set(T.TOOLS) == tools
    figures = {p.stem for p in (TOOLS_DIR / "bench").glob("*.py") if not p.stem.startswith("_")}
    assert set(T.FIGURES) == figures
    for name in sorted(T.TOOLS):
        assert T.main([name, "--help"]) == 0, name
    assert T.main(["bench", "fig19_tau", "--help"]) == 0


def test_every_figure_writes_its_own_summary_section():
    """run_all's Markdown summary is a loop over the figures: each module in
    run_all.FIGURES has a ``summary(payload)``, and the figures run_all runs
    are the figures ``python -m tools bench`` offers."""
    import importlib

    from tools.bench import run_all
    modules = [module for _, module, _ in run_all.FIGURES]
    assert set(modules) == set(T.FIGURES) - {"run_all"}
    for module in modules:
        assert callable(importlib.import_module(f"tools.bench.{module}").summary), module


def test_python_m_tools_passes_the_tools_own_arguments(monkeypatch, tmp_path):
    # a figure records its command line from ctx.obj: the arguments after its name
    from tools.bench import fig19_tau

    def cli(cfg, **kw):
        raise Parsed(cfg.command)
    cmd = fig19_tau.C.command("fig19_tau", "doc")(cli)
    monkeypatch.setattr(fig19_tau, "cli", cmd)
    with pytest.raises(Parsed) as got:
        T.main(["bench", "fig19_tau", "--smoke", "--qd", "4"])
    assert got.value.args[0] == "python -m tools.bench.fig19_tau --smoke --qd 4"


def test_decoder_tools_refuse_bad_plans_before_any_work(tmp_path):
    """train_decoder and eval_decoder are click commands too: a malformed
    phase plan, copy mixture or range is a usage error (exit 2) that names
    the option, before a work directory is made."""
    from tools import eval_decoder, train_decoder
    out = tmp_path / "never"
    for bad in (["--phases", "abc"], ["--phases", "64x0:5"], ["--repeat", "0:2:pairs"],
                ["--repeat", "0:0.5:bogus"], ["--repeat", "0:0.7:pairs,0:0.7:double"],
                ["--repeat", "0:0.5,300:0.7:pairs,300:0.7:double,900:0.1"],
                ["--repeat", "x:0.5"], ["--lr", "0"], ["--decay", "2"]):
        r = CliRunner().invoke(train_decoder.cli, ["--out", str(out), "--bench", *bad])
        assert r.exit_code == 2, (bad, r.output)
        assert "Invalid value" in r.output and "Traceback" not in r.output
    assert not out.exists()
    r = CliRunner().invoke(eval_decoder.cli, ["--tokens", "1"])
    assert r.exit_code == 2 and "--tokens" in r.output


# -- bad option values are usage errors, before any work --------------------------------

def _commands():
    """(argv prefix, click command) of every click tool and figure, subcommands
    of groups included (the argparse ones and hidden workers excluded)."""
    import importlib

    import click
    out = []
    for name, (module, _) in sorted(T.TOOLS.items()):
        cmd = importlib.import_module(module).cli
        if isinstance(cmd, click.Group):
            out += [([name, sub], c) for sub, c in sorted(cmd.commands.items()) if not c.hidden]
        else:
            out.append(([name], cmd))
    for name in sorted(T.FIGURES):
        out.append((["bench", name], importlib.import_module(f"tools.bench.{name}").cli))
    return out


#: options that may be any integer
_FREE = {"seed"}


def _bad_values(param):
    """Values the option must refuse."""
    import click

    from tools import _options as O
    t = param.type
    if isinstance(t, (click.IntRange, click.FloatRange)):
        bad = ["x"]
        if t.min is not None:
            bad.append(str(t.min - 1))
            if isinstance(t, click.FloatRange):
                bad += ["nan", "inf"]
        if t.max is not None:
            bad.append(str(t.max + 1))
        return bad
    if isinstance(t, O.CommaList):
        return [",", "x,,y" if t.of is not str else "no-such-thing"]
    if isinstance(t, click.Choice):
        return ["no-such-thing"]
    if isinstance(t, O.DiskSpec):
        return ["8", "file:2", "files:0"]
    if isinstance(t, O.OutPath):
        return ["/proc/self/no-such-dir/x"]
    return []


def test_every_numeric_option_has_a_range():
    """A count, size, ratio or seconds given as a plain int/float accepted
    -5 or 0 and failed later with a traceback (bench_select --reps 0:
    'min() arg is an empty sequence'; bench_engine --repeats 0)."""
    import click
    loose = []
    for argv, cmd in _commands():
        for p in cmd.params:
            if isinstance(p, click.Option) and p.name not in _FREE and \
                    type(p.type) in (click.types.IntParamType, click.types.FloatParamType):
                loose.append(f"{' '.join(argv)} {p.opts[0]}")
    assert not loose, loose


def test_bad_values_are_usage_errors_before_any_work(monkeypatch):
    """Every checked option of every tool refuses bad values while the
    command line is parsed (click.UsageError: exit status 2 from the
    shell); the command's work never starts."""
    import click
    tried = 0
    for argv, cmd in _commands():
        monkeypatch.setattr(cmd, "callback",
                            lambda *a, _argv=argv, **kw: pytest.fail(f"{_argv} ran"))
        pre = argv + (["quality"] if argv == ["bench_decode"] else [])
        for p in cmd.params:
            if not isinstance(p, click.Option):
                continue
            for bad in _bad_values(p):
                with pytest.raises(click.UsageError):
                    T.main(pre + [p.opts[0], bad])
                tried += 1
    assert tried > 100


def test_a_bad_value_is_one_usage_line_from_the_shell(tmp_path):
    import subprocess
    import sys
    for args in (["fuzz_store", "--cases", "-5"], ["bench_select", "--tokens", "abc"],
                 ["bench_engine", "--sizes", "4Q"], ["bench", "fig19_tau", "--queries", "0"],
                 ["fuzz_store", "--json", str(tmp_path / "f" / "x.json")],
                 ["fuzz_store", "--json", str(tmp_path)]):
        (tmp_path / "f").write_text("a file, not a directory")
        p = subprocess.run([sys.executable, "-m", "tools"] + args, capture_output=True,
                           text=True, timeout=120, cwd=TOOLS_DIR.parent)
        assert p.returncode == 2 and "Traceback" not in p.stderr, (args, p.stderr)
        assert "Invalid value" in p.stderr, (args, p.stderr)


def test_a_tool_never_deletes_a_directory_it_did_not_make(tmp_path):
    """bench_metadata ROOT (and bench_mount --dir's stores) removed the
    directory first, whatever it held."""
    import click

    from tools import bench_metadata
    keep = tmp_path / "mine"
    keep.mkdir()
    (keep / "thesis.tex").write_text("x")
    with pytest.raises(click.UsageError, match="not a swarmfs store"):
        bench_metadata.main([str(keep)])
    assert (keep / "thesis.tex").read_text() == "x"


def test_the_decoder_tools_name_themselves(capsys):
    """python -m tools train_decoder --help said 'usage: __main__.py'."""
    for name in ("train_decoder", "eval_decoder"):
        assert T.main([name, "--help"]) == 0
        assert f"Usage: python -m tools {name}" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_select_gather_runs_every_path(tmp_path):
    """bench_select --gather (the assembly benchmark) runs each kernel path
    it names, on one thread and on two, and says which store mode ran;
    scalar is the memcpy reference."""
    from swarmfs.store._kernels import supported_paths
    T.main(["bench_select", "--gather", "--reps", "4", "--paths", "all",
            "--out", str(tmp_path / "g")])
    res = json.loads((tmp_path / "g-gather.json").read_text())
    assert set(res["paths"]) == set(supported_paths())
    for row in res["gather"]:
        assert row["paths"]["scalar"]["mode"] == "copy" and row["bytes"] > 0
        assert set(row["paths"]) == {p + t for p in supported_paths() for t in ("", "/2t")}
        for p, r in row["paths"].items():
            assert r["gather_ms"] > 0 and r["read_after_ms"] > 0
            assert r["threads"] == (2 if p.endswith("/2t") else 1)
            if p.split("/")[0] in ("avx2", "avx512") and row["bytes"] >= 16 << 20:
                assert r["mode"].startswith("stream"), (row["shape"], p)


def test_bench_select_assembly_and_pipeline_measure_one_and_two_assembly_threads(rng):
    """bench_select --assembly and --pipeline (small shapes): each batch and
    each mode is measured with one assembly thread and with two, and every
    figure is a positive time."""
    from tools.bench_select import bench_assembly, bench_pipeline
    asm = bench_assembly(2, rng, S=4096, batches=(1, 4))
    assert set(asm) == {1, 2}
    for t in (1, 2):
        assert set(asm[t]) == {1, 4}
        for x in asm[t].values():
            assert x["entries"] > 0 and x["total_us"] > 0 and x["assemble_us"] > 0
        assert asm[t][1]["gbps_vs_batch1"] == 1.0
    pipe = bench_pipeline(2, rng, L=2, S=2048)
    for mode in ("sequential", "pipelined", "sequential_2t", "pipelined_2t",
                 "sequential_2t_reuse"):
        assert pipe[mode]["step_us"] > 0 and pipe[mode]["retrieval_us"] > 0, mode
    assert pipe["speedup"] > 0 and pipe["speedup_2t"] > 0


def test_bench_select_session_steps_with_and_without_reused_outputs(rng):
    """bench_select --session (small shape): the three session kinds step
    and their step, retrieval and upkeep medians are positive; only the
    deferred one runs upkeep off the step's path."""
    from tools.bench_select import bench_session
    out = bench_session(3, rng, S=2048, H=2, d=64, Hq=8)
    assert out["entries"] > 0 and out["entry_bytes"] == 2 * 2 * 64 * 2
    for key in ("copy", "reuse", "deferred"):
        x = out[key]
        assert x["step_us"] > 0 and x["retrieval_us"] > 0 and x["step_us"] >= x["retrieval_us"]
        assert x["io_us"] > 0 and x["cpu_us"] > 0 and x["step_min_us"] <= x["step_us"]
        assert x["cpu_over_io"] == pytest.approx(x["cpu_us"] / x["io_us"])
    assert out["deferred"]["offpath_us"] > 10 * out["copy"]["offpath_us"]


# -- options whose defaults must follow other options; output prefixes -------------------

def _params(module, args):
    """What a tool's command line parses into (its work never runs)."""
    cmd = module.cli
    with cmd.make_context(module.__name__, list(args)) as ctx:
        return ctx.params


def test_bench_select_cluster_sizes_follow_tokens():
    """The default --cluster-sizes held four values, so a single --tokens
    value failed ("4 cluster sizes for 1 --tokens values")."""
    import click

    from tools import bench_select as B
    assert _params(B, [])["cluster_sizes"] == [14.9, 19.4, 25.2, 32.8]
    p = _params(B, ["--tokens", "32768"])
    assert p["tokens"] == [32768] and p["cluster_sizes"] == [B.default_cluster_size(32768)]
    assert 8 < p["cluster_sizes"][0] < 9                   # 14.9 x (1/4)^0.38
    assert _params(B, ["--cluster-sizes", "10", "--tokens", "32768,65536"])["cluster_sizes"] \
        == [10.0, 10.0]
    assert _params(B, ["--tokens", "4096,8192", "--cluster-sizes", "6,7"])["cluster_sizes"] \
        == [6.0, 7.0]
    with pytest.raises(click.UsageError, match="3 cluster sizes for 2 --tokens"):
        _params(B, ["--cluster-sizes", "6,7,8", "--tokens", "4096,8192"])


def test_bench_decode_compare_parses_method_at_ratio():
    """throughput --compare METHOD@R: a baseline at its own r; anything else
    is a usage error naming the value."""
    import click

    from tools import bench_decode as B
    assert _params(B, ["throughput"])["compare"] == ()
    assert _params(B, ["throughput", "--compare", "quest@0.3", "--compare", "pqcache@1"]
                   )["compare"] == (("quest", 0.3), ("pqcache", 1.0))
    for bad in ("quest", "quest@", "quest@0", "quest@1.5", "quest@x", "dense@0.1", "@0.1"):
        with pytest.raises(click.BadParameter, match=re.escape(bad)):
            _params(B, ["throughput", "--compare", bad])


def test_bench_select_query_heads_follow_kv_heads():
    """The default --query-heads 64 refused any --kv-heads that does not
    divide 64."""
    import click

    from tools import bench_select as B
    assert (_params(B, [])["kv_heads"], _params(B, [])["query_heads"]) == (8, 64)
    assert _params(B, ["--kv-heads", "6"])["query_heads"] == 48
    assert _params(B, ["--query-heads", "12", "--kv-heads", "6"])["query_heads"] == 12
    with pytest.raises(click.UsageError, match="multiple of the KV heads"):
        _params(B, ["--query-heads", "64", "--kv-heads", "6"])


@pytest.mark.parametrize("module,suffixes", [("bench_select", (".json",)),
                                             ("bench_engine", (".json", ".png"))])
def test_an_output_prefix_given_with_its_suffix_is_not_doubled(tmp_path, module, suffixes):
    """bench_select --out X.json wrote X.json.json (bench_engine also X.json.png)."""
    import importlib
    mod = importlib.import_module(f"tools.{module}")
    for suffix in suffixes:
        assert _params(mod, ["--out", str(tmp_path / f"r{suffix}")])["out"] == str(tmp_path / "r")
    assert _params(mod, ["--out", str(tmp_path / "r")])["out"] == str(tmp_path / "r")
    assert _params(mod, ["--out", str(tmp_path / "r.v2")])["out"] == str(tmp_path / "r.v2")
    assert _params(mod, ["--out", str(tmp_path / ".json")])["out"] == str(tmp_path / ".json")


def test_bench_engine_min_requests_follow_max_requests():
    """--max-requests below the default --min-requests (4000) made min >
    max (np.clip then quietly took the max); now the default follows
    --max-requests, and min > max is a usage error."""
    import click

    from tools import bench_engine as B
    p = _params(B, [])
    assert (p["min_requests"], p["max_requests"]) == (4000, 100000)
    assert _params(B, ["--max-requests", "1000"])["min_requests"] == 1000
    assert _params(B, ["--min-requests", "50", "--max-requests", "100"])["min_requests"] == 50
    with pytest.raises(click.UsageError, match="more than --max-requests 1000"):
        _params(B, ["--min-requests", "5000", "--max-requests", "1000"])


def test_bench_engine_plans_over_the_whole_of_each_file_as_fio_reads_it(tmp_path):
    """An existing disk file larger than --disk-size was read by fio whole
    but by the engine's plan only in its first --disk-size bytes (the 0.76x
    at 128 KiB on tmpfs was that range, not the engine); the plan's range is
    now the smallest file's size, and a missing or short file is made."""
    from tools import bench_engine as B
    mib = 1 << 20
    (tmp_path / "disk0.bin").write_bytes(b"\1" * (3 * mib))
    (tmp_path / "disk1.bin").write_bytes(b"\2" * (4 * mib))
    paths, size = B.disk_files(str(tmp_path), 3, 2 * mib)
    assert [os.path.getsize(p) for p in paths] == [3 * mib, 4 * mib, 2 * mib]
    assert size == 2 * mib                       # disk2 was made at --disk-size
    paths, size = B.disk_files(str(tmp_path), 2, 2 * mib)
    assert size == 3 * mib                       # both existing files, read whole
    plan = B.make_plan(np.random.default_rng(0), 2, size, 64 << 10, 5000, 4)
    assert int(plan[1].max()) + (64 << 10) > 2 * mib      # beyond --disk-size
    assert int(plan[1].max()) + (64 << 10) <= size


def test_bench_mount_sweep_reads_only_the_clusters_it_built(monkeypatch, tmp_path):
    """--readahead-sweep read clusters 0-3 and ran 4 dd whatever
    --big-clusters and --concurrent said (the store holds max of the two)."""
    from tools import bench_mount as B
    built = {}
    monkeypatch.setattr(B, "build_big", lambda path, **kw: built.update(kw))
    monkeypatch.setattr(B, "build_wide", lambda path, **kw: None)
    monkeypatch.setattr(B.Store, "open", staticmethod(lambda path: None))

    def sweep(*args, **kw):
        raise Parsed(kw)
    monkeypatch.setattr(B, "readahead_sweep", sweep)
    for big, conc in ((2, 1), (2, 6)):
        with pytest.raises(Parsed) as got:
            B.main(["--dir", str(tmp_path), "--readahead-sweep", "128", "--big-clusters",
                    str(big), "--concurrent", str(conc)])
        assert got.value.args[0] == {"clusters": max(big, conc), "concurrent": conc}
        assert built["clusters"] == max(big, conc)


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process, all its threads (/proc/PID/stat)."""
    f = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.slow
def test_bench_select_busy_core_keeps_one_core_busy():
    """--busy stands for the model keeping the other core busy: one core.
    It set OPENBLAS_NUM_THREADS after numpy had started its pool, so the
    child's matrix products ran on both cores (its CPU time was about twice
    its wall time on an idle 2-core machine), and one-thread selection
    was slowed as much as two threads."""
    import time

    from tools.bench_select import _BusyCore
    with _BusyCore() as busy:
        c0, t0 = _cpu_seconds(busy.proc.pid), time.monotonic()
        time.sleep(2.0)
        cores = (_cpu_seconds(busy.proc.pid) - c0) / (time.monotonic() - t0)
    assert 0.2 < cores < 1.2, cores
