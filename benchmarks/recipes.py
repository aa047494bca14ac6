"""Named device runs: each recipe is the benchmark parts one device call runs, in order, under one wall
clock (`benchmarks/run.sh RECIPE`). Parts are data, so what a results README calls "the floor run" or
"the serving probe" is reproducible by name.

In a part's arguments, `{out}` is the part's output folder, `{budget_s}` the seconds the part may
spend (its timeout less `margin_s`, for benchmarks that stop adding cases in time), and any other
`{name}` a recipe variable (defaults in `Recipe.variables`, set with `--set name=value`).
Standard library only: the runner imports this without JAX.
"""

from __future__ import annotations

import dataclasses
import shlex

CUBLAS = "--xla_gpu_enable_triton_gemm=false"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Part:
    """One benchmark process: `python -m benchmarks.<module> *args` under `timeout`."""

    module: str  # GROUP.NAME under benchmarks/, e.g. "serving.trace"
    args: str = ""  # the module's arguments as a shell would read them (placeholders as words)
    label: str = ""  # tells two parts of one module apart in the run folder's name
    xla_flags: str | None = None  # XLA_FLAGS for this part; None inherits the caller's
    cap_s: int | None = None  # the most seconds this part may run
    reserve_s: int = 0  # seconds kept for the parts after this one
    share: float = 1.0  # of the time left (less reserve_s): 1/2 then 1 splits the rest evenly in two
    margin_s: int = 0  # {budget_s} = timeout - margin_s
    min_s: int = 25  # skipped when less than this is left for it
    drop: tuple[str, ...] = ()  # extra log lines to drop (regexes), beside the runner's noise filter

    def __post_init__(self):
        if self.cap_s is not None and self.cap_s < self.min_s:
            raise ValueError(f"{self.module}: {self.cap_s=} must be >= {self.min_s=}")
        if not 0 < self.share <= 1:
            raise ValueError(f"{self.module}: {self.share=} must be in (0, 1]")

    @property
    def words(self) -> list[str]:
        return shlex.split(self.args)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recipe:
    doc: str
    parts: tuple[Part, ...]
    total_s: int = 560  # the default wall clock (one device command runs 600 s at most)
    variables: dict[str, str] = dataclasses.field(default_factory=dict)


HOST_FLAG_SETS = (
    ("default", ""),
    ("nocb", "--xla_gpu_enable_command_buffer="),
    ("min1", "--xla_gpu_graph_min_graph_size=1"),
    ("cublas", CUBLAS),
    ("cublas_nocb", f"{CUBLAS} --xla_gpu_enable_command_buffer="),
)
E2E_JSON_ROWS = (r"^  \{",)  # e2e prints every row as JSON too; the table lines say the same
GEMM = "--layers 8 --out {out}"
E2E = "--no-plots --budget-s {budget_s} --out {out}"
HOST = "--steps 60 --warmup-steps 20 --profile-steps 0 --out {out}"
TRACE = "--duration 25 --max-drain-s 20 --budget-s {budget_s} --out {out}"


def _trace_arms(flag: str, arms: tuple[str, ...]) -> tuple[Part, ...]:
    """An A/B(/C...) of S-LoRA's trace, one process per arm (`flag ARM`), the same draw, the clock
    split evenly (arm i takes 1 / (arms left) of what is left); the recipe's variables give the
    setting(s), rate(s) and setup_s."""
    return tuple(
        Part(
            module="serving.trace",
            label=arm,
            args=f"--settings {{setting}} --rates {{rate}} --probe-steps 0 --setup-s {{setup_s}} {flag} {arm} {TRACE}",
            share=share,
            margin_s=8,
        )
        for arm, share in zip(arms, [1 / (len(arms) - i) for i in range(len(arms))], strict=True)
    )


