"""python -m benchmarks.quant_gemm runs end to end on toy shapes on CPU (the H200 run is the real one)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quant_gemm_smoke(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.quant_gemm", "--tiny", "--batch", "2", "--out", str(tmp_path)]
    run = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads((tmp_path / "quant_gemm.json").read_text())["rows"]
    assert [r["format"] for r in rows] == ["bf16", "int8", "fp8", "fp8-native"]
    assert all(r["ms"] > 0 and r["floor_ms"] > 0 for r in rows)
    # TINY: 2 layers x 30,720 projection weights (hidden 64, k/v 32 wide, intermediate 96) and 448 output
    # channels: bf16 2 x 30,720 x 2 = 122,880 bytes; quantized 2 x (30,720 + 448 x 4) = 65,024 bytes.
    assert [r["weight_bytes"] for r in rows] == [122_880, 65_024, 65_024, 65_024]
