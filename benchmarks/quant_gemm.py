"""The seven projections of the Llama-2-7B shape alone, unrolled over the layers as the engine's GPU
decode step runs them, per base weight format: time against each format's bytes floor.

  bf16          x @ W
  bf16-fused    x @ [Wq|Wk|Wv] and x @ [Wgate|Wup]: one GEMM per shared input (5 GEMMs a layer, not 7),
                the fused layout vLLM and SGLang serve with; same bytes, fewer and wider launches
  int8, fp8     (x @ q.astype(bf16)) * scale        jaxlora.model.quant.matmul (what the model runs)
  fp8-native    (e4m3(x / sx) @ q) * sx * scale     the H200's FP8 tensor cores; activations quantized
                                                    per row (W8A8), so not the model's numerics
  fp8-kmajor,   W8A8 as fp8-native (int8: x rounded     the weights stored [out, in] (K-major, the
  int8-kmajor   to int8 per row, s8 x s8 -> s32)      layout cuBLASLt's FP8 / int8 GEMMs read) and
                                                    q|k|v, gate|up fused as the engine serves them
  fp8-kmajor-layers,                                the same, each layer's weights an array of its
  int8-kmajor-layers                                own (no slice of a stack before the GEMM)
  int8-pallas,  pallas_kernels.quant_matmul           the model's GPU path: the Triton kernel converts
  fp8-pallas                                        weight tiles in registers and reads layer i of
                                                    the stacked weights in place (never sliced)

floor = weight bytes (1 byte per quantized weight + float32 scales; 2 per bf16 weight) over the
device-to-device copy bandwidth of this run. `weight_buffers` counts, per dtype, the weight-shaped
buffers the compiled step's entry computation writes (parameters excluded): none means every GEMM
reads its layer's weights straight out of the stack; a bf16 / f32 count for int8 or fp8 means XLA
wrote a dequantized copy first instead of fusing the convert into the GEMM (the bytes the format
saves are then spent again); s8 / f8e4m3fn counts are copies of a layer's slice.

`--tune M` then times the kernel (int8 weights) at batch M with each knob set of TUNE_CANDIDATES,
to pick the rows of pallas_kernels/quant_tuning.py by measurement. quant_gemm.json is rewritten
after every row, so a run cut short keeps what it measured.

    python -m benchmarks.quant_gemm [--tiny] [--batch 1 16 64 256] [--formats ...] [--tune 64] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks.common import LLAMA2_7B, TINY, hbm_gbps
from jaxlora.config import TARGET_MODULES, ModelConfig
from jaxlora.model.quant import Quantization, matmul, quantize
from pallas_kernels.quant_matmul import quant_matmul

FORMATS = (
    "bf16",
    "bf16-fused",
    "int8",
    "fp8",
    "fp8-native",
    "int8-pallas",
    "fp8-pallas",
    "fp8-kmajor",
    "int8-kmajor",
    "fp8-kmajor-layers",
    "int8-kmajor-layers",
)
FP8 = jnp.dtype(jnp.float8_e4m3fn)
# Kernel knob sets `--tune` compares (see pallas_kernels/quant_tuning.py for what each knob does):
# the table's decode row (wide columns, K split until 132 programs), narrower columns with no split
# (no partial sums, x re-read more), and 16-row tiles with no split (rows give the parallelism; each
# weight tile is read by M / 16 programs, mostly from L2).
TUNE_CANDIDATES: tuple[dict[str, int], ...] = (
    dict(block_m=64, block_n=128, block_k=128, min_programs=132, num_warps=4, num_stages=4),
    dict(block_m=64, block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=4),
    dict(block_m=16, block_n=128, block_k=256, split_k=1, num_warps=4, num_stages=4),
)


def storage(fmt: str) -> str:
    """How a format stores its weights: "bf16", "int8" or "fp8"."""
    return fmt.split("-")[0]


def fp8_native(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    """x [n, in] bf16 quantized per row to e4m3, times q [in, out] e4m3 on FP8 tensor cores."""
    sx = jnp.maximum(jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1, keepdims=True), 1e-12) / 448.0
    xq = (x.astype(jnp.float32) / sx).astype(FP8)
    y = jax.lax.dot(xq, q, preferred_element_type=jnp.float32)
    return (y * sx * scale).astype(x.dtype)


def w8a8_kmajor(x: jax.Array, qt: jax.Array, scale: jax.Array) -> jax.Array:
    """x [n, in] bf16 quantized per row to qt's dtype (e4m3, or int8 rounded), times qt [out, in]
    (K-major) on the tensor cores with a 32-bit accumulator; the scales multiply the output."""
    limit = 448.0 if qt.dtype == FP8 else 127.0
    xf = x.astype(jnp.float32)
    sx = jnp.maximum(jnp.max(jnp.abs(xf), axis=-1, keepdims=True), 1e-12) / limit
    xs = xf / sx
    xq = (xs if qt.dtype == FP8 else jnp.round(xs)).astype(qt.dtype)
    acc = jnp.float32 if qt.dtype == FP8 else jnp.int32
    y = jax.lax.dot_general(xq, qt, (((1,), (1,)), ((), ())), preferred_element_type=acc)
    return (y.astype(jnp.float32) * sx * scale).astype(x.dtype)


def one_kmajor_layer(h, lw, layer):
    """One layer in the serving layout (q|k|v and gate|up fused) with K-major W8A8 weights."""
    q_size, kv_size = lw["q_size"], lw["kv_size"]
    qkv = w8a8_kmajor(h, *lw["qkv"])
    q, k, v = jnp.split(qkv, [q_size, q_size + kv_size], axis=-1)
    h = h + w8a8_kmajor(q.at[:, : k.shape[1]].add(k + v), *lw["o_proj"])
    gate, up = jnp.split(w8a8_kmajor(h, *lw["gate_up"]), 2, axis=-1)
    return (h + w8a8_kmajor(jax.nn.silu(gate) * up, *lw["down_proj"])).astype(h.dtype)


def projections(fmt: str, knobs: dict[str, int]) -> Callable:
    """(h [n, D], weights, layer) -> h after the seven projections of one layer, in format `fmt`.

    weights: that layer's (sliced) for XLA formats; the whole stacks for the kernel, which reads
    layer `layer` of them in place."""
    interpret = jax.default_backend() == "cpu"

    def mm(h, w, layer):
        if fmt == "bf16":
            return h @ w
        if fmt.endswith("-pallas"):
            return quant_matmul(h, *w, layer, interpret=interpret, **knobs)
        return (fp8_native if fmt == "fp8-native" else matmul)(h, *w)

    def one_fused_layer(h, lw, layer):
        w = lw["fused"]
        qkv = h @ w["qkv"]
        q, k, v = jnp.split(qkv, [w["q_size"], w["q_size"] + w["kv_size"]], axis=-1)
        h = h + (q.at[:, : k.shape[1]].add(k + v)) @ lw["o_proj"]
        gate, up = jnp.split(h @ w["gate_up"], 2, axis=-1)
        return (h + (jax.nn.silu(gate) * up) @ lw["down_proj"]).astype(h.dtype)

    if fmt == "bf16-fused":
        return one_fused_layer
    if "-kmajor" in fmt:
        return one_kmajor_layer

    def one_layer(h, lw, layer):
        q = mm(h, lw["q_proj"], layer)
        kv = mm(h, lw["k_proj"], layer) + mm(h, lw["v_proj"], layer)
        h = h + mm(q.at[:, : kv.shape[1]].add(kv), lw["o_proj"], layer)
        a = jax.nn.silu(mm(h, lw["gate_proj"], layer)) * mm(h, lw["up_proj"], layer)
        return (h + mm(a, lw["down_proj"], layer)).astype(h.dtype)

    return one_layer


def stacked_weights(cfg: ModelConfig, kind: str) -> dict:
    """module -> [L, in, out] bf16, or (q [L, in, out], scale [L, out]) drawn on the device; kind: `storage`."""
    out = {}
    for i, m in enumerate(TARGET_MODULES):
        w = jax.random.normal(jax.random.key(i), (cfg.num_layers, *cfg.module_shape(m)), jnp.bfloat16) * 0.02
        out[m] = w if kind == "bf16" else quantize(w, Quantization(kind))
        jax.block_until_ready(out[m])
        del w
    return out


def fuse(cfg: ModelConfig, w: dict) -> dict:
    """bf16 stacks -> the same stacks plus "fused": {"qkv": [L, D, q+2kv], "gate_up": [L, D, 2I]} (a copy)."""
    cat = lambda *ms: jnp.concatenate([w[m] for m in ms], axis=-1)  # noqa: E731
    fused = {"qkv": cat("q_proj", "k_proj", "v_proj"), "gate_up": cat("gate_proj", "up_proj")}
    return {**w, "fused": fused}


def kmajor(cfg: ModelConfig, w: dict) -> dict:
    """Quantized stacks -> the same stacks plus "kmajor", the serving layout stored K-major:
    {"qkv", "o_proj", "gate_up", "down_proj"} -> (q [L, out, in], scale [L, out]) (a copy)."""

    def cat(*ms):
        q = jnp.concatenate([w[m][0] for m in ms], axis=-1)
        return jnp.swapaxes(q, 1, 2), jnp.concatenate([w[m][1] for m in ms], axis=-1)

    kmajor = {
        "qkv": cat("q_proj", "k_proj", "v_proj"),
        "o_proj": cat("o_proj"),
        "gate_up": cat("gate_proj", "up_proj"),
        "down_proj": cat("down_proj"),
    }
    # One array per layer, sliced here once: a GEMM then reads its operand without a slice.
    layers = [jax.tree.map(lambda a, i=i: a[i].copy(), kmajor) for i in range(cfg.num_layers)]
    return {**w, "kmajor": kmajor, "kmajor_layers": layers}


def weight_bytes(cfg: ModelConfig, fmt: str) -> int:
    n = sum(math.prod(cfg.module_shape(m)) for m in TARGET_MODULES)
    scales = sum(cfg.module_shape(m)[1] for m in TARGET_MODULES)
    return cfg.num_layers * (2 * n if storage(fmt) == "bf16" else n + 4 * scales)


def weight_buffers(hlo: str, cfg: ModelConfig) -> dict[str, int]:
    """dtype -> weight-shaped results of the entry computation's instructions (see the module doc)."""
    entry = hlo[hlo.index("ENTRY") :]
    entry = entry[: entry.index("\n}")]
    shapes = {f"{a},{b}" for m in TARGET_MODULES for a, b in [cfg.module_shape(m)]}
    fused = {f"{cfg.hidden_size},{cfg.q_size + 2 * cfg.kv_size}", f"{cfg.hidden_size},{2 * cfg.intermediate_size}"}
    shapes |= fused | {",".join(s.split(",")[::-1]) for s in shapes | fused}  # fused, and K-major copies
    shapes |= {f"{cfg.num_layers},{s}" for s in shapes}
    out: dict[str, int] = {}
    for dtype, dims, op in re.findall(r"= (\w+)\[([\d,]+)\]\S* (\w[\w-]*)\(", entry):
        if dims in shapes and op != "parameter":
            out[dtype] = out.get(dtype, 0) + 1
    return out


