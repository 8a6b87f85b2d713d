"""The long-context suite and the frontier benchmark run end to end (issues 22, 23)."""

import json

import pytest

pytestmark = [pytest.mark.model, pytest.mark.slow]


def test_frontier_at_full_budget_recalls_everything(tmp_path):
    from tools import frontier
    out = tmp_path / "f.json"
    frontier.main(["--kinds", "python", "--tokens", "1024", "--queries", "3", "--ratios", "1.0",
                   "--ratios", "0.1", "--taus", "0.9", "--caps", "8", "--reps", "medoid",
                   "--reps", "bounds", "--reps", "centroids2", "--reps", "oracle",
                   "--pages", "16", "--blocks", "64", "--means", "16",
                   "--cache", str(tmp_path / "c"), "--out", str(out), "--plots", str(tmp_path)])
    pts = json.loads(out.read_text())["points"]
    assert {p["family"] for p in pts} == {"swarm", "quest", "infllm", "pqcache",
                                          "cluster-oracle"}
    for p in pts:
        assert 0.0 < p["recall"] <= 1.0 + 1e-9
        if p["ratio"] == 1.0:
            assert p["recall"] == pytest.approx(1.0) and p["output_error"] < 1e-5
    quest = next(p for p in pts if p["config"] == "quest page=16" and p["ratio"] == 0.1)
    assert quest["entries_per_cluster"] == 16.0
    # Quest's index is two float16 keys per page of 16: 1/16 of the float16 K and V
    assert quest["index_fraction"] == pytest.approx(1 / 16)
    # on the same clusters: the mass oracle bounds every representative's
    # recall; two centroids cost twice one medoid's DRAM
    at = {p["config"].split()[-1]: p for p in pts
          if p["family"] != "quest" and "swarm" in p["config"] and p["ratio"] == 0.1}
    assert at["oracle"]["recall"] >= max(at[r]["recall"] for r in ("medoid", "bounds",
                                                                    "centroids2")) - 1e-9
    assert at["centroids2"]["index_fraction"] == pytest.approx(2 * at["medoid"]["index_fraction"])
    assert (tmp_path / "frontier_python.png").exists()


def test_suite_quick_at_full_budget_matches_dense(tmp_path):
    from tools import suite
    out = tmp_path / "s.json"
    suite.main(["--quick", "--ratios", "1.0", "--methods", "dense", "--methods", "swarm",
                "--methods", "oracle", "--workdir", str(tmp_path), "--out", str(out),
                "--plots", str(tmp_path)])
    res = json.loads(out.read_text())
    rows = {(r["part"], r["method"]): r for r in res["runs"]}
    # r = 1 selects every context entry: the same predictions as dense
    for m in ("swarm", "oracle"):
        assert rows[("tasks", m)]["exact"] == rows[("tasks", "dense")]["exact"]
        assert rows[("text", m)]["kl"] < 1e-4
    assert rows[("tasks", "swarm")]["dram_fraction"] > 0
    assert (tmp_path / "suite_accuracy_vs_r.png").exists()
