"""The seven projections of the Llama-2-7B shape alone, unrolled over the layers as the engine's GPU
decode step runs them, per base weight format: time against each format's bytes floor.

  bf16          x @ W
  int8, fp8     (x @ q.astype(bf16)) * scale        jaxlora.model.quant.matmul (what the model runs)
  fp8-native    (e4m3(x / sx) @ q) * sx * scale     the H200's FP8 tensor cores; activations quantized
                                                    per row (W8A8), so not the model's numerics

floor = weight bytes (1 byte per quantized weight + float32 scales; 2 per bf16 weight) over the
device-to-device copy bandwidth of this run. `weight_buffers` counts, per dtype, the weight-shaped
buffers the compiled step's entry computation writes (parameters excluded): none means every GEMM
reads its layer's weights straight out of the stack; a bf16 / f32 count for int8 or fp8 means XLA
wrote a dequantized copy first instead of fusing the convert into the GEMM (the bytes the format
saves are then spent again); s8 / f8e4m3fn counts are copies of a layer's slice.

    python -m benchmarks.quant_gemm [--tiny] [--batch 1 16 64 256] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks.common import LLAMA2_7B, TINY, hbm_gbps
from jaxlora.config import TARGET_MODULES, ModelConfig
from jaxlora.model.quant import Quantization, matmul, quantize

FORMATS = ("bf16", "int8", "fp8", "fp8-native")
FP8 = jnp.dtype(jnp.float8_e4m3fn)


def fp8_native(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    """x [n, in] bf16 quantized per row to e4m3, times q [in, out] e4m3 on FP8 tensor cores."""
    sx = jnp.maximum(jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1, keepdims=True), 1e-12) / 448.0
    xq = (x.astype(jnp.float32) / sx).astype(FP8)
    y = jax.lax.dot(xq, q, preferred_element_type=jnp.float32)
    return (y * sx * scale).astype(x.dtype)


def projections(fmt: str) -> Callable:
    """(h [n, D], layer weights) -> h after the seven projections of one layer, in format `fmt`."""

    def mm(h, w):
        if fmt == "bf16":
            return h @ w
        return (fp8_native if fmt == "fp8-native" else matmul)(h, *w)

    def layer(h, lw):
        q = mm(h, lw["q_proj"])
        kv = mm(h, lw["k_proj"]) + mm(h, lw["v_proj"])
        h = h + mm(q.at[:, : kv.shape[1]].add(kv), lw["o_proj"])
        a = jax.nn.silu(mm(h, lw["gate_proj"])) * mm(h, lw["up_proj"])
        return (h + mm(a, lw["down_proj"])).astype(h.dtype)

    return layer


def stacked_weights(cfg: ModelConfig, fmt: str) -> dict:
    """module -> [L, in, out] bf16, or (q [L, in, out], scale [L, out]) drawn on the device."""
    out = {}
    for i, m in enumerate(TARGET_MODULES):
        w = jax.random.normal(jax.random.key(i), (cfg.num_layers, *cfg.module_shape(m)), jnp.bfloat16) * 0.02
        out[m] = w if fmt == "bf16" else quantize(w, Quantization.INT8 if fmt == "int8" else Quantization.FP8)
        jax.block_until_ready(out[m])
        del w
    return out


def weight_bytes(cfg: ModelConfig, fmt: str) -> int:
    n = sum(math.prod(cfg.module_shape(m)) for m in TARGET_MODULES)
    scales = sum(cfg.module_shape(m)[1] for m in TARGET_MODULES)
    return cfg.num_layers * (2 * n if fmt == "bf16" else n + 4 * scales)


def weight_buffers(hlo: str, cfg: ModelConfig) -> dict[str, int]:
    """dtype -> weight-shaped results of the entry computation's instructions (see the module doc)."""
    entry = hlo[hlo.index("ENTRY") :]
    entry = entry[: entry.index("\n}")]
    shapes = {f"{a},{b}" for m in TARGET_MODULES for a, b in [cfg.module_shape(m)]}
    shapes |= {f"{cfg.num_layers},{s}" for s in shapes}
    out: dict[str, int] = {}
    for dtype, dims, op in re.findall(r"= (\w+)\[([\d,]+)\]\S* (\w[\w-]*)\(", entry):
        if dims in shapes and op != "parameter":
            out[dtype] = out.get(dtype, 0) + 1
    return out


def unrolled(cfg: ModelConfig, fmt: str) -> Callable:
    layer = projections(fmt)

    def run(w, x):
        for i in range(cfg.num_layers):
            x = layer(x, jax.tree.map(lambda a: a[i], w))
        return x

    return jax.jit(run)


def timed(fn, *args, reps: int = 10) -> float:
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    outs = [fn(*args) for _ in range(reps)]
    jax.block_until_ready(outs)
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="toy shapes on the CPU (a smoke run)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    p.add_argument("--out", type=Path, default=None, help="folder for quant_gemm.json")
    args = p.parse_args()
    cfg = TINY if args.tiny else LLAMA2_7B
    hbm = hbm_gbps(1 << 20 if args.tiny else 1 << 31)
    result = {
        "device": jax.devices()[0].device_kind,
        "jax_version": jax.__version__,
        "model": cfg.name,
        "hbm_GBps": round(hbm, 1),
        "rows": [],
    }
    print(f"{result['device']}, HBM copy {hbm:.0f} GB/s", flush=True)
    for fmt in args.formats:
        w = stacked_weights(cfg, fmt)
        floor = weight_bytes(cfg, fmt) / (hbm * 1e9) * 1e3
        fn = unrolled(cfg, fmt)
        for batch in args.batch:
            x = jax.random.normal(jax.random.key(99), (batch, cfg.hidden_size), jnp.bfloat16)
            try:
                buffers = weight_buffers(fn.lower(w, x).compile().as_text(), cfg)
                ms = timed(fn, w, x)
            except Exception as e:  # a probe: report the format that does not compile and go on
                print(f"{fmt} B={batch}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            row = {
                "format": fmt,
                "batch": batch,
                "weight_bytes": weight_bytes(cfg, fmt),
                "ms": round(ms, 3),
                "floor_ms": round(floor, 4),
                "x_floor": round(ms / floor, 2),
                "weight_buffers": buffers,
            }
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
        del w, fn
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "quant_gemm.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
