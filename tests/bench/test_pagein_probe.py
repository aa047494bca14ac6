"""python -m benchmarks.probes.pagein runs end to end at toy size on CPU and renders its tables."""

from __future__ import annotations

import json

from tests.bench.run_module import run_benchmark


def test_pagein_probe_smoke(tmp_path):
    cmd = [
        "probes.pagein",
        "--tiny",
        "--reps",
        "1",
        "--out",
        str(tmp_path),
    ]
    run = run_benchmark(*cmd)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads((tmp_path / "pagein_probe.json").read_text())
    for section in ("size_curve", "copies_only", "burst", "overlap", "loop"):
        assert result[section] and all("error" not in r for r in result[section]), section
    assert {r["how"] for r in result["loop"]} == {"none", "after", "split", "split1", "lagged"}
    assert all(r["ms_per_step"] > 0 for r in result["loop"])
    md = (tmp_path / "pagein_probe.md").read_text()
    assert md.startswith("# Page-in probe") and "| how | k |" in md
