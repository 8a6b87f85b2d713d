"""Summaries of recorded and streamed steps: medians of the counts and
times, means of the accuracy."""

from __future__ import annotations

import statistics

import numpy as np


def median(rows, key):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return float(statistics.median(vals)) if vals else None


def mean(rows, key):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return float(np.mean(vals)) if vals else None


STEP_KEYS = ("score_us", "select_us", "plan_us", "io_us_live", "bytes_read", "useful_bytes",
             "needed_bytes",
             "requests", "mean_request_kib", "max_mean_load", "entries", "entries_dram",
             "useful_entries", "clusters")
ACC_KEYS = ("recall", "rel_error", "oracle_rel_error", "mass", "oracle_mass")


def summarize(rec: list, timed: dict) -> dict:
    """Per variant: medians of the recorded steps' counts and selection
    times, means of their accuracy, and the streamed I/O time per step and
    effective bandwidth (median over repetitions of the block values)."""
    out = {f"{k}_median": median(rec, k) for k in STEP_KEYS}
    out["io_us_median"] = float(statistics.median(timed["io_us"]))
    out["io_us_reps"] = timed["io_us"]
    out["engine_us_median"] = float(statistics.median(timed["engine_us"]))
    out["eff_gbps_median"] = float(statistics.median(timed["eff_gbps"]))
    out["read_gbps_median"] = float(statistics.median(timed["read_gbps"]))
    out["goodput_gbps_median"] = (float(statistics.median(timed["goodput_gbps"]))
                                  if timed["goodput_gbps"] else None)
    out["step_us_median"] = float(statistics.median(timed["step_us"]))
    out["step_us_p90"] = float(np.percentile(timed["step_us"], 90))
    out["steps"] = len(rec)
    out["reps"] = len(timed["io_us"])
    if rec and "recall" in rec[0]:
        for k in ACC_KEYS:
            out[f"{k}_mean"] = mean(rec, k)
    return out
