"""python -m benchmarks.engine.paging runs on the CPU at toy size and writes the fields the paging issue asks for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROW_KEYS = {
    "registered",
    "slots",
    "popularity_exponent",
    "tokens_per_s",
    "all_resident_tokens_per_s",
    "page_ins",
    "page_in_ms_p50",
    "page_in_GBps",
    "step_ms_paging",
    "step_ms_no_paging",
}


def run_bench(out: Path, *args: str) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.engine.paging", "--tiny", "--out", str(out), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "paging.json").read_text())


def test_tiny_paging_benchmark_writes_the_issue_fields(tmp_path):
    payload = run_bench(tmp_path, "--setting", "s1", "--exponents", "1", "--registered", "20", "--host-gb", "1")
    assert isinstance(payload["device"], str) and isinstance(payload["jax_version"], str)
    assert "h2d_pinned_GBps" in payload and payload["not_run"] == []
    (row,) = payload["rows"]
    assert ROW_KEYS <= set(row)
    assert row["registered"] == 20 and row["page_ins"] > 0 and row["page_in_GBps"] > 0
    assert row["tokens_per_s"] > 0 and row["all_resident_tokens_per_s"] > 0
    assert row["compiles_after_warmup"] == 0 and row["steps_with_page_ins"] > 0
    assert abs(row["throughput_vs_resident"] - row["tokens_per_s"] / row["all_resident_tokens_per_s"]) < 1e-3
    assert (tmp_path / "paging.md").read_text().startswith("# Adapter paging")


def test_budget_stops_adding_cases_and_still_writes(tmp_path):
    payload = run_bench(tmp_path, "--budget-s", "0")
    assert payload["rows"] == [] and payload["not_run"] == ["s1", "full"]
