"""Tensor parallelism on two GPUs: the Llama-2-7B shape on TP 1 vs TP 2, and a Llama-2-70B shape
(about 138 GB of bf16 weights: no single H200 holds it with a KV cache) on TP 2.

A *case* is the engine's jitted step (`jaxlora.engine.runner.ragged_step` with the kernels the
engine picks on this platform) compiled for a decode-only batch (`benchmarks.common.decode_inputs`:
one token per row, T = batch, each row over its own KV pages) for one (model, tensor, batch, with or
without the bank). Within a case only data changes, so it is timed for each distinct-adapter count d at no
extra compile (row i on adapter 1 + i % d; d = 0: every row on the base slot 0). A case without
the bank times the bank-free step the engine dispatches when no row has an adapter. Per cell:

  step_ms       `--steps` calls back to back, each row's token taken on the device from the previous
                call's ids (the engine's decode path), every row at context `position`; one block
                at the end
  floor_ms      what ONE GPU must read per step (its shard of the weights, of the KV cache at that
                context and of each distinct adapter: jaxlora.parallel.sharding's layouts) over the
                device-to-device copy bandwidth measured in this run (bytes read + written)
  tokens_per_s  batch / step (decode only)

Per case, lower_s and compile_s: the step is compiled ahead of time and the timed calls run that
executable, so an argument placed differently from the compiled layout fails the case instead of
silently compiling a second program inside the timed loop (what a 7B TP 2 step of 2.4 s was: one
compile averaged over ten steps); a backend-compile counter checks the timed loop too.

Besides the cases:
  greedy     `--greedy-steps` greedy tokens per row (1-token prompts, every row on its own
             adapter) on TP 1 and TP 2, compared token for token
  allreduce  2L + 1 chained all-reduces of [B, D] in the model dtype: the collectives one TP step
             issues, timed alone
  profile    device time of the all-reduces inside the 7B TP 2 step, from a profiler trace (GPU)

Weights and banks are random, drawn on the devices already split (the 70B model never exists whole
on one device or on the host), with the same values on TP 1 and TP 2. Results are rewritten to
OUT/tp.json and OUT/tp.md after every case; a failing case is recorded with its error and the next
one runs; no case starts once `--budget-s` is spent (listed as not run).

    python -m benchmarks.step.tp --budget-s 500                              # 2 x H200
    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
        python -m benchmarks.step.tp --tiny --out /tmp/tp                      # CPU smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import shlex
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from benchmarks.common import LLAMA2_7B, TINY, decode_inputs, hbm_gbps, random_bank, slot_pattern
from benchmarks.paths import results_dir
from jaxlora.config import LoraConfig, ModelConfig
from jaxlora.engine.compiles import backend_compiles, check_no_compiles
from jaxlora.engine.config import EngineConfig
from jaxlora.engine.kv_pages import pages_for
from jaxlora.engine.runner import Runner, ragged_step
from jaxlora.model.sharded import random_sharded_model
from jaxlora.parallel import MeshConfig, make_mesh
from jaxlora.parallel.mesh import TENSOR_AXIS

LLAMA2_70B = ModelConfig(
    vocab_size=32000,
    hidden_size=8192,
    intermediate_size=28672,
    num_layers=80,
    num_heads=64,
    num_kv_heads=8,
    head_dim=128,
    max_position_embeddings=4096,
    name="llama-2-70b-shape",
)
TINY_GQA = ModelConfig(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_layers=3,
    num_heads=8,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    name="tiny-gqa",
)
MODELS = {"7b": LLAMA2_7B, "70b": LLAMA2_70B, "tiny": TINY, "tiny-gqa": TINY_GQA}
RANK = 16
PROMPT_LEN, GEN_LEN = 128, 128  # the cache holds prompt + gen; steps run at the mean context
PAGE_SIZE = 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    """One compiled decode step and the distinct-adapter counts timed on it.

    bank=False: the bank-free step (distinct must be (0,)). greedy: also run the short greedy
    run on this step (with max(distinct) adapters, one per row).
    """

    model: str
    tensor: int
    batch: int
    distinct: tuple[int, ...]
    bank: bool = True
    greedy: bool = False
    est_s: float = 60.0  # rough upper bound of draw + compile + runs, for the budget

    def __post_init__(self) -> None:
        if not self.bank and self.distinct != (0,):
            raise ValueError(f"a bank-free case runs only d=0, got distinct={self.distinct}")

    @property
    def max_slots(self) -> int:
        return max(2, max(self.distinct) + 1)

    @property
    def label(self) -> str:
        bank = f"d={list(self.distinct)}" if self.bank else "bank-free"
        return f"{self.model} TP{self.tensor} B={self.batch} {bank}"


def h200_plan() -> list[Case]:
    """Priority order: the slowdown check (7B B=64, TP 1 and TP 2, with the greedy comparison), the
    70B shape, B=256 scaling with and without the bank; what one 560 s device call leaves (the
    B=64 and 70B bank-free steps) comes last."""
    c = Case
    return [
        c(model="7b", tensor=1, batch=64, distinct=(64, 0), greedy=True, est_s=60),
        c(model="7b", tensor=2, batch=64, distinct=(64, 0), greedy=True, est_s=70),
        c(model="70b", tensor=2, batch=16, distinct=(16, 0), est_s=150),
        c(model="70b", tensor=2, batch=64, distinct=(16, 0), est_s=110),
        c(model="7b", tensor=1, batch=256, distinct=(256, 64, 0), est_s=50),
        c(model="7b", tensor=2, batch=256, distinct=(256, 64, 0), est_s=50),
        c(model="7b", tensor=1, batch=256, distinct=(0,), bank=False, est_s=35),
        c(model="7b", tensor=2, batch=256, distinct=(0,), bank=False, est_s=35),
        c(model="7b", tensor=1, batch=64, distinct=(0,), bank=False, est_s=35),
        c(model="7b", tensor=2, batch=64, distinct=(0,), bank=False, est_s=35),
        c(model="70b", tensor=2, batch=16, distinct=(0,), bank=False, est_s=120),
        c(model="70b", tensor=2, batch=64, distinct=(0,), bank=False, est_s=90),
    ]


def tiny_plan() -> list[Case]:
    """Every code path on toy models: TP 1 vs TP 2 with the bank and greedy, a GQA model bank-free."""
    c = Case
    return [
        c(model="tiny", tensor=1, batch=4, distinct=(4, 0), greedy=True, est_s=5),
        c(model="tiny", tensor=2, batch=4, distinct=(4, 0), greedy=True, est_s=5),
        c(model="tiny-gqa", tensor=2, batch=4, distinct=(0,), bank=False, est_s=5),
    ]


# -- placement and bytes ------------------------------------------------------------------------------


def replicated(runner: Runner) -> jax.sharding.Sharding:
    """Where the step's small inputs go: every device of the runner (one device without a mesh)."""
    if runner.mesh is None:
        return SingleDeviceSharding(jax.devices()[0])
    return NamedSharding(runner.mesh, P())


