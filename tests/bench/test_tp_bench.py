"""python -m benchmarks.step.tp --tiny on two fake CPU devices: every case runs (the timed loops compile
nothing, or the case fails), TP 1 and TP 2 give the same greedy tokens, each GPU's floor shrinks
with TP 2, and the results carry what the H200 run reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("tp")
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(ROOT),
    }
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.step.tp",
        "--tiny",
        "--steps",
        "2",
        "--greedy-steps",
        "6",
        "--out",
        str(out),
    ]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return out, json.loads((out / "tp.json").read_text())


def test_every_case_ran(results):
    _, payload = results
    assert payload["not_run"] == []
    cells = {(r["model"], r["tensor"], r["bank"], r["distinct"]) for r in payload["rows"]}
    assert cells == {
        ("tiny", 1, True, 4),
        ("tiny", 1, True, 0),
        ("tiny", 2, True, 4),
        ("tiny", 2, True, 0),
        ("tiny-gqa", 2, False, 0),
    }
    assert payload["num_devices"] == 2 and payload["backend"] == "xla"


def test_greedy_tokens_match_between_tp1_and_tp2(results):
    _, payload = results
    [greedy] = payload["greedy"]
    assert greedy["compare"] == "tiny/B4/tp1 vs tp2"
    assert greedy["identical_rows"] == greedy["rows"] == 4 and greedy["steps"] == 6 and greedy["same_weights"]
    assert any(t["target"].startswith("greedy tokens identical") and t["met"] for t in payload["targets"])


def test_per_gpu_floor_shrinks_and_compiles_are_timed(results):
    _, payload = results
    rows = payload["rows"]
    for r in rows:
        assert r["step_ms"] > 0 and r["floor_ms"] > 0 and r["tokens_per_s"] > 0
    floor = {(r["model"], r["tensor"], r["distinct"]): r["floor_ms"] for r in rows if r["bank"]}
    for d in (0, 4):  # each GPU reads half the weights and KV heads (and part of each adapter)
        assert floor[("tiny", 2, d)] < floor[("tiny", 1, d)]
    assert floor[("tiny", 1, 4)] > floor[("tiny", 1, 0)]  # distinct adapters add bytes
    firsts = [r for r in rows if "compile_s" in r]
    assert len(firsts) == 3 and all(r["lower_s"] > 0 and r["compile_s"] > 0 for r in firsts)


def test_allreduce_probe_and_markdown(results):
    out, payload = results
    [probe] = payload["allreduce"]
    assert probe["all_reduces"] == 2 * 2 + 1 and probe["chain_ms"] > 0  # tiny: 2 layers
    assert payload["profile"] == {"skipped": "needs a GPU"}
    md = (out / "tp.md").read_text()
    assert md.startswith("# Tensor parallelism") and "## Targets" in md and "| tiny-gqa | 2 | 4 | False |" in md
