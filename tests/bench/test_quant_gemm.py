"""python -m benchmarks.quant_gemm runs end to end on toy shapes on CPU (the H200 run is the real one)."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.quant_gemm import w8a8_kmajor
from jaxlora.model.quant import Quantization, quantize
from tests.bench.run_module import run_benchmark


def test_quant_gemm_smoke(tmp_path):
    flags = ["--tiny", "--batch", "2", "--tune", "3", "--out", str(tmp_path)]
    cmd = ["quant_gemm", *flags]
    run = run_benchmark(*cmd)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads((tmp_path / "quant_gemm.json").read_text())["rows"]
    # Grouped by how the weights are stored (each kind drawn once); the --tune rows follow int8's.
    formats = ["bf16", "bf16-fused", "int8", "int8-pallas", "int8-kmajor", "int8-kmajor-layers"]
    formats += ["int8-pallas"] * 3 + ["fp8", "fp8-native", "fp8-pallas", "fp8-kmajor", "fp8-kmajor-layers"]
    assert [r["format"] for r in rows] == formats
    assert [r["batch"] for r in rows] == [2] * 6 + [3] * 3 + [2] * 5
    assert [r.get("knobs") is not None for r in rows] == [False] * 6 + [True] * 3 + [False] * 5
    assert all(r["ms"] > 0 and r["floor_ms"] > 0 for r in rows)
    # TINY: 2 layers x 30,720 projection weights (hidden 64, k/v 32 wide, intermediate 96) and 448 output
    # channels: bf16 2 x 30,720 x 2 = 122,880 bytes; quantized 2 x (30,720 + 448 x 4) = 65,024 bytes.
    assert [r["weight_bytes"] for r in rows] == [122_880] * 2 + [65_024] * 12


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_kmajor_w8a8_matches_the_dense_product(fmt):
    # The K-major formats time x @ W with W stored [out, in] and x quantized per row: their product
    # must still be x @ W (a transposed or mis-scaled operand would time garbage).
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((8, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((64, 48)) * 0.05, jnp.float32)
    q, scale = quantize(w, Quantization(fmt))
    got = np.asarray(w8a8_kmajor(x, jnp.swapaxes(q, 0, 1), scale), np.float32)
    want = np.asarray(x, np.float32) @ np.asarray(w)
    assert np.abs(got - want).max() <= 0.06 * np.abs(want).max()
