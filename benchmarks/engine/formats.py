"""Base weight formats on the engine's step, in one call: bf16, int8 / fp8 weight-only, fp8 / int8 W8A8,
FP8 in both serving layouts.

    python -m benchmarks.engine.formats --smoke --out /tmp/formats     # CPU, toy model, seconds
    bash benchmarks/run.sh --budget-s 480 engine.formats               # GPU: Llama-2-7B shape
    python -m benchmarks.engine.formats --budget-s 280 --cases mixed-2048 decode-64 \
        --variants bf16-dense fp8-w8a8 fp8-kmajor-w8a8 fp8-weight-only fp8-kmajor-weight-only \
        fp8-kmajor-weight-only-mgpu                                     # GPU: the FP8 layout A/B

A Llama-2-7B-shape model with random bf16 weights drawn on the device, quantized from that draw to
int8 and FP8 (every format the same weights), 64 distinct rank-16 adapters on all seven modules,
and the engine's jitted step (`runner.packed_step`) timed on its own, `--steps` calls back to back
(the page pool and ids fed through, one block at the end, no compile in the timed calls). Cases:

    decode B=16, B=64   decode-only steps, every row on its own adapter, context 512
    mixed 512, 2048     64 decoding rows (as above) + one prompt chunk filling the step to T tokens

Variants ("weights", "gemm", "layout", "kernel"; --variants picks them by label, in that order):

    bf16-dense          the dense base
    int8-weight-only    KernelConfig(w8a8=False): the weight-only kernel up to its token limit,
    fp8-weight-only     XLA's dequantize-then-GEMM above (jaxlora.kernels.QUANT_AUTO)
    fp8-w8a8            KernelConfig(quant_matmul="xla", w8a8=<format>, w8a8_min_tokens=1): every step
    int8-w8a8           quantizes its activations per token, 8-bit GEMM (jaxlora.model.w8a8)

The layout of the 8-bit weights: "in-out" stores them [L, in, out] (`qkernel`), "kmajor" [L, out, in]
(`qkernel_t`: build_model's kmajor=True, the layout cuBLASLt's 8-bit GEMMs and the Mosaic kernel
read), "default" what jaxlora.kernels.KMAJOR_SERVING gives the format. The fp8 rows name theirs:
fp8-weight-only and fp8-w8a8 are "in-out", fp8-kmajor-weight-only and fp8-kmajor-w8a8 the same on
K-major weights (the Triton kernel reading K-major tiles at decode sizes, a W8A8 GEMM that
contracts both operands' last axes), so one call gives the layout A/B on the same weights.
fp8-kmajor-weight-only-mgpu asks for the Mosaic GPU kernel by name (KernelConfig(quant_matmul="mgpu"),
whose e4m3 output benchmarks/DECISIONS.md#quant-kernel-choice says was not checked on the GPU); it
takes bf16 activations only, so under --smoke (float32) its cells land in `not_run` with the
kernel's reason rather than running another kernel, and steps above the kernel's token limit, which
would run fp8-kmajor-weight-only's program again, are skipped (`not_run`, with that reason).

The engine's default for a format ("auto") is its weight-only row at steps the kernel takes and,
where jaxlora.kernels.W8A8_AUTO lists the format, its w8a8 row above: these rows are the data that
table is set from. Per row:

  step_ms       the step, ms; vs_bf16 = step_ms / the bf16 row's of the same case
  path          what the step runs (StepKernels.describe)
  floor_ms      bytes / the measured HBM copy rate: base weights (1 byte + scales for 8-bit
                projections) + KV read (every row at its context) + distinct adapters
  roofline_ms   max(floor_ms, GEMM FLOPs / the measured matmul rate of the GEMM's operands: bf16 for
                dense and weight-only rows, 8-bit x 8-bit for w8a8 rows)
  fp8_gemm      (w8a8 rows on GPU, the 2,048-token case) whether the compiled step calls cuBLASLt's FP8
                GEMM (`__cublas$lt$matmul$f8`) and how many transposes of an f8 operand it holds
  layout        the 8-bit weights' storage ("kmajor" | "in-out"; None for bf16)

Cells run case by case (default order B=64, mixed 2048, B=16, mixed 512; --cases reorders), each
case's variants in --variants order, until --budget-s is spent; formats.json is rewritten after
every cell.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import (
    LLAMA2_7B,
    TINY,
    decode_inputs,
    hbm_gbps,
    matmul_tflops,
    matmul_tflops_8bit,
    random_bank,
    slot_pattern,
)
from benchmarks.engine.e2e import adapter_bytes, base_weight_bytes, kv_bytes
from benchmarks.paths import results_dir
from jaxlora.config import TARGET_MODULES, LoraBackend, LoraConfig, ModelConfig
from jaxlora.engine.compiles import backend_compiles, check_no_compiles
from jaxlora.engine.config import EngineConfig
from jaxlora.engine.runner import Runner, packed_step
from jaxlora.engine.step_inputs import StepLayout
from jaxlora.kernels import QUANT_KERNEL_MAX_TOKENS, KernelConfig
from jaxlora.model import RaggedBatch
from jaxlora.model.params import quantized_model, random_model

RANK, DISTINCT, DECODE_CONTEXT, PAGE = 16, 64, 512, 16


LAYOUTS: dict[str, bool | None] = {"default": None, "kmajor": True, "in-out": False}  # -> build_model's kmajor


@dataclasses.dataclass(frozen=True)
class Variant:
    weights: str  # "bf16" (dense; "f32" in --smoke) | "fp8" | "int8"
    gemm: str  # "dense" | "weight-only" | "w8a8"
    layout: str = "default"  # LAYOUTS: the 8-bit weights' storage
    kernel: str = "auto"  # weight-only steps: "auto" (QUANT_AUTO's rule) | "mgpu" (the Mosaic kernel by name)

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS or self.kernel not in ("auto", "mgpu"):
            raise ValueError(f"{self}: layout must be one of {list(LAYOUTS)}, kernel 'auto' or 'mgpu'")

    @property
    def label(self) -> str:
        """e.g. "fp8-kmajor-w8a8" (--variants)."""
        layout = "-kmajor" if self.layout == "kmajor" else ""
        return f"{self.weights}{layout}-{self.gemm}{'-mgpu' if self.kernel == 'mgpu' else ''}"

    @property
    def kmajor(self) -> bool | None:
        return LAYOUTS[self.layout]

    def kernel_config(self) -> KernelConfig:
        if self.gemm == "w8a8":
            return KernelConfig(quant_matmul="xla", w8a8=self.weights, w8a8_min_tokens=1)
        if self.kernel == "mgpu":
            return KernelConfig(quant_matmul="mgpu", w8a8=False)
        return KernelConfig(w8a8=False)


VARIANTS = (
    Variant("bf16", "dense"),
    Variant("int8", "weight-only"),
    Variant("fp8", "weight-only", "in-out"),
    Variant("fp8", "weight-only", "kmajor"),
    Variant("fp8", "weight-only", "kmajor", kernel="mgpu"),
    Variant("fp8", "w8a8", "in-out"),
    Variant("fp8", "w8a8", "kmajor"),
    Variant("int8", "w8a8"),
)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    decode_rows: int
    tokens: int  # the step's budget T: decode rows + the prompt chunk

    @property
    def chunk(self) -> int:
        return self.tokens - self.decode_rows

    @property
    def label(self) -> str:
        return f"{self.name}-{self.tokens}"


GPU_CASES = (Case("decode", 64, 64), Case("mixed", 64, 2048), Case("decode", 16, 16), Case("mixed", 64, 512))
SMOKE_CASES = (Case("decode", 4, 4), Case("mixed", 4, 24))


def mixed_inputs(runner: Runner, case: Case) -> dict:
    """A step of `case.decode_rows` decoding rows (`decode_inputs`) plus row `decode_rows` a prompt
    chunk of `case.chunk` tokens at positions 0.., on slot 1, over its own pages."""
    inputs = decode_inputs(runner, slot_pattern(case.decode_rows, DISTINCT), DECODE_CONTEXT, case.tokens)
    if case.chunk == 0:
        return inputs
    n, L, P = case.decode_rows, case.chunk, runner.pages_per_seq
    b: RaggedBatch = inputs["batch"]
    pages = (np.arange(n * P, (n + 1) * P, dtype=np.int32)) % runner.num_pages
    b.q_start[n], b.q_len[n], b.kv_len[n] = n, L, L
    b.block_tables[n] = pages
    pos = np.arange(L, dtype=np.int32)
    b.write_page[n : n + L], b.write_offset[n : n + L] = pages[pos // PAGE], pos % PAGE
    inputs["positions"][n : n + L] = pos
    inputs["slot_ids"][n : n + L] = 1
    inputs["tokens"][n : n + L] = np.random.default_rng(1).integers(0, runner.model.config.vocab_size, L)
    return inputs


def time_step(runner: Runner, bank, case: Case, steps: int) -> tuple[float, StepLayout, jax.Array]:
    """ms per call of the engine's step on `case`'s inputs (as `benchmarks.common.time_decode`)."""
    layout = StepLayout(budget=case.tokens, rows=runner.config.max_batch, pages_per_seq=runner.pages_per_seq)
    packed = jax.device_put(layout.pack(**mixed_inputs(runner, case)))
    static = runner.step_static
    kv, ids = runner.kv, runner.last_ids
    for _ in range(2):  # compile, then the timed loop's own argument placement
        ids, kv, _ = packed_step(runner.params, bank, kv, packed, ids, layout=layout, **static)
    ids.block_until_ready()
    compiles = backend_compiles()
    t0 = time.perf_counter()
    for _ in range(steps):
        ids, kv, _ = packed_step(runner.params, bank, kv, packed, ids, layout=layout, **static)
    ids.block_until_ready()
    seconds = time.perf_counter() - t0
    check_no_compiles(compiles, f"the timed steps of {case}")
    runner.kv, runner.last_ids = kv, ids
    return seconds / steps * 1e3, layout, packed


def fp8_gemm_report(runner: Runner, bank, layout: StepLayout, packed: jax.Array) -> dict:
    """What the compiled step's HLO says about its 8-bit GEMMs (a second compile of the step)."""
    lowered = packed_step.lower(
        runner.params, bank, runner.kv, packed, runner.last_ids, layout=layout, **runner.step_static
    )
    hlo = lowered.compile().as_text()
    return {
        "cublaslt_f8_calls": len(re.findall(r"__cublas\$lt\$matmul\$f8", hlo)),
        "f8_transposes": len(re.findall(r"f8e4m3fn\[[^\]]*\]\{[^}]*\} (?:transpose|copy)\(", hlo)),
    }


