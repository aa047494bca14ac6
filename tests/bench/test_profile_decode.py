"""python -m benchmarks.step.profile_decode runs end to end on a toy model on CPU (the H200 run is the real one)."""

from __future__ import annotations

import json

from tests.bench.run_module import run_benchmark


def test_profile_decode_smoke(tmp_path):
    cmd = [
        "step.profile_decode",
        "--tiny",
        "--batch",
        "4",
        "--no-profile",
        "--only",
        "scan/pallas-attn",
        "unroll/xla-attn",
        "lora",
        "--out",
        str(tmp_path),
    ]
    run = run_benchmark(*cmd)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads((tmp_path / "profile_decode.json").read_text())
    assert set(result["base_step_ms"]) == {"scan/pallas-attn", "unroll/xla-attn"}
    assert set(result["lora_step_ms"]) == {"xla", "ragged", "pallas"}
    assert all(v > 0 for v in [*result["base_step_ms"].values(), *result["lora_step_ms"].values()])
