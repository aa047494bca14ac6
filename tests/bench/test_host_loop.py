"""benchmarks/engine/host_loop.py runs closed loop on a toy model on CPU (the H200 run is the real one), and
its profile reading turns step intervals into device step time and idle gaps."""

from __future__ import annotations

import json

import pytest

from benchmarks.engine.host_loop import Case, gaps_summary, top_ops
from tests.bench.run_module import run_benchmark


@pytest.mark.parametrize("bank", ["padded", "unified"])
def test_host_loop_smoke(tmp_path, bank):
    cmd = [
        "engine.host_loop",
        "--tiny",
        "--one-budget",
        "--layers",
        "1",
        "--cases",
        "4:2",
        "--prompt-len",
        "4",
        "--gen-len",
        "8",
        "--steps",
        "10",
        "--warmup-steps",
        "4",
        "--replay-steps",
        "2",
        "--profile-steps",
        "2",
        "--probe-reps",
        "1",
        "--bank",
        bank,
        "--out",
        str(tmp_path),
    ]
    run = run_benchmark(*cmd)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads((tmp_path / "host_loop.json").read_text())
    assert not result["failed"] and len(result["cases"]) == 1
    case = result["cases"][0]
    assert case["bank"] == bank and case["batch"] == 4 and case["steps"] >= 10 and case["compiles_after_warmup"] == 0
    host = case["host_ms_per_step"]
    assert all(host[k] > 0 for k in ("schedule_ms", "inputs_ms", "dispatch_ms", "stream_ms"))
    assert host["host_ms"] == pytest.approx(
        sum(host[k] for k in ("schedule_ms", "inputs_ms", "dispatch_ms", "stream_ms")), abs=1e-3
    )
    assert case["wall_ms_per_step"] >= host["host_ms"] and case["device_step_ms"] > 0
    assert case["decode_tokens_per_step"] > 0
    assert case["profile"] == {"available": False, "reason": case["profile"]["reason"]}  # no GPU plane on CPU
    assert all(case["dispatch_probe"][f"{k}_ms_median"] > 0 for k in ("packed", "fields"))
    # The compiled step orders the adapter reads around the in-place KV write: no pool copy.
    assert case["pool_copies"]["count"] == 0 and len(case["pool_copies"]["pool_shape"]) == 5


def test_gaps_come_from_step_intervals():
    """Three steps of 10 ms with idle gaps of 1 and 3 ms (ns intervals), two host->device copies."""
    ms = 1_000_000
    steps = [(0, 10 * ms), (11 * ms, 21 * ms), (24 * ms, 34 * ms)]
    out = gaps_summary(steps, [(5 * ms, 5 * ms + 10), (12 * ms, 12 * ms + 10)])
    assert out["device_step_ms_mean"] == 10.0 and out["gap_ms_mean"] == 2.0 and out["gap_ms_max"] == 3.0
    assert out["idle_share"] == round(4 / 34, 4) and out["h2d_copies_per_step"] == round(2 / 3, 2)
    with pytest.raises(ValueError, match="two steps"):
        gaps_summary(steps[:1], [])


def test_top_ops_rank_by_time_per_step():
    ms = 1_000_000
    names = [("copy.1", 5 * ms), ("gemm", 2 * ms), ("copy.1", 5 * ms), ("gemm", 2 * ms), ("rope", ms)]
    assert top_ops(names, steps=2, top=2) == [("copy.1", 5.0, 1.0), ("gemm", 2.0, 1.0)]


def test_case_parsing():
    assert Case.parse("64:16") == Case(batch=64, distinct=16)
    for bad in ("0:0", "4:5", "4:-1"):
        with pytest.raises(ValueError):
            Case.parse(bad)