# -- the roofline -----------------------------------------------------------------------------------


def step_bytes(cfg: ModelConfig, variant: Variant, case: Case, itemsize: int) -> float:
    quantization = None if variant.gemm == "dense" else variant.weights
    weights = base_weight_bytes(cfg, itemsize, quantization)
    kv = kv_bytes(cfg, case.decode_rows, DECODE_CONTEXT, itemsize) + kv_bytes(cfg, 1, case.chunk, itemsize)
    adapters = min(DISTINCT, case.decode_rows) * adapter_bytes(cfg, RANK, TARGET_MODULES, itemsize)
    return weights + kv + adapters


def step_flops(cfg: ModelConfig, case: Case) -> float:
    """The projections' GEMMs over every token, the LM head over the step's rows, and the chunk's
    causal attention (QK^T and PV over half its square)."""
    projections = sum(math.prod(cfg.module_shape(m)) for m in TARGET_MODULES)
    rows = case.decode_rows + (case.chunk > 0)
    attention = 2 * 2 * case.chunk**2 / 2 * cfg.num_heads * cfg.head_dim * cfg.num_layers
    return 2.0 * case.tokens * cfg.num_layers * projections + 2.0 * rows * cfg.hidden_size * cfg.vocab_size + attention


# -- the run ----------------------------------------------------------------------------------------


