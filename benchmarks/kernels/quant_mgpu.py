"""The Mosaic GPU 8-bit GEMM (`pallas_kernels/quant/mgpu.py`) on the GPU: checked against a
float64 reference, then timed per serving-layout GEMM and over the projections of whole layers,
against bf16 cuBLAS and the Triton int8 kernel in the same process.

Stages (each row is written to mgpu.json as soon as it is measured; `--stages` picks them):

  check  the kernel's output on random data against a float64 numpy x @ (q[layer] * scale[layer]).T,
         in units of sum_k |x * w| (a dot's rounding scales with its terms), on awkward and 7B
         shapes, every variant (register or shared-memory A operand, direct or staged epilogue),
         int8 and e4m3, and every row of the tuning table at the 7B shapes.
  gemm   each GEMM of the 7B serving layout (q|k|v, o, gate|up, down) over `--layers` distinct
         layers (more bytes than L2 holds), per batch and knob candidate: us per GEMM and the weight
         bytes streamed per second.
  step   the seven projections of `--layers` layers in the serving layout (the quant_gemm.py
         step): bf16 cuBLAS, the Triton int8 kernel, the Mosaic kernel with the per-GEMM knobs
         that the gemm stage found fastest (the MgpuKnobs defaults where it did not run; "mgpu"),
         and with the tuning table's knobs the engine runs, on int8 and e4m3 weights ("table",
         "table-fp8").

    python -m benchmarks.kernels.quant_mgpu [--stages check gemm step] [--batch 16 64 128 256]
        [--layers 8] [--time-budget S] [--gemm-budget S] --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import LLAMA2_7B, best_ms, hbm_gbps
from benchmarks.kernels.quant_gemm import fused_layer
from pallas_kernels.quant.mgpu import MgpuKnobs, quant_matmul_mgpu
from pallas_kernels.quant.triton import quant_matmul
from pallas_kernels.quant.tuning import mgpu_knobs

CUBLAS = {"xla_gpu_enable_triton_gemm": False}
# (name, N, K) of the serving layout's GEMMs on the 7B shape.
GEMMS = (
    ("qkv", LLAMA2_7B.q_size + 2 * LLAMA2_7B.kv_size, LLAMA2_7B.hidden_size),
    ("o_proj", LLAMA2_7B.hidden_size, LLAMA2_7B.q_size),
    ("gate_up", 2 * LLAMA2_7B.intermediate_size, LLAMA2_7B.hidden_size),
    ("down_proj", LLAMA2_7B.hidden_size, LLAMA2_7B.intermediate_size),
)
FP8_CHECKS = (  # (M, N, K, knobs) on e4m3 weights
    (24, 192, 384, MgpuKnobs(tile_n=64, tile_k=128, min_ctas=8)),
    (64, 12288, 4096, MgpuKnobs(tile_n=64, tile_k=128, compute_wgs=2, stages=6)),
    (16, 4096, 11008, MgpuKnobs(tile_n=64, tile_k=128, stages=6)),
    (200, 22016, 4096, MgpuKnobs(tile_n=64, tile_k=64, compute_wgs=2, stages=4)),
)
CHECKS = (  # (M, N, K, knobs)
    (1, 128, 256, MgpuKnobs(tile_n=64, tile_k=64, splits=2)),
    (24, 192, 384, MgpuKnobs(tile_n=64, tile_k=128, min_ctas=8)),
    (24, 192, 384, MgpuKnobs(tile_n=64, tile_k=128, min_ctas=8, out_via_smem=True)),
    (24, 192, 384, MgpuKnobs(tile_n=64, tile_k=128, min_ctas=8, a_in_smem=True)),
    (8, 128, 96, MgpuKnobs(tile_n=128, tile_k=32)),
    (64, 12288, 4096, MgpuKnobs()),
    (16, 4096, 11008, MgpuKnobs(tile_k=64)),
    (256, 22016, 4096, MgpuKnobs(tile_k=64)),
    (200, 4096, 4096, MgpuKnobs(tile_k=64, stages=3)),
    (1, 256, 256, MgpuKnobs(tile_n=64, tile_k=64, compute_wgs=2, splits=2)),
    (24, 512, 384, MgpuKnobs(tile_n=64, tile_k=128, compute_wgs=2, min_ctas=8)),
    (24, 512, 384, MgpuKnobs(tile_n=64, tile_k=128, compute_wgs=2, cluster=2, min_ctas=8)),
    (64, 12288, 4096, MgpuKnobs(tile_n=128, tile_k=64, compute_wgs=2, cluster=2)),
    (256, 4096, 11008, MgpuKnobs(tile_n=64, tile_k=64, compute_wgs=2, stages=4)),
)


# The tuning table's rows as the engine runs them (quant_mgpu_tuning.mgpu_knobs), at each bucket's
# largest row count, on every GEMM of the 7B serving layout.
TABLE_CHECKS = tuple((b, n, k, mgpu_knobs(b, n, k)) for b in (16, 64, 128, 256) for _, n, k in GEMMS)


def candidates(batch: int) -> list[MgpuKnobs]:
    """Knob sets to time at `batch` rows: (tile_n, tile_k, stages, compute_wgs, cluster, min_ctas).
    Shared memory per stage: cta_cols * tile_k weight bytes plus batch * tile_k * 2 bytes of x (the
    H200 gives a CTA up to 227 KB); a compute warpgroup's accumulator holds tile_n * batch / 128
    floats a thread (at most ~128 of its registers, or it spills)."""
    if batch <= 32:
        sets = [(64, 128, 6, 1, 1, 132), (256, 128, 3, 1, 1, 132), (64, 128, 6, 2, 1, 132), (128, 128, 4, 2, 1, 132)]
        sets += [(64, 64, 8, 2, 1, 132), (64, 128, 6, 2, 2, 132), (128, 128, 4, 2, 2, 132), (64, 64, 6, 2, 1, 264)]
    elif batch <= 64:
        sets = [(64, 64, 8, 1, 1, 132), (64, 64, 8, 2, 1, 132), (64, 128, 6, 2, 1, 132), (128, 64, 6, 2, 1, 132)]
        sets += [(128, 128, 4, 2, 1, 132), (64, 128, 6, 2, 2, 132), (128, 64, 6, 2, 2, 132), (128, 128, 4, 2, 2, 132)]
        sets += [(64, 64, 6, 2, 1, 264)]
    elif batch <= 128:
        sets = [(64, 64, 6, 1, 1, 132), (64, 64, 6, 2, 1, 132), (128, 64, 6, 2, 1, 132), (64, 128, 4, 2, 1, 132)]
        sets += [(64, 64, 6, 2, 2, 132), (128, 64, 6, 2, 2, 132), (128, 128, 3, 2, 2, 132)]
    else:
        sets = [(64, 64, 6, 1, 1, 132), (64, 64, 4, 2, 1, 132), (64, 64, 5, 2, 1, 132), (64, 64, 4, 2, 2, 132)]
        sets += [(64, 128, 2, 2, 2, 132)]
    return [
        MgpuKnobs(tile_n=n, tile_k=k, stages=st, compute_wgs=wgs, cluster=c, min_ctas=mc)
        for n, k, st, wgs, c, mc in sets
    ]


def int8_stack(layers: int, n: int, k: int, seed: int) -> tuple[jax.Array, jax.Array]:
    """(q [L, N, K] int8 drawn on the device, scale [L, N] f32)."""
    q = jax.random.randint(jax.random.key(seed), (layers, n, k), -127, 128, jnp.int8)
    return q, jax.random.uniform(jax.random.key(seed + 1), (layers, n), jnp.float32, 1e-3, 2e-3)


def check_row(m: int, n: int, k: int, knobs: MgpuKnobs, fp8: bool = False) -> dict:
    x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16) + 0.5
    q, scale = int8_stack(3, n, k, seed=n + k)
    if fp8:  # e4m3 values of the same magnitudes, every one a different bit pattern than int8's
        q = (q.astype(jnp.float32) * 3.3).astype(jnp.float8_e4m3fn)
    got = jax.jit(lambda x, q, s, layer: quant_matmul_mgpu(x, q, s, layer, knobs))(x, q, scale, jnp.int32(1))
    w = np.asarray(q[1], np.float64) * np.asarray(scale[1], np.float64)[:, None]
    xf = np.asarray(x, np.float64)
    unit = np.abs(xf) @ np.abs(w).T
    err = np.abs(np.asarray(got, np.float64) - xf @ w.T) / unit
    return {"max_err": float(err.max()), "ok": bool(err.max() < 1e-2)}


def gemm_fn(knobs: MgpuKnobs | None, layers: int):
    """8 layers of one GEMM on the same x, summed (the [M, N] adds are small next to the weights):
    knobs None is bf16 cuBLAS on [L, K, N] weights; "triton" the Triton kernel on [L, K, N] int8."""

    def run(x, q, scale):
        out = 0
        for layer in range(layers):
            if knobs is None:
                out = out + x @ q[layer]
            elif knobs == "triton":
                out = out + quant_matmul(x, q, scale, jnp.int32(layer))
            else:
                out = out + quant_matmul_mgpu(x, q, scale, jnp.int32(layer), knobs)
        return out

    return jax.jit(run, compiler_options=CUBLAS)


def step_fn(kind: str, knobs: dict[str, MgpuKnobs], layers: int):
    """The serving layout's projections of `layers` layers (quant_gemm.fused_layer, as quant_gemm.py
    times them)."""
    cfg = LLAMA2_7B

    def gemm(h, w, name, layer):
        if kind == "bf16":
            return h @ w[layer]
        if kind == "triton":
            return quant_matmul(h, *w, jnp.int32(layer))
        if kind.startswith("table"):  # what the engine runs: quant_mgpu_tuning.mgpu_knobs
            q = w[0]
            return quant_matmul_mgpu(h, *w, jnp.int32(layer), mgpu_knobs(h.shape[0], q.shape[1], q.shape[2]))
        return quant_matmul_mgpu(h, *w, jnp.int32(layer), knobs[name])

    def run(w, h):
        for layer in range(layers):
            h = fused_layer(h, lambda a, name, i=layer: gemm(a, w[name], name, i), cfg.q_size, cfg.kv_size)
        return h

    return jax.jit(run, compiler_options=CUBLAS)


def main() -> None:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--stages", nargs="+", choices=("check", "gemm", "step"), default=["check", "gemm", "step"])
    p.add_argument("--batch", type=int, nargs="+", default=[64, 16, 256, 128])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--time-budget", type=float, default=None, metavar="S", help="start no case after S seconds")
    p.add_argument("--step-kinds", nargs="+", default=["bf16", "triton", "mgpu", "table", "table-fp8"])
    p.add_argument("--gemm-budget", type=float, default=None, metavar="S", help="start no gemm case after S seconds")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    started = time.perf_counter()
    hbm = hbm_gbps()
    result: dict = {"device": jax.devices()[0].device_kind, "jax_version": jax.__version__, "hbm_GBps": round(hbm, 1)}
    result |= {"layers": args.layers, "check": [], "gemm": [], "step": [], "left": []}
    path = args.out / "mgpu.json"
    args.out.mkdir(parents=True, exist_ok=True)

    def record(stage: str, row: dict) -> None:
        result[stage].append(row)
        print(stage, json.dumps(row), flush=True)
        path.write_text(json.dumps(result, indent=1))

    def run_case(stage: str, row: dict, fn) -> dict | None:
        budget = args.gemm_budget if stage == "gemm" and args.gemm_budget is not None else args.time_budget
        if budget is not None and time.perf_counter() - started > budget:
            result["left"].append({"stage": stage, **row})
            return None
        try:
            row |= fn()
        except Exception as e:  # a probe: record the case that fails to compile or run, go on
            row |= {"error": f"{type(e).__name__}: {str(e)[:600]}"}
        record(stage, row)
        return row

    if "check" in args.stages:
        for fp8, checks in ((False, CHECKS + TABLE_CHECKS), (True, FP8_CHECKS)):
            for m, n, k, knobs in checks:
                row = {"m": m, "n": n, "k": k, "fp8": fp8, "knobs": dataclasses.asdict(knobs)}
                run_case("check", row, lambda: check_row(m, n, k, knobs, fp8))

    best: dict[tuple[str, int], tuple[float, MgpuKnobs]] = {}
    if "gemm" in args.stages:
        for batch in args.batch:  # batch-major: a run cut short has every GEMM of its first batches
            for name, n, k in GEMMS:
                q, scale = int8_stack(args.layers, n, k, seed=7)
                qt = jnp.swapaxes(q, 1, 2)  # [L, K, N] for cuBLAS (as bf16) and the Triton kernel
                wbf = qt.astype(jnp.bfloat16)
                x = jax.random.normal(jax.random.key(batch), (batch, k), jnp.bfloat16)
                nbytes = args.layers * n * k

                def time_one(knobs, operands, width=1):
                    ms = best_ms(gemm_fn(knobs, args.layers), *operands)
                    us = ms * 1e3 / args.layers
                    return {"us": round(us, 2), "weight_TBps": round(nbytes * width / (ms * 1e-3) / 1e12, 3)}

                base = {"gemm": name, "n": n, "k": k, "batch": batch}
                run_case("gemm", {**base, "impl": "bf16-cublas"}, lambda: time_one(None, (x, wbf, scale), 2))
                run_case("gemm", {**base, "impl": "int8-triton"}, lambda: time_one("triton", (x, qt, scale)))
                for knobs in candidates(batch):
                    row = run_case(
                        "gemm",
                        {**base, "impl": "int8-mgpu", "knobs": dataclasses.asdict(knobs)},
                        lambda: time_one(knobs, (x, q, scale)),
                    )
                    if row and "us" in row and row["us"] < best.get((name, batch), (float("inf"),))[0]:
                        best[(name, batch)] = (row["us"], knobs)
                del q, qt, wbf, scale

    if "step" in args.stages:
        stacks = {name: int8_stack(args.layers, n, k, seed=3) for name, n, k in GEMMS}
        fp8_stacks = {name: (q.astype(jnp.float8_e4m3fn), s) for name, (q, s) in stacks.items()}
        for kind in args.step_kinds:
            if kind in ("mgpu", "table"):
                w = stacks
            elif kind == "table-fp8":
                w = fp8_stacks
            else:
                w = {name: (jnp.swapaxes(q, 1, 2), s) for name, (q, s) in stacks.items()}
                if kind == "bf16":
                    w = {name: q.astype(jnp.bfloat16) for name, (q, _) in w.items()}
            for batch in args.batch:
                knobs = {name: best.get((name, batch), (None, MgpuKnobs()))[1] for name, _, _ in GEMMS}
                x = jax.random.normal(jax.random.key(batch), (batch, LLAMA2_7B.hidden_size), jnp.bfloat16) * 0.1
                row = {"impl": kind, "batch": batch}
                if kind == "mgpu":
                    row["knobs"] = {name: dataclasses.asdict(k) for name, k in knobs.items()}
                run_case("step", row, lambda: {"ms": round(best_ms(step_fn(kind, knobs, args.layers), w, x), 3)})
            del w
    path.write_text(json.dumps(result, indent=1))
    for r in result["step"]:
        print("step", r.get("impl"), r.get("batch"), r.get("ms"), r.get("error", ""))


if __name__ == "__main__":
    main()
