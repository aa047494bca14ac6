"""The seven projections of the Llama-2-7B shape alone, unrolled over the layers as the engine's GPU
decode step runs them, per base weight format: time against each format's bytes floor.

  bf16          x @ W
  bf16-fused    x @ [Wq|Wk|Wv] and x @ [Wgate|Wup]: one GEMM per shared input (5 GEMMs a layer, not 7),
                the fused layout vLLM and SGLang serve with; same bytes, fewer and wider launches
  int8, fp8     (x @ q.astype(bf16)) * scale        jaxlora.model.quant.matmul (the model's XLA path)
  int8-fused,   the same in the serving layout        (q|k|v and gate|up one GEMM each, as the engine
  fp8-fused                                          holds a one-device quantized model)
  fp8-native    (e4m3(x / sx) @ q) * sx * scale     the H200's FP8 tensor cores; activations quantized
                                                    per row (W8A8), so not the model's numerics
  fp8-kmajor,   W8A8 as fp8-native (int8: x rounded     the weights stored [out, in] (K-major, the
  int8-kmajor   to int8 per row, s8 x s8 -> s32)      layout cuBLASLt's FP8 / int8 GEMMs read) and
                                                    q|k|v, gate|up fused as the engine serves them
  fp8-kmajor-layers,                                the same, each layer's weights an array of its
  int8-kmajor-layers                                own (no slice of a stack before the GEMM)
  int8-pallas,  pallas_kernels.quant.triton           the model's GPU path: the Triton kernel converts
  fp8-pallas                                        weight tiles in registers and reads layer i of
                                                    the stacked weights in place (never sliced)
  int8-fused-pallas,                                the kernel on the serving layout: what the
  fp8-fused-pallas                                  engine runs on GPU for steps of few tokens
  int8-magic-pallas                                 the same with convert="magic": int8 -> bf16 by
                                                    integer / FP32 bit arithmetic, no I2F / F2F
  int8-w8a8-pallas,                                 the kernel's W8A8: x quantized per row by XLA,
  fp8-w8a8-pallas                                   8-bit tiles multiplied as they are (no convert)

floor = weight bytes (1 byte per quantized weight + float32 scales; 2 per bf16 weight) over the
device-to-device copy bandwidth of this run. On a known device (H100 SXM, H200) mma_floor_ms is the
step's FLOPs (2 * M * weights) at the tensor cores' dense peak (bf16, or 8-bit for the W8A8 formats)
and x_bound = ms / max(floor, mma floor): weight-only at M = 256 turns compute-bound on bf16 MMAs
before it reaches the bytes floor. `weight_buffers` counts, per dtype, the weight-shaped
buffers the compiled step's entry computation writes (parameters excluded): none means every GEMM
reads its layer's weights straight out of the stack; a bf16 / f32 count for int8 or fp8 means XLA
wrote a dequantized copy first instead of fusing the convert into the GEMM (the bytes the format
saves are then spent again); s8 / f8e4m3fn counts are copies of a layer's slice.

`--tune FORMAT ...` sweeps the kernel's knobs: each listed -pallas format is timed at every --batch
with each candidate of SWEEP for its variant and batch bucket (the first candidate is the tuning
table's row). A candidate may set k_major: the kernel then reads a transposed copy of the stacks
[L, out, in]. Each row records the knobs it ran with; `best` holds, per (format, batch), the fastest
row's ms and knobs (paste them into pallas_kernels/quant/tuning.py). quant_gemm.json is rewritten
after every case, and before each case it names the case it is running: `--resume` with the same
--out skips the cases already recorded, and records the case a dead run was in as crashed (a Triton
compile can take the process down), so re-running the same command finishes a sweep.
`--time-budget S` starts no case after S seconds (the cases left are listed under "left").

    python -m benchmarks.kernels.quant_gemm [--tiny] [--batch 1 16 64 256] [--formats ...] [--layers N]
        [--tune FORMAT ...] [--time-budget S] [--resume] [--out DIR]
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
from pallas_kernels.quant import tuning as quant_tuning
from pallas_kernels.quant.triton import quant_matmul

FORMATS = (
    "bf16",
    "bf16-fused",
    "int8",
    "fp8",
    "int8-fused",
    "fp8-fused",
    "fp8-native",
    "int8-pallas",
    "fp8-pallas",
    "int8-fused-pallas",
    "fp8-fused-pallas",
    "fp8-kmajor",
    "int8-kmajor",
    "fp8-kmajor-layers",
    "int8-kmajor-layers",
    "int8-magic-pallas",
    "int8-w8a8-pallas",
    "fp8-w8a8-pallas",
)
FP8 = jnp.dtype(jnp.float8_e4m3fn)
# The kernel's variant flags per -pallas format.
PALLAS_FLAGS: dict[str, dict] = {
    "int8-pallas": {},
    "fp8-pallas": {},
    "int8-fused-pallas": {},
    "fp8-fused-pallas": {},
    "int8-magic-pallas": dict(convert="magic"),
    "int8-w8a8-pallas": dict(w8a8=True),
    "fp8-w8a8-pallas": dict(w8a8=True),
}
# Candidates `--tune` times, per (variant, tuning-table bucket): knobs over the table's row (see
# pallas_kernels/quant/tuning.py), {} being the row itself. Few enough that a sweep of four formats
# at M = 16, 64, 256 compiles ~45 steps. What each tries:
#   swap_ab       wgmma at 16 rows, and (weight-only) the converted tile fed from registers
#   block_n 256   x re-read half as often (2 * M / block_n of the weight bytes for bf16 x)
#   min 264       two programs per SM: more weight bytes in flight
#   block_m 128   M = 256 in two row tiles: each weight tile read twice instead of four times
#   k_major       (W8A8) the weights [L, N, K]: Hopper's 8-bit wgmma reads only K-major operands
#                 from shared memory; an [L, K, N] tile is transposed through registers first
# Shared memory stays under the H200's 227 KB: (x tile + weight tile) * num_stages.
SWEEP: dict[tuple[str, int], tuple[dict, ...]] = {
    ("weight_only", 16): (
        {},
        dict(swap_ab=True),
        dict(swap_ab=True, block_n=256, block_k=128, num_warps=8),
        dict(min_programs=264),
    ),
    ("weight_only", 64): (
        {},
        dict(swap_ab=True),
        dict(block_n=256, num_warps=8, num_stages=3),
        dict(min_programs=264, num_stages=5),
    ),
    ("weight_only", 256): (
        {},
        dict(block_m=128, num_warps=8, num_stages=3),
        dict(block_m=128, swap_ab=True, num_warps=8, num_stages=3),
    ),
    ("w8a8", 16): (
        {},
        dict(k_major=True, swap_ab=True),
        dict(k_major=True, swap_ab=True, block_n=256, num_warps=8, num_stages=3),
        dict(k_major=True),
    ),
    ("w8a8", 64): (
        {},
        dict(k_major=True),
        dict(k_major=True, block_n=256, block_k=128, num_warps=8, num_stages=3),
        dict(k_major=True, block_k=128, min_programs=264, num_stages=5),
    ),
    ("w8a8", 256): (
        {},
        dict(k_major=True, block_m=128, num_warps=8, num_stages=3),
        dict(k_major=True, block_m=128, block_n=256, num_warps=8, num_stages=3),
    ),
}
# Dense tensor-core peaks, TFLOP/s (spec sheets; FP8 and int8 alike), by device kind.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "NVIDIA H200": {"bf16": 989.4, "8-bit": 1978.9},
    "NVIDIA H100 80GB HBM3": {"bf16": 989.4, "8-bit": 1978.9},
}


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


def fused_layer(h: jax.Array, gemm: Callable[[jax.Array, str], jax.Array], q_size: int, kv_size: int) -> jax.Array:
    """One layer's projections in the serving layout (q|k|v and gate|up one GEMM each), with
    `gemm(x, name)` multiplying by the named matrix ("qkv", "o_proj", "gate_up", "down_proj"); the
    attention and MLP in between reduced to the elementwise work that keeps each GEMM's input live."""
    q, k, v = jnp.split(gemm(h, "qkv"), [q_size, q_size + kv_size], axis=-1)
    h = h + gemm(q.at[:, : k.shape[1]].add(k + v), "o_proj")
    gate, up = jnp.split(gemm(h, "gate_up"), 2, axis=-1)
    return (h + gemm(jax.nn.silu(gate) * up, "down_proj")).astype(h.dtype)


