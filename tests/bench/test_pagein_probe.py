"""python -m benchmarks.probes.pagein runs end to end at toy size on CPU through the device runner
(benchmarks/run.sh), renders its tables, and lands in its dated run folder with the run's record."""

from __future__ import annotations

import datetime
import json

from tests.bench.run_module import run_benchmark


def test_pagein_probe_smoke_through_the_runner(tmp_path):
    run = run_benchmark("run", "--out", str(tmp_path), "--label", "smoke", "probes.pagein", "--tiny", "--reps", "1")
    folder = tmp_path / "probes" / "pagein" / "runs" / f"{datetime.date.today():%Y-%m-%d}-smoke"
    log = (folder / "log.txt").read_text() if (folder / "log.txt").exists() else run.stdout + run.stderr
    assert run.returncode == 0, log[-2000:]
    record = json.loads((folder / "run.json").read_text())
    assert record["returncode"] == 0 and record["command"][:3] == ["python", "-m", "benchmarks.probes.pagein"]
    assert record["command"][-2:] == ["--out", str(folder)]
    result = json.loads((folder / "pagein_probe.json").read_text())
    for section in ("size_curve", "copies_only", "burst", "overlap", "loop"):
        assert result[section] and all("error" not in r for r in result[section]), section
    assert {r["how"] for r in result["loop"]} == {"none", "after", "split", "split1", "lagged"}
    assert all(r["ms_per_step"] > 0 for r in result["loop"])
    md = (folder / "pagein_probe.md").read_text()
    assert md.startswith("# Page-in probe") and "| how | k |" in md