RECIPES: dict[str, Recipe] = {
    "e2e": Recipe(
        doc="`jaxlora bench`'s plan on the 7B shape, every group in plan order (the e2e table).",
        total_s=580,
        parts=(Part(module="engine.e2e", args=E2E, margin_s=35),),
    ),
    "e2e_check": Recipe(
        doc="The engine checked on the GPU (fused layout + cuBLAS + Pallas against separate + XLA: same "
        "greedy tokens), then `jaxlora bench`'s closed-loop rows for the pallas and xla backends.",
        parts=(
            Part(module="engine.gpu_check", args="--out {out}", cap_s=150),
            Part(module="engine.e2e", args=f"--backend pallas --backend xla {E2E}", margin_s=40, drop=E2E_JSON_ROWS),
        ),
    ),
    "e2e_formats": Recipe(
        doc="`jaxlora bench`'s first group on bf16, FP8 and int8 bases in one process, then the "
        "closed-loop rows of the pallas and xla backends.",
        total_s=580,
        variables={"formats_s": "190"},
        parts=(
            Part(
                module="engine.e2e",
                label="formats",
                args="--backend pallas --quantize bf16 fp8 int8 --budget-s {formats_s} --no-plots --out {out}",
                cap_s=250,
                drop=E2E_JSON_ROWS,
            ),
            Part(
                module="engine.e2e",
                label="backends",
                args=f"--backend pallas --backend xla {E2E}",
                margin_s=45,
                drop=E2E_JSON_ROWS,
            ),
        ),
    ),
    "mgpu": Recipe(
        doc="The Mosaic GPU 8-bit GEMM checked and timed, then `jaxlora bench` on bf16 / int8 / fp8 bases "
        "for plan groups e2e_groups (B=64, 16, 128), then the one-row CONCURRENT A/B of the host loop "
        "(each part skipped when the clock has run out).",
        variables={"e2e_s": "200", "e2e_groups": "0 2 4"},
        parts=(
            Part(module="kernels.quant_mgpu", args="--out {out}", reserve_s=230, drop=("^gemm",)),
            Part(
                module="engine.e2e",
                args="--backend pallas --quantize bf16 int8 fp8 --groups {e2e_groups} --budget-s {e2e_s} "
                "--no-plots --out {out}",
                reserve_s=150,
                drop=E2E_JSON_ROWS,
            ),
            *(
                Part(
                    module="engine.host_loop",
                    label=f"cmt{cmt}",
                    args=f"--cases 1:1 16:16 --steps 40 --warmup-steps 10 --profile-steps 0 --probe-reps 0 "
                    f"--concurrent-min-tokens {cmt} --out {{out}}",
                    cap_s=70,
                )
                for cmt in (1, 100000)
            ),
        ),
    ),
    "decode_floor": Recipe(
        doc="The 8-bit GEMMs in the serving layout (kernels against XLA and bf16 cuBLAS, 16-256 rows), the "
        "engine's host loop at full depth with a profile of the idle gap between steps, and the LoRA "
        "kernel table.",
        parts=(
            Part(
                module="kernels.quant_gemm",
                args=f"{GEMM} --batch 16 64 128 256 --formats bf16-fused int8-fused int8-fused-pallas "
                "fp8-fused-pallas --time-budget 110",
                xla_flags=CUBLAS,
                cap_s=130,
            ),
            Part(
                module="engine.host_loop",
                args="--cases 64:64 256:256 --steps 60 --warmup-steps 20 --profile-steps 12 --probe-reps 5 --out {out}",
                cap_s=170,
            ),
            Part(module="kernels.lora", args="all --out {out} --budget-s {budget_s} --layers 8", margin_s=30),
        ),
    ),
    "floor": Recipe(
        doc="Where a ragged decode step's time goes: the 8-bit GEMMs under several XLA_FLAGS sets, the step "
        "per LoRA backend (decode 64 / 256 rows, no adapters and 64 rank-16 all-module ones), the same "
        "op by op with command buffers off, and the host loop; 8 of the 32 layers.",
        total_s=540,
        parts=(
            *(
                Part(
                    module="kernels.quant_gemm",
                    label=label,
                    args=f"{GEMM} {cases}",
                    xla_flags=flags,
                    cap_s=cap,
                    reserve_s=20,
                    min_s=30,
                )
                for label, flags, cap, cases in (
                    ("default", "", 120, "--batch 16 64 256 --formats bf16 bf16-fused int8 fp8"),
                    ("cublas", CUBLAS, 60, "--batch 64 256 --formats bf16 bf16-fused"),
                    ("triton_any", "--xla_gpu_triton_gemm_any=true", 70, "--batch 64 --formats bf16 int8 fp8"),
                    ("cublaslt", "--xla_gpu_enable_cublaslt=true", 50, "--batch 64 --formats bf16 bf16-fused"),
                )
            ),
            Part(
                module="step.profile",
                label="steps",
                args="--layers 8 --settings none all --backends pallas xla --mixes d64 d256 --reps 20 --out {out}",
                cap_s=130,
                reserve_s=200,
            ),
            Part(
                module="step.profile",
                label="ops",
                args="--layers 8 --settings none all --backends pallas --mixes d64 --profile d64 --reps 10 --out {out}",
                xla_flags="--xla_gpu_enable_command_buffer=",
                cap_s=70,
                reserve_s=140,
            ),
            Part(module="engine.host_loop", args=f"--layers 8 --cases 64:64 256:256 {HOST}", reserve_s=10, min_s=40),
        ),
    ),
    "layout": Recipe(
        doc="The step before and after the serving layout (q|k|v, gate|up fused) and cuBLAS GEMMs in one "
        "process, and the H200's native FP8 GEMM; 8 of the 32 layers.",
        total_s=540,
        parts=(
            Part(
                module="step.profile",
                label="pallas",
                args="--layers 8 --settings none all --backends pallas --mixes d64 d256 p512 "
                "--variants separate/xla fused/xla fused/cublas --reps 20 --out {out}",
                cap_s=330,
                reserve_s=150,
            ),
            Part(
                module="step.profile",
                label="xla",
                args="--layers 8 --settings all --backends xla --mixes d64 d256 "
                "--variants separate/xla fused/cublas --reps 20 --out {out}",
                cap_s=60,
                reserve_s=120,
            ),
            *(
                Part(
                    module="kernels.quant_gemm",
                    label=label,
                    args=f"{GEMM} --batch 16 64 256 --formats bf16-fused fp8-native int8-pallas",
                    xla_flags=flags,
                    cap_s=60,
                    reserve_s=10,
                )
                for label, flags in (("fp8", ""), ("fp8_cublas", CUBLAS))
            ),
        ),
    ),
    "e2e_quant": Recipe(
        doc="8-bit GEMMs without a slice of the stacked weights, then `jaxlora bench`'s closed-loop rows and "
        "its first group on fp8 / int8 bases.",
        total_s=575,
        parts=(
            Part(
                module="kernels.quant_gemm",
                label="layers",
                args=f"{GEMM} --batch 16 64 256 --formats bf16-fused fp8-kmajor-layers int8-kmajor-layers",
                xla_flags=CUBLAS,
                cap_s=80,
            ),
            Part(
                module="kernels.quant_gemm",
                label="dsfusion",
                args=f"{GEMM} --batch 64 --formats fp8-kmajor int8-kmajor",
                xla_flags=f"{CUBLAS} --xla_gpu_enable_dynamic_slice_fusion=true",
                cap_s=45,
            ),
            Part(
                module="engine.e2e",
                label="bf16",
                args=f"--backend pallas --backend xla {E2E}",
                reserve_s=150,
                margin_s=40,
            ),
            Part(module="engine.e2e", label="quant", args=f"--backend pallas --quantize fp8 int8 {E2E}", margin_s=40),
        ),
    ),
    "lora_groups": Recipe(
        doc="The four LoRA module groups of a 7B layer (8 layers): split launches with the per-row or the "
        "tile expand, the one-launch candidates and XLA, per slot pattern.",
        total_s=540,
        parts=(
            Part(
                module="kernels.lora_groups",
                args="--layers 8 --tokens 64 256 16 512 --ranks 16 64 --check-ranks 8 32 --budget-s {budget_s} --out {out}",
                margin_s=50,
                drop=("return rule\\(ctx",),
            ),
        ),
    ),
    "paging_hf": Recipe(
        doc="Adapter paging on S-LoRA's S1 setting (2,000 registered, power-law exponents 1 and 0.1), then "
        "the Hugging Face peer in its own process (torch).",
        total_s=580,
        parts=(
            Part(
                module="engine.paging",
                args="--setting s1 --exponents 1 0.1 --registered 2000 --requests 512 --budget-s {budget_s} --out {out}",
                reserve_s=150,
                margin_s=25,
            ),
            Part(
                module="engine.hf_peer",
                args="--out {out}/hf_peer.json --gen-len 128 --mixed-gen-len 4",
                drop=("Warning",),
            ),
        ),
    ),
    "host_flags": Recipe(
        doc="The full-depth host loop once per XLA_FLAGS set, the clock split evenly: host ms a step and "
        "the token digest per set.",
        variables={"cases": "64:64"},
        parts=tuple(
            Part(
                module="engine.host_loop",
                label=label,
                args=f"--cases {{cases}} --probe-reps 0 {HOST}",
                xla_flags=flags,
                share=1 / (len(HOST_FLAG_SETS) - i),
            )
            for i, (label, flags) in enumerate(HOST_FLAG_SETS)
        ),
    ),
    "serving_probe": Recipe(
        doc="The K-major W8A8 GEMMs (default flags and cuBLAS), then S-LoRA's trace on setting s1 at 40, 10 "
        "and 4 req/s (25 s of arrivals, 20 s drain cap).",
        total_s=570,
        parts=(
            *(
                Part(
                    module="kernels.quant_gemm",
                    label=label,
                    args=f"{GEMM} --batch 16 64 256 --formats bf16-fused fp8-kmajor int8-kmajor",
                    xla_flags=flags,
                    cap_s=75,
                )
                for label, flags in (("kmajor_cublas", CUBLAS), ("kmajor", ""))
            ),
            Part(
                module="serving.trace",
                args=f"--settings s1 --rates 40 10 4 --setup-s 150 {TRACE}",
                margin_s=10,
                reserve_s=5,
            ),
        ),
    ),
    "serving_ab": Recipe(
        doc="An A/B of the LoRA group rule on S-LoRA's trace, one process per arm (--lora-groups split, then "
        "tuned), the same draw, the clock split evenly; setup_s is the set-up time the benchmark budgets for.",
        variables={"setting": "all", "rate": "40", "setup_s": "150"},
        parts=_trace_arms("--lora-groups", ("split", "tuned")),
    ),
    "paged_bank": Recipe(
        doc="Issue 38's rows: S-LoRA's trace on the padded bank, then on the unified bank (true rank in the KV "
        "pool's pages), one process per arm, the same draw, the clock split evenly; one setting a call (s2's set-up "
        "takes ~80 s an arm on an H100). s2's mixed ranks are where the padded bank pays most; rows carry `bank` "
        "and the pool column (the paged bank, true-rank pools of its own: `serving.trace --bank paged`).",
        variables={"setting": "s2", "rate": "40 10", "setup_s": "90"},
        parts=_trace_arms("--bank", ("padded", "unified")),
    ),
    "prefix_cache": Recipe(
        doc="The prefix cache on and off from one engine per setting: the multi-turn chat trace at 10 "
        "conversations/s and at saturation (20), then S-LoRA's s1 at 40 req/s (no shared prefixes: what the "
        "hashing and bookkeeping cost).",
        total_s=500,
        parts=(
            Part(
                module="serving.trace",
                label="chat",
                args="--trace chat --rates 10 20 --prefix-cache both --duration 10 --max-drain-s 25 --probe-steps 0 --budget-s '{budget_s}' --setup-s 120 --out '{out}'",
                reserve_s=190,
                margin_s=10,
            ),
            Part(
                module="serving.trace",
                label="s1",
                args="--settings s1 --rates 40 --prefix-cache both --duration 15 --max-drain-s 15 --probe-steps 0 --budget-s '{budget_s}' --setup-s 110 --out '{out}'",
                margin_s=8,
            ),
        ),
    ),
}
