"""python -m benchmarks.kernels.quant_gemm runs end to end on toy shapes on CPU (the H200 run is the real one),
its sweep resumes where a run stopped, and every sweep candidate lowers for CUDA."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from benchmarks.kernels.quant_gemm import FORMATS, PALLAS_FLAGS, SWEEP, case_key, plan_cases, w8a8_kmajor
from jaxlora.model.quant import Quantization, quantize
from pallas_kernels.quant.triton import quant_matmul
from tests.bench.run_module import run_benchmark

H200 = AbstractMesh(
    (1,), ("x",), abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
)


def test_quant_gemm_smoke(tmp_path):
    flags = ["--tiny", "--layers", "1", "--batch", "2", "--tune", "int8-w8a8-pallas", "--out", str(tmp_path)]
    run = run_benchmark("kernels.quant_gemm", *flags)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads((tmp_path / "quant_gemm.json").read_text())
    rows = result["rows"]
    assert not [r for r in rows if "error" in r], [r["error"] for r in rows if "error" in r]
    # Grouped by how the weights are stored (each kind drawn once); a kind's table rows first, then the
    # other candidates of the --tune format (its {} row is the one --formats has too).
    int8 = ["int8", "int8-fused", "int8-pallas", "int8-fused-pallas", "int8-kmajor", "int8-kmajor-layers"]
    int8 += ["int8-magic-pallas", "int8-w8a8-pallas"]
    fp8 = ["fp8", "fp8-fused", "fp8-native", "fp8-pallas", "fp8-fused-pallas", "fp8-kmajor", "fp8-kmajor-layers"]
    fp8 += ["fp8-w8a8-pallas"]
    tuned = len(SWEEP[("w8a8", 16)]) - 1
    assert [r["format"] for r in rows] == ["bf16", "bf16-fused", *int8, *["int8-w8a8-pallas"] * tuned, *fp8]
    assert len(rows) == len(FORMATS) + tuned and all(r["batch"] == 2 for r in rows)
    assert [r.get("candidate") for r in rows[len(int8) + 2 : len(int8) + 2 + tuned]] == list(SWEEP[("w8a8", 16)][1:])
    assert all(r["ms"] > 0 and r["floor_ms"] > 0 and r["mma_floor_ms"] is None for r in rows)  # CPU: no peak
    # TINY's first layer: 30,720 projection weights (hidden 64, k/v 32 wide, intermediate 96) and 448 output
    # channels: bf16 30,720 x 2 = 61,440 bytes; quantized 30,720 + 448 x 4 = 32,512 bytes.
    assert [r["weight_bytes"] for r in rows] == [61_440] * 2 + [32_512] * (len(rows) - 2)
    # The fastest row per (format, batch), with the knobs it ran with for the kernel's formats.
    assert set(result["best"]) == {f"{fmt} B=2" for fmt in FORMATS}
    w8a8 = [r for r in rows if r["format"] == "int8-w8a8-pallas"]
    assert result["best"]["int8-w8a8-pallas B=2"]["ms"] == min(r["ms"] for r in w8a8)
    assert all(set(r["knobs"]) >= {"block_n", "swap_ab", "k_major"} for r in w8a8)


def test_resume_records_the_case_a_dead_run_was_in_and_the_budget_leaves_the_rest(tmp_path):
    running = {"case": case_key("bf16", 2, None), "format": "bf16", "batch": 2}
    (tmp_path / "quant_gemm.json").write_text(json.dumps({"rows": [], "running": running}))
    flags = ["--tiny", "--batch", "2", "--formats", "bf16", "int8", "--resume", "--time-budget", "0"]
    run = run_benchmark("kernels.quant_gemm", *flags, "--out", str(tmp_path))
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads((tmp_path / "quant_gemm.json").read_text())
    assert [(r["format"], r["error"].split(":")[0]) for r in result["rows"]] == [("bf16", "crashed")]
    assert result["left"] == [case_key("int8", 2, None)] and "running" not in result


def test_plan_cases_draws_each_kind_once_and_runs_table_rows_first():
    cases = plan_cases(["bf16", "int8-pallas", "fp8"], ["int8-pallas", "fp8-w8a8-pallas"], [16, 64])
    kinds = [fmt.split("-")[0] for fmt, _, _ in cases]
    assert kinds == sorted(kinds, key=["bf16", "int8", "fp8"].index)
    assert len({case_key(*c) for c in cases}) == len(cases)  # int8-pallas's table row once, not twice
    int8 = [(fmt, b, c) for fmt, b, c in cases if fmt == "int8-pallas"]
    assert int8[:2] == [("int8-pallas", 16, {}), ("int8-pallas", 64, {})]
    assert len(int8) == len(SWEEP[("weight_only", 16)]) + len(SWEEP[("weight_only", 64)])
    assert ("fp8", 16, None) in cases and ("fp8-w8a8-pallas", 64, {}) in cases


@pytest.mark.parametrize("family_bucket", list(SWEEP))
def test_every_sweep_candidate_lowers_for_cuda(family_bucket):
    """A candidate that does not lower would cost a GPU run a case: lower each at the 7B up-projection
    shape for the formats it sweeps."""
    family, batch = family_bucket
    formats = ["int8-w8a8-pallas", "fp8-w8a8-pallas"] if family == "w8a8" else ["int8-pallas", "int8-magic-pallas"]
    sd = jax.ShapeDtypeStruct
    for fmt in formats:
        storage = jnp.int8 if fmt.startswith("int8") else jnp.float8_e4m3fn
        for cand in SWEEP[family_bucket]:
            q_shape = (4, 11008, 4096) if cand.get("k_major") else (4, 4096, 11008)
            args = (sd((batch, 4096), jnp.bfloat16), sd(q_shape, storage), sd((4, 11008), jnp.float32))
            fn = lambda x, q, s, layer: quant_matmul(x, q, s, layer, **PALLAS_FLAGS[fmt], **cand)  # noqa: B023
            with jax.sharding.use_abstract_mesh(H200):
                text = jax.jit(fn).trace(*args, sd((), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
            assert "__gpu$xla.gpu.triton" in text, (fmt, cand)


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