def one_kmajor_layer(h, lw, layer):
    """One layer in the serving layout (q|k|v and gate|up fused) with K-major W8A8 weights."""
    return fused_layer(h, lambda a, name: w8a8_kmajor(a, *lw[name]), lw["q_size"], lw["kv_size"])


def projections(fmt: str, knobs: dict) -> Callable:
    """(h [n, D], weights, layer) -> h after the seven projections of one layer, in format `fmt`.

    weights: that layer's (sliced) for XLA formats; the whole stacks for the kernel, which reads
    layer `layer` of them in place (the transposed stacks if knobs has k_major)."""
    interpret = jax.default_backend() == "cpu"
    flags = PALLAS_FLAGS.get(fmt, {})

    def mm(h, w, layer):
        if fmt == "bf16":
            return h @ w
        if fmt.endswith("-pallas"):
            return quant_matmul(h, *w, layer, interpret=interpret, **flags, **knobs)
        return (fp8_native if fmt == "fp8-native" else matmul)(h, *w)

    def one_fused_layer(h, lw, layer):
        w = lw["fused"]
        mats = {"qkv": w["qkv"], "gate_up": w["gate_up"], "o_proj": lw["o_proj"], "down_proj": lw["down_proj"]}
        gemm = (lambda a, b: a @ b) if fmt == "bf16-fused" else (lambda a, b: mm(a, b, layer))  # noqa: E731
        return fused_layer(h, lambda a, name: gemm(a, mats[name]), w["q_size"], w["kv_size"])

    if "fused" in fmt:
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
    """Stacks -> the same stacks plus "fused": {"qkv": [L, D, q+2kv], "gate_up": [L, D, 2I]} (a copy;
    a quantized stack's scales [L, out] go along with their columns)."""
    cat = lambda *ms: jax.tree.map(lambda *a: jnp.concatenate(a, axis=-1), *[w[m] for m in ms])  # noqa: E731
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