def local_bytes(x: jax.Array) -> int:
    """Bytes of one device's shard of x."""
    return int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize


def weight_bytes_per_gpu(model) -> int:
    """One GPU's shard of every weight a decode step reads (the embedding table only when it is also
    the LM head: otherwise a step gathers B rows of it)."""
    tied = model.config.tie_word_embeddings
    return sum(local_bytes(a) for name, a in model.flat_params().items() if tied or name != "embed_tokens.embedding")


def kv_bytes_per_gpu(cfg: ModelConfig, batch: int, context: int, itemsize: int, tensor: int) -> int:
    """K and V of `context` positions of every row and layer, for this GPU's KV heads."""
    return 2 * cfg.num_layers * batch * context * (cfg.num_kv_heads // tensor) * cfg.head_dim * itemsize


def adapter_bytes_per_gpu(bank: dict) -> int:
    """One slot's share of this GPU's bank (every module at the bank's rank: the true adapter)."""
    return sum(local_bytes(a) // a.shape[1] for a in jax.tree.leaves(bank))


# -- one case -----------------------------------------------------------------------------------------


# The step's array arguments after params, bank and pool, in ragged_step's order.
STEP_INPUTS = ("tokens", "src", "positions", "slot_ids", "batch", "sampling")


def step_inputs(runner: Runner, place: jax.sharding.Sharding, slots: np.ndarray, position: int) -> tuple:
    """ragged_step's STEP_INPUTS for a decode-only batch: row b's one token at `position` on slot
    slots[b], taken on the device from the previous step's ids (src = row, as the engine decodes)."""
    inputs = decode_inputs(runner, slots, position)
    inputs["src"] = np.arange(runner.config.max_batch, dtype=np.int32)
    return jax.device_put(tuple(inputs[k] for k in STEP_INPUTS), place)


@dataclasses.dataclass
class Step:
    """A compiled decode-only step, where its inputs go (as compiled) and the live page pool."""

    runner: Runner
    compiled: Callable
    bank: dict | None
    kv: object
    tokens: jax.Array  # [B] int32, the first step's tokens (fed in as the previous step's ids)
    position: int  # the context the timed steps run at
    place: jax.sharding.Sharding

    def inputs(self, slots: np.ndarray, position: int) -> tuple:
        return step_inputs(self.runner, self.place, slots, position)

    def __call__(self, inputs: tuple, last_ids: jax.Array) -> jax.Array:
        ids, self.kv = self.compiled(self.runner.params, self.bank, self.kv, *inputs, last_ids)
        return ids


def compile_step(runner: Runner, bank: dict | None, position: int) -> tuple[Step, dict]:
    """Lowers and compiles the engine's step on a decode-only batch for this runner ahead of time."""
    B = runner.config.max_batch
    place = replicated(runner)
    tokens = jax.device_put(
        np.random.default_rng(0).integers(0, runner.model.config.vocab_size, B, dtype=np.int32), place
    )
    inputs = step_inputs(runner, place, np.zeros(B, np.int32), position)
    t0 = time.perf_counter()
    lowered = ragged_step.trace(runner.params, bank, runner.kv, *inputs, tokens, **runner.step_static).lower()
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    step = Step(
        runner=runner, compiled=compiled, bank=bank, kv=runner.kv, tokens=tokens, position=position, place=place
    )
    return step, {"lower_s": round(t1 - t0, 2), "compile_s": round(t2 - t1, 2)}


def time_step(step: Step, slots: np.ndarray, steps: int) -> float:
    """Milliseconds per call, `steps` calls back to back with the ids fed back (after two warm-up calls)."""
    inputs = step.inputs(slots, step.position)
    ids = step.tokens
    for _ in range(2):
        ids = step(inputs, ids)
    ids.block_until_ready()
    compiles = backend_compiles()
    t0 = time.perf_counter()
    for _ in range(steps):
        ids = step(inputs, ids)
    ids.block_until_ready()
    seconds = time.perf_counter() - t0
    check_no_compiles(compiles, "the timed decode steps")
    return seconds / steps * 1e3


def greedy_tokens(step: Step, distinct: int, num_steps: int) -> list[list[int]]:
    """[B][num_steps] greedy ids from 1-token prompts at position 0, row i on adapter 1 + i % distinct.

    Positions 0..num_steps-1 are written by this run before they are read (the timing steps wrote
    only at the later `position`), so every TP size starts from the same cache contents.
    """
    B = step.runner.config.max_batch
    slots = slot_pattern(B, distinct)
    ids = jax.device_put(np.arange(B, dtype=np.int32) % step.runner.model.config.vocab_size, step.place)
    out = []
    for p in range(num_steps):
        ids = step(step.inputs(slots, p), ids)
        out.append(np.asarray(ids))
    return np.stack(out, axis=1).tolist()


def sum_of_squares(tree) -> float:
    """Sum of x**2 over every array of a pytree (float32): shows that two runs drew the same weights."""
    return float(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def engine_config(case: Case, backend: str, dtype: str) -> EngineConfig:
    """One step shape (T = batch: a decode-only batch) and a page pool of every row at full length."""
    lora = LoraConfig(max_slots=case.max_slots, max_rank=RANK, backend=backend)
    max_seq_len = PROMPT_LEN + GEN_LEN
    return EngineConfig(
        max_batch=case.batch,
        max_seq_len=max_seq_len,
        token_budgets=(case.batch,),
        page_size=PAGE_SIZE,
        num_pages=case.batch * pages_for(max_seq_len, PAGE_SIZE),
        max_new_tokens_limit=GEN_LEN,
        lora=lora,
        dtype=dtype,
        mesh=MeshConfig(tensor=case.tensor),
    )


class Models:
    """One model alive at a time, drawn in its shards on the case's devices."""

    def __init__(self, dtype: jnp.dtype) -> None:
        self.dtype = dtype
        self._key: tuple[str, int] | None = None
        self._model = None
        self.mesh: jax.sharding.Mesh | None = None  # the mesh the current model is drawn on

    def get(self, name: str, tensor: int):
        if self._key != (name, tensor):
            self._model = None
            gc.collect()
            t0 = time.perf_counter()
            self.mesh = make_mesh(MeshConfig(tensor=tensor))
            self._model = random_sharded_model(MODELS[name], self.mesh, dtype=self.dtype)
            jax.block_until_ready(self._model.params)
            self._key = (name, tensor)
            print(f"  drew {name} on {tensor} device(s) in {time.perf_counter() - t0:.1f} s", flush=True)
        return self._model


def run_case(
    case: Case,
    models: Models,
    *,
    backend: str,
    hbm: float,
    steps: int,
    greedy_steps: int,
    emit: Callable[[dict], None],
    payload: dict,
    profile: bool,
) -> None:
    """Compiles the case's step and emits one row per distinct count; adds the greedy tokens to
    payload["_greedy"] and, with `profile`, the step's all-reduce time to payload["profile"]."""
    model = models.get(case.model, case.tensor)
    cfg, itemsize = model.config, jnp.dtype(models.dtype).itemsize
    config = engine_config(case, backend, jnp.dtype(models.dtype).name)
    runner = Runner(
        model,
        config,
        kernels=config.step_kernels(fused_projections=model.fused),
        mesh=models.mesh if case.tensor > 1 else None,  # the model's own mesh, not a second one
    )
    bank = None
    if case.bank:
        bank = random_bank(cfg, runner.config.lora, max(case.distinct), models.dtype, mesh=runner.mesh)
    position = PROMPT_LEN + GEN_LEN // 2
    step, compile_info = compile_step(runner, bank, position)
    print(f"  lowered in {compile_info['lower_s']} s, compiled in {compile_info['compile_s']} s", flush=True)
    base_bytes = weight_bytes_per_gpu(model) + kv_bytes_per_gpu(cfg, case.batch, position + 1, itemsize, case.tensor)
    per_adapter = adapter_bytes_per_gpu(bank) if bank is not None else 0
    for i, d in enumerate(case.distinct):
        ms = time_step(step, slot_pattern(case.batch, d), steps)
        floor = (base_bytes + d * per_adapter) / (hbm * 1e9) * 1e3
        emit(
            {
                "case": case.label,
                "model": cfg.name,
                "tensor": case.tensor,
                "batch": case.batch,
                "bank": case.bank,
                "distinct": d,
                "backend": backend,
                "rank": RANK,
                "position": position,
                "step_ms": round(ms, 3),
                "floor_ms": round(floor, 3),
                "x_floor": round(ms / floor, 2),
                "tokens_per_s": round(case.batch / ms * 1e3, 1),
                "gb_per_gpu": round((base_bytes + d * per_adapter) / 1e9, 2),
                **(compile_info if i == 0 else {}),
            }
        )
    if case.greedy:
        payload["_greedy"][f"{case.model}/B{case.batch}/tp{case.tensor}"] = {
            "tokens": greedy_tokens(step, max(case.distinct), greedy_steps),
            "sumsq": sum_of_squares(runner.params) + sum_of_squares(bank),
        }
    if profile:
        payload["profile"] = profile_allreduce(
            step, slot_pattern(case.batch, max(case.distinct)), case.label, case.tensor
        )


# -- collectives alone and in a profile ---------------------------------------------------------------


def allreduce_chain_ms(cfg: ModelConfig, tensor: int, batch: int, dtype: jnp.dtype, steps: int) -> dict:
    """2L + 1 dependent all-reduces of [batch, hidden] (what one TP step issues), per call and per op."""
    mesh = make_mesh(MeshConfig(tensor=tensor))
    count = 2 * cfg.num_layers + 1

    def chain(x):
        for _ in range(count):
            x = jax.lax.psum(x, TENSOR_AXIS) * jnp.asarray(0.5, x.dtype)
        return x

    f = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
    x = jax.device_put(jnp.ones((batch, cfg.hidden_size), dtype), NamedSharding(mesh, P()))
    jax.block_until_ready(f(x))
    t0 = time.perf_counter()
    outs = [f(x) for _ in range(steps)]
    jax.block_until_ready(outs)
    ms = (time.perf_counter() - t0) / steps * 1e3
    return {
        "model": cfg.name,
        "tensor": tensor,
        "batch": batch,
        "all_reduces": count,
        "chain_ms": round(ms, 3),
        "per_all_reduce_us": round(ms / count * 1e3, 1),
    }


def profile_allreduce(step: Step, slots: np.ndarray, label: str, num_gpus: int, steps: int = 3) -> dict:
    """Device time per step of the all-reduces inside a compiled step, from a GPU profiler trace
    (summed over the GPUs' planes, then divided by their number: one GPU's share on average)."""
    from benchmarks.step.profile_decode import device_op_times

    inputs = step.inputs(slots, step.position)
    ops = device_op_times(lambda: step(inputs, step.tokens), steps=steps)
    collective = [
        (n, ms, k) for n, ms, k in ops if any(s in n.lower() for s in ("all-reduce", "allreduce", "all_reduce"))
    ]
    return {
        "case": label,
        "device_ms_per_gpu": round(sum(ms for _, ms, _ in ops) / num_gpus, 3),
        "allreduce_ms_per_gpu": round(sum(ms for _, ms, _ in collective) / num_gpus, 3),
        "allreduce_launches_per_gpu": sum(k for *_, k in collective) // num_gpus,
        "top_ops_both_gpus": ops[:12],
    }


# -- results ------------------------------------------------------------------------------------------


def greedy_summary(greedy: dict) -> list[dict]:
    """TP 1 vs TP n token for token, for every (model, batch) run on both."""
    out = []
    for key, ref in greedy.items():
        if not key.endswith("/tp1"):
            continue
        for other, got in greedy.items():
            if other.rsplit("/", 1)[0] != key.rsplit("/", 1)[0] or other == key:
                continue
            a, b = np.asarray(ref["tokens"]), np.asarray(got["tokens"])
            diverged = [int(np.argmax(ra != rb)) for ra, rb in zip(a, b) if (ra != rb).any()]
            out.append(
                {
                    "compare": f"{key} vs {other.rsplit('/', 1)[1]}",
                    "rows": int(a.shape[0]),
                    "steps": int(a.shape[1]),
                    "identical_rows": int(a.shape[0] - len(diverged)),
                    "identical_tokens": round(float((a == b).mean()), 4),
                    "first_divergence_step": min(diverged) if diverged else None,
                    # Both runs must have drawn the same weights and bank (float32 sums differ
                    # only by summation order).
                    "same_weights": abs(ref["sumsq"] - got["sumsq"]) <= 1e-4 * ref["sumsq"],
                }
            )
    return out


def targets(payload: dict) -> list[dict]:
    """The issue's targets with the measured figures (None where a needed cell did not run)."""
    rows = payload["rows"]

    def find(model, tensor, batch, distinct, bank=True):
        return next(
            (
                r
                for r in rows
                if (r["model"], r["tensor"], r["batch"], r["distinct"], r["bank"])
                == (model, tensor, batch, distinct, bank)
            ),
            None,
        )

    out = []
    m7 = MODELS["tiny" if payload["tiny"] else "7b"].name
    for batch, distinct in ((64, 64), (256, 64), (256, 256)):
        lora, none = find(m7, 2, batch, distinct), find(m7, 2, batch, 0, False) or find(m7, 2, batch, 0)
        ratio = None if not (lora and none) else lora["step_ms"] / none["step_ms"]
        out.append(
            {
                "target": f"7B TP2 B={batch}: {distinct} distinct within 1.2x of no adapters",
                "measured": None if ratio is None else round(ratio, 2),
                "met": None if ratio is None else ratio <= 1.2,
                "detail": None
                if ratio is None
                else f"{lora['step_ms']} vs {none['step_ms']} ms "
                f"({'bank-free' if not none['bank'] else 'd=0 with bank'})",
            }
        )
    for distinct, bank in ((0, False), (0, True), (64, True), (256, True)):
        one, two = find(m7, 1, 256, distinct, bank), find(m7, 2, 256, distinct, bank)
        ratio = None if not (one and two) else two["step_ms"] / one["step_ms"]
        out.append(
            {
                "target": f"7B B=256 d={distinct}{'' if bank else ' bank-free'}: TP2 step <= 0.6x TP1",
                "measured": None if ratio is None else round(ratio, 2),
                "met": None if ratio is None else ratio <= 0.6,
                "detail": None if ratio is None else f"{two['step_ms']} vs {one['step_ms']} ms",
            }
        )
    for g in payload["greedy"]:
        out.append(
            {
                "target": f"greedy tokens identical, {g['compare']}",
                "measured": g["identical_tokens"],
                "met": g["identical_rows"] == g["rows"],
                "detail": f"{g['identical_rows']}/{g['rows']} rows identical over {g['steps']} steps",
            }
        )
    m70 = MODELS["tiny-gqa" if payload["tiny"] else "70b"].name
    big = [r for r in rows if r["model"] == m70]
    worst = max(big, key=lambda r: r["x_floor"], default=None)
    out.append(
        {
            "target": "70B TP2: every decode step <= 1.6x its per-GPU bytes floor",
            "measured": None if worst is None else worst["x_floor"],
            "met": None if worst is None else all(r["x_floor"] <= 1.6 for r in big),
            "detail": None
            if worst is None
            else f"worst B={worst['batch']} d={worst['distinct']} {'bank' if worst['bank'] else 'bank-free'}",
        }
    )
    compiles = [r for r in big if "compile_s" in r]
    out.append(
        {
            "target": "70B compile time reported (lower + compile, per compiled step)",
            "measured": None if not compiles else round(max(r["lower_s"] + r["compile_s"] for r in compiles), 1),
            "met": None if not compiles else all(r["lower_s"] + r["compile_s"] <= 300 for r in compiles),
            "detail": "; ".join(
                f"B={r['batch']} {'bank' if r['bank'] else 'bank-free'}: lower "
                f"{r['lower_s']} s + compile {r['compile_s']} s"
                for r in compiles
            )
            or None,
        }
    )
    return out


def write_results(payload: dict, out: Path) -> None:
    """OUT/tp.json and OUT/tp.md from what has run so far (with an earlier call's, under --append)."""
    out.mkdir(parents=True, exist_ok=True)
    ran = {r["case"] for r in payload["rows"]}
    result = {k: v for k, v in payload.items() if not k.startswith("_")}
    result["not_run"] = [n for n in payload["_earlier_not_run"] if n["case"] not in ran] + payload["not_run"]
    result["greedy"] = payload["_earlier_greedy"] + greedy_summary(payload["_greedy"])
    result["targets"] = targets(result)
    (out / "tp.json").write_text(json.dumps(result, indent=1))
    (out / "tp.md").write_text(markdown(result))


def markdown(payload: dict) -> str:
    cols = [
        "model",
        "tensor",
        "batch",
        "bank",
        "distinct",
        "step_ms",
        "floor_ms",
        "x_floor",
        "tokens_per_s",
        "gb_per_gpu",
        "lower_s",
        "compile_s",
    ]
    lines = [
        f"# Tensor parallelism ({payload['device']} x {payload['num_devices']}, jax {payload['jax_version']})",
        "",
        f"Command: `{payload['command']}`",
        "",
        f"HBM (device-to-device copy, read + written, GPU 0): {payload['hbm_GBps']} GB/s. Backend "
        f"{payload['backend']}, rank {RANK} on all seven modules, every row at context {payload['position']}.",
        "floor_ms: bytes ONE GPU reads per step (its weight shard, its KV heads, its share of each distinct "
        "adapter) over that bandwidth. bank = false: the bank-free step the engine runs when no row has an "
        "adapter.",
        "",
    ]
    if payload.get("targets"):
        lines += ["## Targets", "", "| target | measured | met | detail |", "|---|---|---|---|"]
        lines += [f"| {t['target']} | {t['measured']} | {t['met']} | {t['detail'] or ''} |" for t in payload["targets"]]
        lines.append("")
    lines += ["## Decode steps", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in payload["rows"]]
    if payload.get("greedy"):
        lines += ["", "## Greedy tokens, TP 1 vs TP n", ""] + [f"- {json.dumps(g)}" for g in payload["greedy"]]
    if payload.get("allreduce"):
        lines += ["", "## All-reduces alone", ""] + [f"- {json.dumps(a)}" for a in payload["allreduce"]]
    if payload.get("profile"):
        p = payload["profile"]
        lines += [
            "",
            "## All-reduces in the step (profile, per GPU)",
            "",
            f"- {p['case']}: {p['allreduce_ms_per_gpu']} ms of {p['device_ms_per_gpu']} ms device time "
            f"({p['allreduce_launches_per_gpu']} launches)"
            if "device_ms_per_gpu" in p
            else f"- {json.dumps(p)}",
        ]
    if payload.get("not_run"):
        lines += ["", "## Not run", ""] + [f"- {n['case']}: {n['reason']}" for n in payload["not_run"]]
    return "\n".join(lines) + "\n"


# -- driver -------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict:
    t_start = time.perf_counter()
    deadline = t_start + args.budget_s
    tiny = args.tiny
    plan = [c for c in (tiny_plan() if tiny else h200_plan()) if not args.only or any(s in c.label for s in args.only)]
    backend = args.backend or ("xla" if tiny else "pallas")
    dtype = jnp.float32 if tiny else jnp.bfloat16
    if len(jax.devices()) < max(c.tensor for c in plan):
        raise SystemExit(f"need {max(c.tensor for c in plan)} devices, found {jax.devices()}")
    dev = jax.devices()[0]
    hbm = hbm_gbps(1 << 20 if tiny else 1 << 31)
    print(
        f"{len(jax.devices())} x {dev.device_kind}, jax {jax.__version__}, HBM copy {hbm:.0f} GB/s, "
        f"{len(plan)} cases, budget {args.budget_s:.0f} s",
        flush=True,
    )
    payload = {
        "device": str(dev.device_kind),
        "num_devices": len(jax.devices()),
        "jax_version": jax.__version__,
        "hbm_GBps": round(hbm, 1),
        "backend": backend,
        "tiny": tiny,
        "position": PROMPT_LEN + GEN_LEN // 2,
        "command": args.command,
        "rows": [],
        "not_run": [],
        "allreduce": [],
        "profile": {},
        "_greedy": {},
        "_earlier_greedy": [],
        "_earlier_not_run": [],
    }
    if args.append and (args.out / "tp.json").exists():
        keep_earlier(payload, json.loads((args.out / "tp.json").read_text()))
    models = Models(dtype)
    profile = not args.no_profile and dev.platform == "gpu"
    if not profile and not payload["profile"]:
        payload["profile"] = {"skipped": "needs a GPU" if dev.platform != "gpu" else "--no-profile"}

    def emit(row: dict) -> None:
        payload["rows"].append(row)
        print("  " + json.dumps(row), flush=True)
        write_results(payload, args.out)

    probed = False
    for i, case in enumerate(plan):
        if deadline - time.perf_counter() < case.est_s:
            payload["not_run"] += [
                {"case": c.label, "reason": f"budget ({args.budget_s:.0f} s) spent"} for c in plan[i:]
            ]
            break
        print(f"[{i}] {case.label} ({deadline - time.perf_counter():.0f} s left)", flush=True)
        # The first TP case also measures its collectives: alone, and (GPU) inside the step.
        probe = case.tensor > 1 and case.bank and not probed and not payload["allreduce"]
        probed = probed or probe
        attempt(
            lambda: run_case(
                case,
                models,
                backend=backend,
                hbm=hbm,
                steps=args.steps,
                greedy_steps=args.greedy_steps,
                emit=emit,
                payload=payload,
                profile=probe and profile,
            ),
            case.label,
            payload,
        )
        if probe:
            attempt(
                lambda: payload["allreduce"].append(
                    allreduce_chain_ms(MODELS[case.model], case.tensor, case.batch, dtype, args.steps)
                ),
                f"all-reduce chain, {case.label}",
                payload,
            )
        write_results(payload, args.out)
        gc.collect()
    payload["wall_s"] = round(time.perf_counter() - t_start, 1)
    write_results(payload, args.out)
    return json.loads((args.out / "tp.json").read_text())


def keep_earlier(payload: dict, earlier: dict) -> None:
    """Carries an earlier call's measurements into this one (a run split over device calls); what
    that call did not run stays listed unless this call runs it. The greedy comparison needs its
    TP 1 and TP 2 runs in one call."""
    payload["rows"] = earlier["rows"]
    payload["_earlier_greedy"] = earlier.get("greedy", [])
    payload["_earlier_not_run"] = earlier.get("not_run", [])
    payload["allreduce"] = earlier.get("allreduce", [])
    if "device_ms_per_gpu" in earlier.get("profile", {}):
        payload["profile"] = earlier["profile"]
    payload["command"] = f"{earlier['command']} ; then {payload['command']}"
    payload["earlier_hbm_GBps"] = earlier["hbm_GBps"]


def attempt(fn: Callable[[], None], label: str, payload: dict) -> None:
    """Runs one part; a failure is recorded and the run goes on."""
    try:
        fn()
    except Exception as e:  # one broken case must not lose the others
        payload["not_run"].append({"case": label, "reason": f"failed: {type(e).__name__}: {e}"[:600]})
        print(f"  FAILED {type(e).__name__}: {e}", flush=True)
        traceback.print_exc(limit=3)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, default=results_dir(__file__), help="folder for tp.json and tp.md")
    p.add_argument("--tiny", action="store_true", help="toy models (CPU with 2 fake devices: seconds)")
    p.add_argument("--budget-s", type=float, default=500.0, help="no case starts once this wall time is spent")
    p.add_argument(
        "--backend", choices=("pallas", "xla"), default=None, help="LoRA backend (default: pallas; xla with --tiny)"
    )
    p.add_argument("--steps", type=int, default=20, help="decode steps timed back to back per cell")
    p.add_argument("--greedy-steps", type=int, default=16, help="tokens per row of the greedy TP 1 / TP 2 run")
    p.add_argument("--only", nargs="*", default=None, help="run only cases whose label contains one of these")
    p.add_argument("--no-profile", action="store_true", help="skip the profiler trace of the TP 2 step")
    p.add_argument(
        "--append",
        action="store_true",
        help="keep the measurements of OUT/tp.json from an earlier call and add this call's",
    )
    args = p.parse_args(argv)
    if args.steps < 1 or args.greedy_steps < 1 or args.budget_s <= 0:
        p.error("--steps and --greedy-steps must be >= 1, --budget-s > 0")
    args.command = "python -m benchmarks.step.tp " + shlex.join(sys.argv[1:] if argv is None else argv)
    payload = run(args)
    print(f"wrote {args.out / 'tp.json'} ({len(payload['rows'])} rows, {len(payload['not_run'])} not run)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