def unrolled(cfg: ModelConfig, fmt: str, knobs: dict[str, int] | None = None) -> Callable:
    layer = projections(fmt, knobs or {})
    in_place = fmt.endswith("-pallas")

    def run(w, x):
        for i in range(cfg.num_layers):
            if fmt.endswith("-kmajor-layers"):
                lw = {"kmajor": w["kmajor_layers"][i]}
            else:
                lw = (
                    w
                    if in_place
                    else jax.tree.map(lambda a: a[i], {k: v for k, v in w.items() if k != "kmajor_layers"})
                )
            if fmt == "bf16-fused":
                lw = {**lw, "fused": {**lw["fused"], "q_size": cfg.q_size, "kv_size": cfg.kv_size}}
            if "-kmajor" in fmt:
                lw = {**lw["kmajor"], "q_size": cfg.q_size, "kv_size": cfg.kv_size}
            x = layer(x, lw, i)
        return x

    return jax.jit(run)


def timed(fn, *args, reps: int = 10) -> float:
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    outs = [fn(*args) for _ in range(reps)]
    jax.block_until_ready(outs)
    return (time.perf_counter() - t0) / reps * 1e3


def measure(cfg: ModelConfig, fmt: str, batch: int, w: dict, hbm: float, knobs: dict | None = None) -> dict | None:
    """One row: the unrolled step's time against the format's bytes floor (None if it fails)."""
    fn = unrolled(cfg, fmt, knobs)
    x = jax.random.normal(jax.random.key(99), (batch, cfg.hidden_size), jnp.bfloat16)
    label = f"{fmt} B={batch}" + (f" {knobs}" if knobs else "")
    try:
        buffers = weight_buffers(fn.lower(w, x).compile().as_text(), cfg)
        ms = timed(fn, w, x)
    except Exception as e:  # a probe: report the format that does not compile and go on
        print(f"{label}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        return None
    floor = weight_bytes(cfg, fmt) / (hbm * 1e9) * 1e3
    row = {
        "format": fmt,
        "batch": batch,
        "weight_bytes": weight_bytes(cfg, fmt),
        "ms": round(ms, 3),
        "floor_ms": round(floor, 4),
        "x_floor": round(ms / floor, 2),
        "weight_buffers": buffers,
    }
    return row if knobs is None else {**row, "knobs": knobs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="toy shapes on the CPU (a smoke run)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    p.add_argument("--layers", type=int, default=None, help="time the first N layers only (default all)")
    p.add_argument("--tune", type=int, default=None, metavar="M", help="time TUNE_CANDIDATES at batch M")
    p.add_argument("--out", type=Path, default=None, help="folder for quant_gemm.json")
    args = p.parse_args()
    if args.layers is not None and args.layers < 1:
        p.error(f"--layers {args.layers} must be >= 1")
    cfg = TINY if args.tiny else LLAMA2_7B
    if args.layers is not None:
        cfg = dataclasses.replace(cfg, num_layers=args.layers)
    hbm = hbm_gbps(1 << 20 if args.tiny else 1 << 31)
    result = {
        "device": jax.devices()[0].device_kind,
        "jax_version": jax.__version__,
        "model": cfg.name,
        "hbm_GBps": round(hbm, 1),
        "layers": cfg.num_layers,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "rows": [],
    }
    print(f"{result['device']}, HBM copy {hbm:.0f} GB/s", flush=True)
    cases = [(fmt, batch, None) for fmt in args.formats for batch in args.batch]
    cases += [("int8-pallas", args.tune, knobs) for knobs in TUNE_CANDIDATES] if args.tune else []
    kinds = list(dict.fromkeys(storage(fmt) for fmt, _, _ in cases))
    cases.sort(key=lambda case: kinds.index(storage(case[0])))  # stable: each kind's weights drawn once
    drawn: tuple[str, dict] | None = None  # one storage kind's weights at a time (7B: 6.7-13.5 GB)
    for fmt, batch, knobs in cases:
        if drawn is None or drawn[0] != storage(fmt):
            drawn = None  # free the previous kind before drawing the next
            drawn = (storage(fmt), stacked_weights(cfg, storage(fmt)))
        if fmt == "bf16-fused" and "fused" not in drawn[1]:
            drawn = (drawn[0], fuse(cfg, drawn[1]))
        if "-kmajor" in fmt and "kmajor" not in drawn[1]:
            drawn = (drawn[0], kmajor(cfg, drawn[1]))
        row = measure(cfg, fmt, batch, drawn[1], hbm, knobs)
        if row is None:
            continue
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "quant_gemm.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