def transposed(w: dict) -> dict:
    """Quantized stacks -> the same stacks plus "transposed": module -> (q [L, out, in], scale [L, out]),
    the kernel's k_major operands (a copy)."""
    return {**w, "transposed": {m: (jnp.swapaxes(w[m][0], 1, 2), w[m][1]) for m in TARGET_MODULES}}


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


def unrolled(cfg: ModelConfig, fmt: str, knobs: dict | None = None) -> Callable:
    knobs = knobs or {}
    layer = projections(fmt, knobs)
    in_place = fmt.endswith("-pallas")

    def run(w, x):
        for i in range(cfg.num_layers):
            if fmt.endswith("-kmajor-layers"):
                lw = {"kmajor": w["kmajor_layers"][i]}
            elif in_place:
                lw = w["transposed"] if knobs.get("k_major") else w
            else:
                lw = jax.tree.map(lambda a: a[i], {k: v for k, v in w.items() if k != "kmajor_layers"})
            if "fused" in fmt:
                lw = {**lw, "fused": {**lw["fused"], "q_size": cfg.q_size, "kv_size": cfg.kv_size}}
            if "-kmajor" in fmt:
                lw = {**lw["kmajor"], "q_size": cfg.q_size, "kv_size": cfg.kv_size}
            x = layer(x, lw, i)
        return x

    return jax.jit(run)


def timed(fn, *args, reps: int = 20) -> float:
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    outs = [fn(*args) for _ in range(reps)]
    jax.block_until_ready(outs)
    return (time.perf_counter() - t0) / reps * 1e3


def is_8bit_mma(fmt: str) -> bool:
    """Whether a format multiplies on the 8-bit tensor cores (W8A8) rather than bf16 ones."""
    return "w8a8" in fmt or "-kmajor" in fmt or fmt == "fp8-native"


def mma_floor_ms(cfg: ModelConfig, fmt: str, batch: int, device_kind: str) -> float | None:
    """The step's 2 * M * weights FLOPs at the dense tensor-core peak; None on an unknown device."""
    peak = PEAK_TFLOPS.get(device_kind, {}).get("8-bit" if is_8bit_mma(fmt) else "bf16")
    if peak is None:
        return None
    weights = cfg.num_layers * sum(math.prod(cfg.module_shape(m)) for m in TARGET_MODULES)
    return 2 * batch * weights / (peak * 1e12) * 1e3