def engine_config(variant: Variant, cases: tuple[Case, ...], dtype: jnp.dtype) -> EngineConfig:
    rows = max(c.decode_rows for c in cases) + 1
    max_seq_len = max(DECODE_CONTEXT + 1, max(c.chunk for c in cases))
    pages_per_seq = -(-max_seq_len // PAGE)
    return EngineConfig(
        max_batch=rows,
        max_seq_len=max_seq_len,
        token_budgets=tuple(sorted({c.tokens for c in cases})),
        page_size=PAGE,
        num_pages=2 * pages_per_seq,  # rows share pages (timing only): the pool stays small
        lora=LoraConfig(
            max_slots=DISTINCT + 1, max_rank=RANK, target_modules=TARGET_MODULES, backend=LoraBackend.PALLAS
        ),
        dtype=jnp.dtype(dtype).name,
        kernels=variant.kernel_config(),
    )


def run(opts: argparse.Namespace) -> dict:
    t_start = time.perf_counter()
    cfg, dtype = (TINY, jnp.float32) if opts.smoke else (LLAMA2_7B, jnp.bfloat16)
    cases = selected_cases(opts)
    n = 256 if opts.smoke else 8192
    hbm = hbm_gbps(1 << 20 if opts.smoke else 1 << 31)
    rates = {"bf16": matmul_tflops(n, dtype)}
    for name, d in (("fp8", jnp.float8_e4m3fn), ("int8", jnp.int8)):
        rates[name] = matmul_tflops_8bit(n, d)
    dev = jax.devices()[0]
    print(f"{dev.device_kind}: HBM {hbm:.0f} GB/s, TFLOP/s {rates}", flush=True)
    variants = selected_variants(opts)
    models = build_models(random_model(cfg, dtype=dtype, fused=True), variants)
    payload = {
        "device": str(dev.device_kind),
        "jax_version": jax.__version__,
        "model": cfg.name,
        "hbm_GBps": round(hbm, 1),
        "matmul_TFLOPs": {k: round(v, 1) for k, v in rates.items()},
        "rows": [],
        "not_run": [],
    }
    runners: dict[Variant, Runner] = {}
    lora = engine_config(VARIANTS[0], cases, dtype).lora
    bank = random_bank(cfg, lora, DISTINCT, dtype)
    itemsize = jnp.dtype(dtype).itemsize
    for case in cases:
        for variant in variants:
            if time.perf_counter() - t_start > opts.budget_s:
                payload["not_run"].append({"case": dataclasses.asdict(case), **dataclasses.asdict(variant)})
                continue
            reason = skip_reason(variant, case)
            if reason is not None:
                payload["not_run"].append(
                    {"case": dataclasses.asdict(case), **dataclasses.asdict(variant), "reason": reason}
                )
                continue
            try:
                row = run_cell(variant, case, cfg, models, runners, bank, dtype, opts, hbm, rates, itemsize)
            except Exception as e:  # one broken cell must not lose the others
                payload["not_run"].append(
                    {
                        "case": dataclasses.asdict(case),
                        **dataclasses.asdict(variant),
                        "reason": f"{type(e).__name__}: {e}"[:400],
                    }
                )
                print(f"  FAILED {variant} {case}: {type(e).__name__}: {e}", flush=True)
                continue
            payload["rows"].append(row)
            set_vs_bf16(payload["rows"])
            print("  " + json.dumps(row), flush=True)
            write(payload, opts.out)
    payload["wall_s"] = round(time.perf_counter() - t_start, 1)
    write(payload, opts.out)
    return payload


def build_models(dense, variants: tuple[Variant, ...]) -> dict[tuple[str, bool | None], object]:
    """(weights, layout's kmajor) -> the model every variant of it runs: the dense draw, quantized
    once per format and layout the variants need (the same underlying weights everywhere)."""
    models = {}
    for v in variants:
        key = (v.weights, v.kmajor)
        if key not in models:
            models[key] = dense if v.gemm == "dense" else quantized_model(dense, v.weights, kmajor=v.kmajor)
    jax.block_until_ready([m.params for m in models.values()])
    return models


def skip_reason(variant: Variant, case: Case) -> str | None:
    """Why a cell would only repeat another one, or None: the Mosaic kernel by name takes steps of
    at most QUANT_KERNEL_MAX_TOKENS tokens, above which the step is fp8-kmajor-weight-only's."""
    if variant.kernel == "mgpu" and case.tokens > QUANT_KERNEL_MAX_TOKENS:
        return f"above {QUANT_KERNEL_MAX_TOKENS} tokens the step runs XLA's path: the kmajor weight-only program"
    return None


def set_vs_bf16(rows: list[dict]) -> None:
    """vs_bf16 = step_ms / the dense row's of the same case (None until that row exists), so that
    the dense variant need not run first."""
    dense = {r["case_label"]: r["step_ms"] for r in rows if r["gemm"] == "dense"}
    for r in rows:
        base = dense.get(r["case_label"])
        r["vs_bf16"] = round(r["step_ms"] / base, 3) if base else None


def selected_variants(opts: argparse.Namespace) -> tuple[Variant, ...]:
    return _by_label(VARIANTS, opts.variants, "--variants")


def selected_cases(opts: argparse.Namespace) -> tuple[Case, ...]:
    return _by_label(SMOKE_CASES if opts.smoke else GPU_CASES, opts.cases, "--cases")


def _by_label(items: tuple, names: list[str] | None, flag: str) -> tuple:
    """The items `names` picks by label, in that order (all when None); SystemExit for an unknown one."""
    if not names:
        return items
    by_label = {item.label: item for item in items}
    unknown = set(names) - set(by_label)
    if unknown:
        raise SystemExit(f"{flag} {sorted(unknown)}: choose from {list(by_label)}")
    return tuple(by_label[name] for name in names)


def run_cell(variant, case, cfg, models, runners, bank, dtype, opts, hbm, rates, itemsize) -> dict:
    if variant not in runners:
        config = engine_config(variant, selected_cases(opts), dtype)
        model = models[(variant.weights, variant.kmajor)]
        runners[variant] = Runner(model, config, kernels=config.step_kernels(fused_projections=model.fused))
        gc.collect()
    runner = runners[variant]
    step, layout, packed = time_step(runner, bank, case, opts.steps)
    floor = step_bytes(cfg, variant, case, itemsize) / (hbm * 1e9) * 1e3
    rate = rates[variant.weights] if variant.gemm == "w8a8" else rates["bf16"]
    row = {
        "variant": variant.label,
        "weights": "f32" if opts.smoke and variant.weights == "bf16" else variant.weights,
        "gemm": variant.gemm,
        "layout": None if runner.model.quantization is None else ("kmajor" if runner.model.kmajor else "in-out"),
        "kernel": variant.kernel,
        "case": case.name,
        "case_label": case.label,
        "decode_rows": case.decode_rows,
        "tokens": case.tokens,
        "distinct_adapters": min(DISTINCT, case.decode_rows),
        "rank": RANK,
        "step_ms": round(step, 3),
        "floor_ms": round(floor, 3),
        "roofline_ms": round(max(floor, step_flops(cfg, case) / (rate * 1e12) * 1e3), 3),
        "path": runner.kernels.describe(case.tokens),
    }
    if variant.gemm == "w8a8" and jax.default_backend() == "gpu" and case.tokens == max(c.tokens for c in GPU_CASES):
        row["fp8_gemm"] = fp8_gemm_report(runner, bank, layout, packed)
    if case.label in opts.profile:
        row["ops_ms"] = profile_step(runner, bank, layout, packed)
    return row


def profile_step(runner: Runner, bank, layout: StepLayout, packed: jax.Array) -> dict:
    """The step's device time by op kind and its top ops (`benchmarks.step.profile.op_split`); run
    with XLA_FLAGS=--xla_gpu_enable_command_buffer= so that kernels show one by one."""
    from benchmarks.step.profile import op_split

    static = runner.step_static

    def step() -> jax.Array:
        ids, runner.kv, _ = packed_step(
            runner.params, bank, runner.kv, packed, runner.last_ids, layout=layout, **static
        )
        runner.last_ids = ids
        return ids

    return op_split(step)


def write(payload: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "formats.json").write_text(json.dumps(payload, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=results_dir(__file__))
    p.add_argument("--smoke", action="store_true", help="toy model on the CPU (seconds)")
    p.add_argument("--steps", type=int, default=10, help="steps timed back to back per cell")
    p.add_argument("--budget-s", type=float, default=420.0, help="no new cell starts once this is spent")
    p.add_argument(
        "--cases",
        nargs="+",
        default=[],
        help="run only these cases, in this order (GPU: decode-64 mixed-2048 decode-16 mixed-512; smoke: decode-4 mixed-24)",
    )
    p.add_argument(
        "--variants",
        nargs="+",
        default=[],
        help=f"run only these variants, in this order (default all: {' '.join(v.label for v in VARIANTS)})",
    )
    p.add_argument(
        "--profile",
        nargs="*",
        default=[],
        help="cases whose rows get a per-op device-time split (`ops_ms`); set "
        "XLA_FLAGS=--xla_gpu_enable_command_buffer= so that the profiler sees each kernel",
    )
    opts = p.parse_args(argv)
    _by_label(selected_cases(opts), opts.profile, "--profile")  # a profiled case must be one that runs
    payload = run(opts)
    print(f"wrote {opts.out / 'formats.json'} ({len(payload['rows'])} rows, {len(payload['not_run'])} not run)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