def candidates(fmt: str, batch: int) -> tuple[dict, ...]:
    """SWEEP's candidates for a -pallas format at `batch` rows ({} alone past the last bucket)."""
    family = "w8a8" if PALLAS_FLAGS[fmt].get("w8a8") else "weight_only"
    bucket = quant_tuning.bucket(batch)
    return SWEEP.get((family, bucket), ({},))


def knobs_of(fmt: str, batch: int, candidate: dict) -> dict:
    """The full knob set a candidate runs with: the tuning table's row, the candidate over it."""
    return quant_tuning.lookup(batch, bool(PALLAS_FLAGS[fmt].get("w8a8"))) | {"k_major": False} | candidate


def measure(cfg: ModelConfig, fmt: str, batch: int, w: dict, hbm: float, candidate: dict | None = None) -> dict:
    """One row: the unrolled step's time against the format's floors (an "error" row if it fails).
    candidate: a -pallas format's knobs over the tuning table's (None for other formats)."""
    fn = unrolled(cfg, fmt, candidate)
    x = jax.random.normal(jax.random.key(99), (batch, cfg.hidden_size), jnp.bfloat16)
    row: dict = {"case": case_key(fmt, batch, candidate), "format": fmt, "batch": batch}
    if candidate is not None:
        row |= {"candidate": candidate, "knobs": knobs_of(fmt, batch, candidate)}
    try:
        compiled = fn.lower(w, x).compile()  # timed as compiled here: one compile per case
        buffers = weight_buffers(compiled.as_text(), cfg)
        ms = timed(compiled, w, x)
    except Exception as e:  # a probe: report the case that does not compile or run, and go on
        return row | {"error": f"{type(e).__name__}: {str(e)[:500]}"}
    floor = weight_bytes(cfg, fmt) / (hbm * 1e9) * 1e3
    mma = mma_floor_ms(cfg, fmt, batch, jax.devices()[0].device_kind)
    return row | {
        "weight_bytes": weight_bytes(cfg, fmt),
        "ms": round(ms, 3),
        "floor_ms": round(floor, 4),
        "x_floor": round(ms / floor, 2),
        "mma_floor_ms": None if mma is None else round(mma, 4),
        "x_bound": round(ms / max(floor, mma or 0.0), 2),
        "weight_buffers": buffers,
    }


# -- the sweep: cases, resuming, the fastest row per (format, batch) --------------------------------


def case_key(fmt: str, batch: int, candidate: dict | None) -> str:
    return f"{fmt} B={batch} {json.dumps(candidate, sort_keys=True)}"


def plan_cases(formats: list[str], tune: list[str], batches: list[int]) -> list[tuple[str, int, dict | None]]:
    """(format, batch, candidate) to run, grouped by storage kind (each kind's weights drawn once);
    within a kind, every format's table row first, then the other candidates in SWEEP's order (a run
    cut short has the baselines). A -pallas format's table row is candidate {} whether listed in
    --formats or --tune; other formats have None."""
    cases: dict[str, tuple[int, str, int, dict | None]] = {}  # key -> (rank in its SWEEP, fmt, batch, cand)
    for fmt in dict.fromkeys([*formats, *tune]):
        for batch in batches:
            cands = candidates(fmt, batch) if fmt in tune else ({} if fmt in PALLAS_FLAGS else None,)
            for rank, cand in enumerate(cands):
                cases.setdefault(case_key(fmt, batch, cand), (rank, fmt, batch, cand))
    kinds = list(dict.fromkeys(storage(fmt) for fmt in [*formats, *tune]))
    ordered = sorted(cases.values(), key=lambda c: (kinds.index(storage(c[1])), c[0]))
    return [(fmt, batch, cand) for _, fmt, batch, cand in ordered]


def fastest(rows: list[dict]) -> dict[str, dict]:
    """Per "FORMAT B=M": the fastest measured row's ms, x_floor, x_bound and knobs."""
    best: dict[str, dict] = {}
    for r in rows:
        key = f"{r['format']} B={r['batch']}"
        if "ms" in r and (key not in best or r["ms"] < best[key]["ms"]):
            best[key] = {k: r.get(k) for k in ("ms", "x_floor", "x_bound", "knobs")}
    return best


def resumed_rows(path: Path) -> list[dict]:
    """The rows of an earlier run's quant_gemm.json, plus a "crashed" row for the case it was running
    when it died."""
    if not path.exists():
        return []
    before = json.loads(path.read_text())
    rows = before["rows"]
    if before.get("running"):
        rows.append({**before["running"], "error": "crashed: the process died during this case"})
    return rows


def draw(cfg: ModelConfig, drawn: tuple[str, dict] | None, fmt: str, candidate: dict | None) -> tuple[str, dict]:
    """The weights a case needs: its storage kind's stacks (drawn once per kind, the previous kind
    freed first) and the copies its format or candidate reads."""
    if drawn is None:  # the caller dropped the previous kind's weights first
        drawn = (storage(fmt), stacked_weights(cfg, storage(fmt)))
    kind, w = drawn
    if "fused" in fmt and "fused" not in w:
        w = fuse(cfg, w)
    if "-kmajor" in fmt and "kmajor" not in w:
        w = kmajor(cfg, w)
    if (candidate or {}).get("k_major") and "transposed" not in w:
        w = transposed(w)
    return kind, w


def main() -> None:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tiny", action="store_true", help="toy shapes on the CPU (a smoke run)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS), help="at the table's knobs")
    p.add_argument("--layers", type=int, default=None, help="time the first N layers only (default all)")
    p.add_argument("--tune", nargs="+", choices=list(PALLAS_FLAGS), default=[], metavar="FORMAT")
    p.add_argument("--time-budget", type=float, default=None, metavar="S", help="start no case after S seconds")
    p.add_argument("--resume", action="store_true", help="skip the cases --out's quant_gemm.json holds")
    p.add_argument("--out", type=Path, default=None, help="folder for quant_gemm.json")
    args = p.parse_args()
    if args.layers is not None and args.layers < 1:
        p.error(f"--layers {args.layers} must be >= 1")
    if args.resume and args.out is None:
        p.error("--resume reads and extends --out's quant_gemm.json: give --out")
    started = time.perf_counter()
    cfg = TINY if args.tiny else LLAMA2_7B
    if args.layers is not None:
        cfg = dataclasses.replace(cfg, num_layers=args.layers)
    hbm = hbm_gbps(1 << 20 if args.tiny else 1 << 31)
    path = None if args.out is None else args.out / "quant_gemm.json"
    result = {
        "device": jax.devices()[0].device_kind,
        "jax_version": jax.__version__,
        "model": cfg.name,
        "hbm_GBps": round(hbm, 1),
        "layers": cfg.num_layers,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "rows": resumed_rows(path) if args.resume else [],
    }
    print(f"{result['device']}, HBM copy {hbm:.0f} GB/s", flush=True)

    def write() -> None:
        if path is not None:
            result["best"] = fastest(result["rows"])
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(result, indent=1))

    done = {r["case"] for r in result["rows"]}
    cases = [c for c in plan_cases(args.formats, args.tune, args.batch) if case_key(*c) not in done]
    drawn: tuple[str, dict] | None = None  # one storage kind's weights at a time (7B: 6.7-13.5 GB)
    for n, (fmt, batch, candidate) in enumerate(cases):
        if args.time_budget is not None and time.perf_counter() - started > args.time_budget:
            result["left"] = [case_key(*c) for c in cases[n:]]
            print(f"time budget spent: {len(cases) - n} cases left (listed under 'left')", flush=True)
            break
        if drawn is not None and drawn[0] != storage(fmt):
            drawn = None  # free the previous kind before drawing the next
        drawn = draw(cfg, drawn, fmt, candidate)
        result["running"] = {"case": case_key(fmt, batch, candidate), "format": fmt, "batch": batch}
        result["running"] |= {} if candidate is None else {"candidate": candidate}
        write()
        row = measure(cfg, fmt, batch, drawn[1], hbm, candidate)
        del result["running"]
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        write()
    write()
    for key, best in fastest(result["rows"]).items():  # the summary a log tail shows
        print(f"best {key}: {best['ms']} ms, {best['x_floor']}x floor, {best['x_bound']}x bound, {best['knobs']}")


if __name__ == "__main__":
    main()
