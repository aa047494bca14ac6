"""End-to-end decode speed of the engine against the memory-bandwidth floor (`jaxlora bench`).

    jaxlora bench --tiny --out /tmp/bench          # CPU, toy model, seconds
    jaxlora bench                                  # GPU: Llama-2-7B shape, the plan below
    jaxlora bench --quantize bf16 fp8 int8 ...     # every group once per base weight format
    python -m benchmarks.engine.e2e --tiny --out /tmp/bench   # the same, from a checkout without installing

benchmarks/engine/hf_peer.py measures the Hugging Face peer (transformers + PEFT), merged in with --hf-peer.

A Llama-2-7B-shape model with random bf16 weights drawn on the device, an adapter bank drawn on the
device (every adapter resident: this measures decoding, not paging), and the real `Engine`.

Each *group* is one compiled engine: backend x adapter setting x batch x prompt length x base weight
format (dense, or weight-only fp8 / int8 projections: rows say "weights": "bf16" | "fp8" | "int8";
"f32" for the dense --tiny model). Every format runs on the same random weights, quantized from the
dense draw, in one process; a group's formats run back to back. Within a group only data changes,
so several distinct-adapter counts (row i on adapter i % d; d = 0 is every row on the base slot 0)
cost no extra compile. At d = 0, step_ms times the bank-free step, the one the engine dispatches when
no token has an adapter; the details add step_ms_with_bank (the LoRA kernels run, every row on slot 0),
what the LoRA launches cost with no adapter bytes to read. Per cell:

  step_ms        the engine's jitted step (`runner.packed_step`) on a decode-only batch
                 (`decode_inputs`), `steps` calls back to back with the page pool and ids fed through,
                 one block at the end, every row at the mean context prompt + gen / 2; the timed
                 calls must compile nothing (`jaxlora.engine.compiles`);
  floor_step_ms  (base weight bytes + KV bytes read at that context + distinct adapter bytes) over
                 the device-to-device copy bandwidth measured in the same run (bytes read + written);
                 a quantized base counts 1 byte per projection weight plus its float32 scales;
  roofline_step_ms  the floor with the GEMMs' arithmetic counted: max(base weight bytes / bandwidth,
                 2 * batch * GEMM weights / the bf16 matmul rate measured in the same run) + the KV
                 and adapter bytes / bandwidth. From about 190 rows on the H200 a decode step's GEMMs
                 are bound by the tensor cores, not by streaming their weights, so the bytes floor
                 alone is out of reach there (x_roofline = step_ms / roofline_step_ms);
  tokens_per_s   end to end: `batch` requests submitted at once to the engine, prompt_len random
                 tokens each, gen_len greedy tokens each; generated tokens over wall time
                 (prefill, scheduling, detokenizing and the per-step readback included);
  ttft_ms        one request on an idle engine, from submit to its first token on the host.
The details of a cell with an engine run add host_ms_per_step: the engine loop's host time per step
of that run, by phase (`Engine.stats()["host"]`, jaxlora.engine.host_timing).

Groups run in priority order until the wall-clock budget is spent; what did not run is listed in
the results with the reason. Results are rewritten after every cell, so a killed run keeps its data.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import (
    LLAMA2_7B,
    TINY,
    adapter_name,
    hbm_gbps,
    matmul_tflops,
    random_bank,
    slot_pattern,
    time_decode,
    word_tokenizer,
)
from benchmarks.paths import results_dir
from jaxlora.adapters import ResidentBank
from jaxlora.cli.engine_args import add_tensor_parallel_arg
from jaxlora.config import ATTENTION_MODULES, TARGET_MODULES, LoraBackend, LoraConfig, ModelConfig
from jaxlora.engine.build import engine_mesh
from jaxlora.engine.config import EngineConfig
from jaxlora.engine.engine import Engine
from jaxlora.engine.request import GenerationRequest, SamplingParams
from jaxlora.engine.runner import Runner, num_traces
from jaxlora.model.params import quantized_model, random_model
from jaxlora.parallel.mesh import MeshConfig

TARGETS = {"all": TARGET_MODULES, "qkvo": ATTENTION_MODULES}
ROW_KEYS = (
    "system",
    "backend",
    "weights",
    "batch",
    "distinct_adapters",
    "rank",
    "targets",
    "prompt_len",
    "gen_len",
    "tokens_per_s",
    "step_ms",
    "floor_step_ms",
    "ttft_ms",
)
WEIGHTS = ("bf16", "f32", "fp8", "int8")  # dense in the model dtype, or the quantization
QUANTIZED = ("fp8", "int8")
SYSTEMS = ("jaxlora", "hf-peft")
# Every LoRA backend, Pallas (what the GPU serves with) first: --tiny's step-only group runs the first.
DEFAULT_BACKENDS = (LoraBackend.PALLAS, *(b for b in LoraBackend if b is not LoraBackend.PALLAS))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Group:
    """One compiled engine and the distinct-adapter counts run on it.

    e2e=False times the decode step only (no engine run, no prefill compile): tokens_per_s and
    ttft_ms are then null.
    """

    backend: str
    rank: int
    targets: str
    batch: int
    prompt_len: int
    gen_len: int
    distinct: tuple[int, ...]
    e2e: bool = True
    quantization: str | None = None  # "fp8" | "int8": projections weight-only quantized; None: dense

    @property
    def max_slots(self) -> int:
        return max(2, max(self.distinct) + 1)

    @property
    def max_seq_len(self) -> int:
        return self.prompt_len + self.gen_len

    @property
    def label(self) -> str:
        return (
            f"{self.backend} {self.quantization or 'dense'} r{self.rank}/{self.targets} B={self.batch} "
            f"P={self.prompt_len} d={list(self.distinct)}{'' if self.e2e else ' (step only)'}"
        )


def h200_plan() -> list[Group]:
    """Priority order: the cells the targets read first, then the breadth of the matrix.

    Step-only groups (no engine run) cover the backend comparison at every batch size; a new batch
    size pays XLA's GEMM autotuning (~35 s on the H200), later groups of that size reuse it.
    """
    g = lambda backend, batch, distinct, rank=16, targets="all", prompt=128, e2e=True: Group(  # noqa: E731
        backend=backend,
        rank=rank,
        targets=targets,
        batch=batch,
        prompt_len=prompt,
        gen_len=128,
        distinct=tuple(distinct),
        e2e=e2e,
    )
    return [
        g("pallas", 64, (64, 0, 1, 16)),  # floor target, vs HF PEFT, throughput curve
        g("pallas", 64, (64, 0), rank=8, targets="qkvo"),  # S-LoRA setting
        g("xla", 64, (64, 0, 16), e2e=False),
        g("ragged", 64, (64, 0), e2e=False),
        g("xla", 64, (64, 0), rank=8, targets="qkvo", e2e=False),
        g("pallas", 16, (16, 0, 1), e2e=False),
        g("xla", 16, (16, 0), e2e=False),
        g("ragged", 16, (16, 0), e2e=False),
        g("pallas", 256, (256, 0, 64), e2e=False),
        g("xla", 256, (256, 0), e2e=False),
        g("ragged", 256, (256, 0), e2e=False),
        g("pallas", 128, (64, 0), e2e=False),
        g("xla", 128, (64, 0), e2e=False),
        g("ragged", 64, (64, 0), rank=8, targets="qkvo", e2e=False),
        g("pallas", 1, (1, 0)),
        g("pallas", 64, (64, 0), prompt=512),
        g("xla", 64, (64,), prompt=512, e2e=False),
        g("ragged", 64, (64,), prompt=512, e2e=False),
        g("pallas", 16, (16, 0)),
        g("pallas", 256, (256, 0)),
    ]


def tiny_plan(backends: Sequence[str]) -> list[Group]:
    """One group per backend, plus a step-only group: every code path, on a toy model."""
    out = [Group(backend=b, rank=4, targets="all", batch=4, prompt_len=8, gen_len=4, distinct=(2, 0)) for b in backends]
    out.append(
        Group(backend=backends[0], rank=2, targets="qkvo", batch=4, prompt_len=8, gen_len=4, distinct=(4,), e2e=False)
    )
    return out


# -- bytes and bandwidth ----------------------------------------------------------------------------


def base_weight_bytes(model: ModelConfig, itemsize: int, quantization: str | None = None) -> int:
    """Bytes a decode step must read of the base: every layer, the final norm and the LM head
    (the embedding table is only gathered, B rows, and is left out).

    With a quantization the seven projections count 1 byte per weight plus one float32 scale per
    output channel; norms and the LM head stay at `itemsize`.
    """
    c = model
    projections = sum(math.prod(c.module_shape(m)) for m in TARGET_MODULES)
    dense = 2 * c.hidden_size  # the two norms of a layer
    if quantization is None:
        dense += projections
        quantized = 0
    else:
        quantized = projections + 4 * sum(c.module_shape(m)[1] for m in TARGET_MODULES)
    head = c.hidden_size * c.vocab_size + c.hidden_size
    return c.num_layers * (dense * itemsize + quantized) + head * itemsize


def kv_bytes(model: ModelConfig, batch: int, context: float, itemsize: int) -> float:
    """K and V of `context` positions of `batch` rows, every layer."""
    return 2 * model.num_layers * batch * context * model.num_kv_heads * model.head_dim * itemsize


def adapter_bytes(model: ModelConfig, rank: int, targets: Sequence[str], itemsize: int) -> int:
    """One adapter's A and B over every layer (its true rank; what a step must read per adapter)."""
    return model.num_layers * sum(rank * sum(model.module_shape(m)) for m in targets) * itemsize


def floor_ms(model: ModelConfig, group: Group, distinct: int, hbm_gbps: float, itemsize: int) -> float:
    total = base_weight_bytes(model, itemsize, group.quantization) + _streamed_bytes(model, group, distinct, itemsize)
    return total / (hbm_gbps * 1e9) * 1e3


def _streamed_bytes(model: ModelConfig, group: Group, distinct: int, itemsize: int) -> float:
    """What a decode step reads besides the base weights: the KV at the mean context, the adapters."""
    context = group.prompt_len + group.gen_len / 2
    adapters = distinct * adapter_bytes(model, group.rank, TARGETS[group.targets], itemsize)
    return kv_bytes(model, group.batch, context, itemsize) + adapters


def gemm_flops(model: ModelConfig, batch: int) -> float:
    """A decode step's GEMM arithmetic: 2 * batch * (every layer's projection weights + the LM head)."""
    projections = sum(math.prod(model.module_shape(m)) for m in TARGET_MODULES)
    return 2.0 * batch * (model.num_layers * projections + model.hidden_size * model.vocab_size)


def roofline_ms(
    model: ModelConfig, group: Group, distinct: int, hbm_gbps: float, tflops: float, itemsize: int
) -> float:
    """The floor with the GEMMs' arithmetic counted (module doc): the GEMMs take the longer of
    streaming their weights and their FLOPs at the measured matmul rate; the KV and adapter reads
    are bandwidth-bound (their arithmetic is a few percent of the GEMMs')."""
    weights_ms = base_weight_bytes(model, itemsize, group.quantization) / (hbm_gbps * 1e9) * 1e3
    gemm_ms = gemm_flops(model, group.batch) / (tflops * 1e12) * 1e3
    return max(weights_ms, gemm_ms) + _streamed_bytes(model, group, distinct, itemsize) / (hbm_gbps * 1e9) * 1e3


# -- one group --------------------------------------------------------------------------------------


def time_prefill(engine, slot: int, prompt_len: int, reps: int = 3) -> float:
    """Milliseconds from submitting one request to its first token, on an idle engine."""
    rng = np.random.default_rng(1)
    adapter = adapter_name(slot - 1) if slot else None
    times = []
    for i in range(reps + 1):
        prompt = rng.integers(0, engine.model.config.vocab_size, prompt_len).tolist()
        t0 = time.perf_counter()
        engine.generate(
            [
                GenerationRequest(
                    request_id=f"ttft{i}", prompt_ids=prompt, adapter=adapter, sampling=SamplingParams(max_tokens=1)
                )
            ]
        )
        times.append(time.perf_counter() - t0)
    return float(np.median(times[1:])) * 1e3


def run_engine(engine, batch: int, prompt_len: int, gen_len: int, distinct: int, seed: int) -> dict:
    """Submits `batch` requests at once and runs the engine until idle."""
    rng = np.random.default_rng(seed)
    vocab = engine.model.config.vocab_size
    requests = [
        GenerationRequest(
            request_id=f"r{seed}-{i}",
            prompt_ids=rng.integers(0, vocab, prompt_len).tolist(),
            adapter=adapter_name(i % distinct) if distinct else None,
            sampling=SamplingParams(max_tokens=gen_len),
        )
        for i in range(batch)
    ]
    from jaxlora.engine.host_timing import per_step

    first: dict[str, float] = {}
    stats0 = engine.stats()
    t0 = time.perf_counter()
    for r in requests:
        engine.submit(r, callback=lambda out: first.setdefault(out.request_id, time.perf_counter()))
    engine.run_until_idle()
    seconds = time.perf_counter() - t0
    stats1 = engine.stats()
    generated = stats1["generated_tokens"] - stats0["generated_tokens"]
    if generated != batch * gen_len:
        raise RuntimeError(f"expected {batch * gen_len} generated tokens, got {generated}")
    ttfts = sorted(t - t0 for t in first.values())
    return {
        "tokens_per_s": generated / seconds,
        "seconds": seconds,
        "ttft_loaded_ms_p50": ttfts[len(ttfts) // 2] * 1e3,
        "ttft_loaded_ms_max": ttfts[-1] * 1e3,
        "host_ms_per_step": per_step(stats0["host"], stats1["host"]),
    }


def run_group(
    group: Group,
    model,
    tokenizer,
    *,
    hbm: float,
    tflops: float,
    steps: int,
    emit: Callable[[dict, dict], None],
    tensor_parallel: int = 1,
) -> None:
    """Builds the engine of `group`, warms it up, and emits one (row, details) per distinct count."""
    cfg = model.config
    itemsize = jnp.dtype(model.dtype).itemsize
    lora = LoraConfig(
        max_slots=group.max_slots, max_rank=group.rank, target_modules=TARGETS[group.targets], backend=group.backend
    )
    # Decode steps have exactly max_batch tokens; prompts go up to eight a step (as the engine before
    # the ragged step ran its prefill calls: 8 rows). Pages: every row at full length.
    pages_per_seq = -(-group.max_seq_len // 16)
    config = EngineConfig(
        max_batch=group.batch,
        max_seq_len=group.max_seq_len,
        token_budgets=tuple(sorted({group.batch, min(2048, 8 * group.prompt_len)})),
        page_size=16,
        num_pages=group.batch * pages_per_seq,
        max_new_tokens_limit=group.gen_len,
        max_queue=max(1024, 2 * group.batch),
        lora=lora,
        dtype=jnp.dtype(model.dtype).name,
        mesh=MeshConfig(tensor=tensor_parallel),
    )
    t0 = time.perf_counter()
    mesh = engine_mesh(config.mesh, cfg)  # one mesh for the bank and the runner
    # Only the source holds the bank: splitting it over the mesh frees the one-device copy.
    source = ResidentBank(
        random_bank(cfg, lora, max(group.distinct), model.dtype), [adapter_name(i) for i in range(max(group.distinct))]
    )
    if mesh is not None:
        source.place_on(mesh)
    if group.e2e:
        engine = Engine(model, tokenizer, config, source, mesh=mesh)
        engine.warmup()
        runner = engine.runner
        run_engine(engine, group.batch, group.prompt_len, 2, max(group.distinct), seed=0)  # first-run costs
    else:
        kernels = config.step_kernels(fused_projections=model.fused)
        engine, runner = None, Runner(model, config, kernels=kernels, mesh=mesh)
        time_decode(runner, source.bank, slot_pattern(group.batch, 0), group.prompt_len, steps=1)
    bank = source.bank  # split over the mesh when tensor_parallel > 1
    setup_s = time.perf_counter() - t0
    traces0 = num_traces()
    print(f"  setup (bank, compile, warm-up) {setup_s:.1f} s", flush=True)
    context = group.prompt_len + group.gen_len // 2
    for i, distinct in enumerate(group.distinct):
        slots = slot_pattern(group.batch, distinct)
        # The step the engine runs: a batch with no adapter runs without the bank (bank_free_steps).
        step = time_decode(runner, None if distinct == 0 else bank, slots, context, steps)
        floor = floor_ms(cfg, group, distinct, hbm, itemsize)
        details = {
            "setup_s": round(setup_s, 2) if i == 0 else 0.0,
            "max_slots": group.max_slots,
            "decode_tokens_per_s": round(group.batch / step * 1e3, 1),
            "step_over_floor": round(step / floor, 3),
        }
        if distinct == 0:  # what the LoRA kernels cost on a batch whose every row is on slot 0
            details["step_ms_with_bank"] = round(time_decode(runner, bank, slots, context, steps), 3)
        tokens_per_s = ttft = None
        if engine is not None:
            result = run_engine(engine, group.batch, group.prompt_len, group.gen_len, distinct, seed=i + 1)
            tokens_per_s = result["tokens_per_s"]
            ttft = time_prefill(engine, int(slots[0]), group.prompt_len)
            details.update(
                e2e_seconds=round(result["seconds"], 3),
                ttft_loaded_ms_p50=round(result["ttft_loaded_ms_p50"], 2),
                ttft_loaded_ms_max=round(result["ttft_loaded_ms_max"], 2),
                host_ms_per_step=result["host_ms_per_step"],
            )
        details["compiles_after_setup"] = num_traces() - traces0
        row = {
            "system": "jaxlora",
            "backend": group.backend,
            "weights": weights_label(model),
            "batch": group.batch,
            "distinct_adapters": distinct,
            "rank": group.rank,
            "targets": group.targets,
            "prompt_len": group.prompt_len,
            "gen_len": group.gen_len,
            "tokens_per_s": _round(tokens_per_s, 1),
            "step_ms": round(step, 3),
            "floor_step_ms": round(floor, 3),
            "ttft_ms": _round(ttft, 2),
            "roofline_step_ms": round(roofline_ms(cfg, group, distinct, hbm, tflops, itemsize), 3),
        }
        emit(row, details)
    del engine, runner, source, bank


def weights_label(model) -> str:
    """The row's "weights": the quantization, or the dense dtype ("bf16", "f32")."""
    if model.quantization is not None:
        return model.quantization.value
    return {"bfloat16": "bf16", "float32": "f32"}[jnp.dtype(model.dtype).name]


def _round(x: float | None, n: int) -> float | None:
    return None if x is None else round(x, n)


# -- results ----------------------------------------------------------------------------------------


def validate(payload: dict) -> None:
    """Raises ValueError unless `payload` has the results format e2e.json uses."""
    for key, kind in (("device", str), ("jax_version", str), ("hbm_GBps", (int, float)), ("rows", list)):
        if not isinstance(payload.get(key), kind):
            raise ValueError(f"results: {key!r} missing or not {kind}")
    for i, row in enumerate(payload["rows"]):
        missing = [k for k in ROW_KEYS if k not in row]
        if missing:
            raise ValueError(f"row {i}: missing {missing}")
        if row["system"] not in SYSTEMS or row["targets"] not in TARGETS or row["weights"] not in WEIGHTS:
            raise ValueError(
                f"row {i}: system {row['system']!r} / targets {row['targets']!r} / weights "
                f"{row['weights']!r} not allowed"
            )
        for k in ("batch", "distinct_adapters", "rank", "prompt_len", "gen_len"):
            if not isinstance(row[k], int) or row[k] < 0:
                raise ValueError(f"row {i}: {k}={row[k]!r} must be a non-negative int")
        for k in ("tokens_per_s", "step_ms", "floor_step_ms", "ttft_ms"):
            v = row[k]
            if v is not None and (not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0):
                raise ValueError(f"row {i}: {k}={v!r} must be a positive number or null")
        if not isinstance(row["backend"], str):
            raise ValueError(f"row {i}: backend must be a string")


def hf_rows(peer: dict, model: ModelConfig, hbm: float, itemsize: int) -> list[dict]:
    """Rows of the Hugging Face peer's results (benchmarks/engine/hf_peer.py), floors on our bandwidth."""
    rows = []
    for r in peer["rows"]:
        group = Group(
            backend="peft",
            rank=peer["rank"],
            targets="all",
            batch=peer["batch"],
            prompt_len=peer["prompt_len"],
            gen_len=r["gen_len"],
            distinct=(r["distinct_adapters"],),
        )
        rows.append(
            {
                "system": "hf-peft",
                "backend": "peft" if r["distinct_adapters"] else "transformers",
                "weights": "bf16",
                "batch": peer["batch"],
                "distinct_adapters": r["distinct_adapters"],
                "rank": peer["rank"],
                "targets": "all",
                "prompt_len": peer["prompt_len"],
                "gen_len": r["gen_len"],
                "tokens_per_s": round(r["tokens_per_s"], 1),
                "step_ms": round(r["step_ms"], 3),
                "floor_step_ms": round(floor_ms(model, group, r["distinct_adapters"], hbm, itemsize), 3),
                "ttft_ms": round(r["ttft_ms"], 2),
            }
        )
    return rows


def targets_summary(rows: list[dict]) -> list[dict]:
    """Each decode-floor target (dense rows) and quantized-base target (quantized against dense rows)
    with its measured figure (None where a needed cell did not run). A d = 0 row times the bank-free
    step, the same program for every LoRA backend, so it counts against the base-only bar and is
    left out of the backend comparison."""
    jl = [r for r in rows if r["system"] == "jaxlora" and r["weights"] not in QUANTIZED]
    out = []

    def find(**kw):
        return next((r for r in jl if all(r[k] == v for k, v in kw.items())), None)

    pallas = [r for r in jl if r["backend"] == "pallas" and r["batch"] >= 16]
    with_lora = [r for r in pallas if r["distinct_adapters"] > 0]
    base_only = [r for r in pallas if r["distinct_adapters"] == 0]
    out += [
        _floor_target("every pallas decode step with adapters at batch >= 16 within 1.4x of its floor", with_lora, 1.4),
        _floor_target(
            "every base-only (bank-free) decode step at batch >= 16 within 1.25x of its floor", base_only, 1.25
        ),
    ]
    lora = find(backend="pallas", batch=64, distinct_adapters=64, rank=8, targets="qkvo", prompt_len=128)
    base = find(backend="pallas", batch=64, distinct_adapters=0, rank=8, targets="qkvo", prompt_len=128)
    ratio = (
        None
        if not (lora and base and lora["tokens_per_s"] and base["tokens_per_s"])
        else lora["tokens_per_s"] / base["tokens_per_s"]
    )
    out.append(
        {
            "target": "S-LoRA setting (r8 q,k,v,o), B=64, 64 distinct >= 85% of base-only tokens/s",
            "measured": _round(ratio, 3),
            "met": None if ratio is None else ratio >= 0.85,
            "detail": None if ratio is None else f"{lora['tokens_per_s']} vs {base['tokens_per_s']} tok/s",
        }
    )
    ours = find(backend="pallas", batch=64, distinct_adapters=64, rank=16, targets="all", prompt_len=128)
    peer = next((r for r in rows if r["system"] == "hf-peft" and r["distinct_adapters"] == 64), None)
    ratio = None if not (ours and peer and ours["tokens_per_s"]) else ours["tokens_per_s"] / peer["tokens_per_s"]
    out.append(
        {
            "target": "mixed batch of 64 distinct >= 50x HF PEFT tokens/s",
            "measured": _round(ratio, 1),
            "met": None if ratio is None else ratio >= 50,
            "detail": None if ratio is None else f"{ours['tokens_per_s']} vs {peer['tokens_per_s']} tok/s",
        }
    )
    losses = []
    compared = 0
    for r in with_lora:
        key = {k: r[k] for k in ("batch", "distinct_adapters", "rank", "targets", "prompt_len")}
        for other in (LoraBackend.XLA, LoraBackend.RAGGED):
            o = find(backend=other, **key)
            if o is not None:
                compared += 1
                if o["step_ms"] <= r["step_ms"]:
                    losses.append(f"{other} {o['step_ms']} <= pallas {r['step_ms']} ms at {_cell(r)}")
    out.append(
        {
            "target": "pallas faster than xla and ragged at every batch >= 16 with adapters (decode step)",
            "measured": f"{compared - len(losses)}/{compared} comparisons won" if compared else None,
            "met": None if not compared else not losses,
            "detail": "; ".join(losses) or None,
        }
    )
    return out + quantized_targets(rows)


def _floor_target(target: str, rows: list[dict], bar: float) -> dict:
    """The worst step / floor among `rows` against `bar`."""
    worst = max(rows, key=lambda r: r["step_ms"] / r["floor_step_ms"], default=None)
    return {
        "target": target,
        "measured": None if worst is None else round(worst["step_ms"] / worst["floor_step_ms"], 2),
        "met": None if worst is None else all(r["step_ms"] <= bar * r["floor_step_ms"] for r in rows),
        "detail": None if worst is None else _cell(worst) + " is the worst",
    }


def quantized_targets(rows: list[dict]) -> list[dict]:
    """Quantized bases: 7B shape, B=64, 64 distinct rank-16 adapters on all seven modules: each quantized
    decode step <= 0.6x the bf16 step; every quantized step within 1.5x its own bytes floor."""
    jl = [r for r in rows if r["system"] == "jaxlora"]
    cell = dict(batch=64, distinct_adapters=64, rank=16, targets="all", prompt_len=128)

    def find(**kw):
        return next((r for r in jl if all(r[k] == v for k, v in kw.items())), None)

    out = []
    for weights in QUANTIZED:
        for backend in dict.fromkeys(r["backend"] for r in jl if r["weights"] == weights):
            q, dense = find(backend=backend, weights=weights, **cell), find(backend=backend, weights="bf16", **cell)
            if q is None or dense is None:
                continue
            ratio = q["step_ms"] / dense["step_ms"]
            out.append(
                {
                    "target": f"{weights} decode step <= 0.6x the bf16 step ({backend}, B=64, 64 distinct r16/all)",
                    "measured": round(ratio, 3),
                    "met": ratio <= 0.6,
                    "detail": f"{q['step_ms']} vs {dense['step_ms']} ms",
                }
            )
    quantized = [r for r in jl if r["weights"] in QUANTIZED]
    worst = max(quantized, key=lambda r: r["step_ms"] / r["floor_step_ms"], default=None)
    out.append(
        {
            "target": "every quantized decode step within 1.5x its floor (1-byte weights + scales)",
            "measured": None if worst is None else round(worst["step_ms"] / worst["floor_step_ms"], 2),
            "met": None if worst is None else all(r["step_ms"] <= 1.5 * r["floor_step_ms"] for r in quantized),
            "detail": None if worst is None else f"{worst['weights']} {worst['backend']} {_cell(worst)} is the worst",
        }
    )
    return out


def _ratio(step: float | None, floor: float | None) -> float | None:
    return None if not step or not floor else round(step / floor, 2)


def _cell(r: dict) -> str:
    return f"B={r['batch']} d={r['distinct_adapters']} r{r['rank']}/{r['targets']} P={r['prompt_len']}"


def write_markdown(payload: dict, out: Path) -> None:
    cols = [*ROW_KEYS[: ROW_KEYS.index("floor_step_ms") + 1], "x_floor", "x_roofline"]
    cols += list(ROW_KEYS[ROW_KEYS.index("ttft_ms") :])
    lines = [
        f"# End to end, {payload.get('model', 'llama-2-7b-shape')} ({payload['device']}, jax {payload['jax_version']})",
        "",
        f"Command: `{payload['command']}`",
        "",
        f"HBM (device-to-device copy, read + written, this run): {payload['hbm_GBps']:.0f} GB/s"
        + (
            f"; torch copy in the peer process: {payload['hf_peer']['copy_GBps']:.0f} GB/s"
            if payload.get("hf_peer", {}).get("copy_GBps")
            else ""
        )
        + ".",
        "tokens_per_s: end to end through the engine (all requests submitted at once, prefill included); "
        "step_ms: the jitted decode step at the mean context; ttft_ms: one prefill call on an idle engine. "
        "x_floor = step_ms / floor_step_ms; x_roofline = step_ms / roofline_step_ms, the floor with the GEMMs'"
        " FLOPs at the measured matmul rate"
        + (f" ({payload['matmul_TFLOPs']:.0f} TFLOP/s bf16 in this run)" if payload.get("matmul_TFLOPs") else "")
        + " (benchmarks/engine/e2e.py's doc).",
        "",
    ]
    if payload.get("weights_bytes"):
        lines += [
            "Device memory for the base weights: "
            + ", ".join(f"{w} {b / 1e9:.2f} GB" for w, b in payload["weights_bytes"].items())
            + ".",
            "",
        ]
    if payload.get("targets"):
        lines += ["## Targets", "", "| target | measured | met | detail |", "|---|---|---|---|"]
        lines += [f"| {t['target']} | {t['measured']} | {t['met']} | {t['detail'] or ''} |" for t in payload["targets"]]
        lines.append("")
    lines += ["## Cells", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in payload["rows"]:
        ratios = {
            "x_floor": _ratio(r["step_ms"], r["floor_step_ms"]),
            "x_roofline": _ratio(r["step_ms"], r.get("roofline_step_ms")),
        }
        lines.append(
            "| " + " | ".join("-" if v is None else str(v) for v in (ratios.get(c, r.get(c)) for c in cols)) + " |"
        )
    if payload.get("not_run"):
        lines += ["", "## Not run", ""]
        lines += [f"- {n['group']}: {n['reason']}" for n in payload["not_run"]]
    if payload.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in payload["notes"]]
    (out / "e2e.md").write_text("\n".join(lines) + "\n")


def write_plots(payload: dict, out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = payload["rows"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    keys = sorted(
        {
            (r["system"], r["backend"], r["batch"], r["rank"], r["targets"], r["prompt_len"])
            for r in rows
            if r["tokens_per_s"] is not None
        }
    )
    for key in keys:
        rs = sorted(
            (
                r
                for r in rows
                if (r["system"], r["backend"], r["batch"], r["rank"], r["targets"], r["prompt_len"]) == key
                and r["tokens_per_s"] is not None
            ),
            key=lambda r: r["distinct_adapters"],
        )
        system, backend, batch, rank, targets, prompt = key
        ax.plot(
            [r["distinct_adapters"] for r in rs],
            [r["tokens_per_s"] for r in rs],
            "s--" if system == "hf-peft" else "o-",
            label=f"{backend} B={batch} r{rank}/{targets} P={prompt}",
        )
    ax.set_xscale("symlog", linthresh=1)
    ax.set_yscale("log")
    ax.set_xlabel("distinct adapters in the batch (0 = base only)")
    ax.set_ylabel("tokens/s, end to end")
    ax.set_title(f"Llama-2-7B shape, {payload['device']}")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "e2e_throughput.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 5))
    markers = {"pallas": "o", "xla": "^", "ragged": "s", "peft": "x", "transformers": "+"}
    jl = [r for r in rows if r["system"] == "jaxlora"]
    for backend in dict.fromkeys(r["backend"] for r in jl):
        rs = [r for r in jl if r["backend"] == backend]
        ax.scatter(
            [r["floor_step_ms"] for r in rs],
            [r["step_ms"] for r in rs],
            marker=markers.get(backend, "o"),
            label=backend,
        )
    if jl:
        lo = min(r["floor_step_ms"] for r in jl) * 0.8
        hi = max(max(r["step_ms"] for r in jl), max(r["floor_step_ms"] for r in jl)) * 1.2
        ax.plot([lo, hi], [lo, hi], "k-", lw=1, label="floor")
        ax.plot([lo, hi], [1.6 * lo, 1.6 * hi], "k--", lw=1, label="1.6x floor")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("floor step ms (base + KV + distinct adapters) / HBM")
    ax.set_ylabel("measured decode step ms")
    ax.set_title("Decode step vs memory floor")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "e2e_floor.png", dpi=120)
    plt.close(fig)


def write_all(payload: dict, out: Path, *, plots: bool = True) -> None:
    out.mkdir(parents=True, exist_ok=True)
    payload["targets"] = targets_summary(payload["rows"])
    validate(payload)
    (out / "e2e.json").write_text(json.dumps(payload, indent=1))
    write_markdown(payload, out)
    if plots:
        write_plots(payload, out)


def rerender(source: Path, out: Path, *, hf_peer: Path | None = None) -> dict:
    """Re-renders results (and merges a peer's rows that the run did not have) without running."""
    payload = json.loads(Path(source).read_text())
    _label_dense_rows(payload)
    if hf_peer is not None and not any(r["system"] == "hf-peft" for r in payload["rows"]):
        add_peer(payload, json.loads(Path(hf_peer).read_text()))
    write_all(payload, out)
    return payload


def _label_dense_rows(payload: dict) -> None:
    """Results written before rows had "weights" come from dense bf16 runs (the GPU plan's only
    format then): say so, so that they validate and compare with quantized rows."""
    for row in payload["rows"]:
        row.setdefault("weights", "bf16")


def add_peer(payload: dict, peer: dict) -> None:
    model = TINY if payload.get("model") == TINY.name else LLAMA2_7B
    rows = hf_rows(peer, model, payload["hbm_GBps"], 2)
    payload["hf_peer"] = {k: v for k, v in peer.items() if k != "rows"}
    payload["rows"] = rows + payload["rows"]
    payload["details"] = [{"hf_seconds": r["seconds"]} for r in peer["rows"]] + payload.get("details", [])
    if any(r["gen_len"] != 128 for r in peer["rows"]):
        payload.setdefault("notes", []).append(
            "HF PEFT ran fewer generated tokens than 128 where its gen_len column says so (a mixed-adapter "
            "step costs seconds there); its tokens/s includes its prefill, like ours."
        )


# -- driver -----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    out: Path
    tiny: bool = False
    budget_s: float = 300.0
    backends: tuple[str, ...] = DEFAULT_BACKENDS
    steps: int = 10
    hf_peer: Path | None = None
    plots: bool = True
    command: str = ""
    tensor_parallel: int = 1
    skip_groups: int = 0  # start at this index of the plan (a second device call continues the first)
    groups: tuple[int, ...] = ()  # run only these indices of the plan (after the backend filter); () all
    merge_json: Path | None = None  # an earlier part's e2e.json: its rows are kept and written again
    weights: tuple[str, ...] = ("bf16",)  # "bf16" (dense in the model dtype), "fp8", "int8"; in this order


def with_weights(plan: list[Group], weights: Sequence[str]) -> list[Group]:
    """Each group once per weight format, back to back (so a budget cut keeps whole comparisons)."""
    return [dataclasses.replace(g, quantization=None if w == "bf16" else w) for g in plan for w in weights]


def base_models(dense, weights: Sequence[str]) -> dict[str | None, object]:
    """quantization -> LoadedModel for every requested format, all from the same dense weights."""
    models = {None: dense} if "bf16" in weights else {}
    for w in weights:
        if w != "bf16":
            models[w] = quantized_model(dense, w)
            jax.block_until_ready(models[w].params)
    return models


def run_benchmark(opts: Options) -> dict:
    """Runs the plan until the budget is spent; writes e2e.{json,md} (and plots) after every cell."""
    t_start = time.perf_counter()
    deadline = t_start + opts.budget_s
    dev = jax.devices()[0]
    model_cfg = TINY if opts.tiny else LLAMA2_7B
    dtype = jnp.float32 if opts.tiny else jnp.bfloat16
    plan = tiny_plan(opts.backends) if opts.tiny else [g for g in h200_plan() if g.backend in opts.backends]
    if opts.groups:
        if not all(0 <= i < len(plan) for i in opts.groups) or len(set(opts.groups)) != len(opts.groups):
            raise ValueError(f"--groups {list(opts.groups)}: give distinct groups of the plan's 0..{len(plan) - 1}")
        if opts.skip_groups:
            raise ValueError("--groups and --skip-groups index different plans: give one of them")
        plan = [plan[i] for i in opts.groups]
    plan = with_weights(plan, opts.weights)
    print(
        f"device {dev.device_kind}, jax {jax.__version__}, {len(plan)} groups, budget {opts.budget_s:.0f} s", flush=True
    )
    hbm = hbm_gbps(1 << 20 if opts.tiny else 1 << 31)
    tflops = matmul_tflops(256 if opts.tiny else 8192, dtype)
    print(f"HBM copy {hbm:.0f} GB/s, matmul {tflops:.1f} TFLOP/s", flush=True)
    # The serving layout on one device (what `jaxlora serve` loads); a tensor-parallel split needs the separate one.
    dense = random_model(model_cfg, dtype=dtype, fused=opts.tensor_parallel == 1)
    jax.block_until_ready(dense.params)
    models = base_models(dense, opts.weights)
    del dense  # freed unless "bf16" is among the formats
    # Counted from the state as stored (flat_params() would build canonical copies just to count them).
    weights_bytes = {weights_label(m): sum(a.nbytes for a in jax.tree.leaves(m.params)) for m in models.values()}
    print("weights on the device: " + ", ".join(f"{w} {b / 1e9:.2f} GB" for w, b in weights_bytes.items()), flush=True)
    tokenizer = word_tokenizer(model_cfg.vocab_size)
    payload = {
        "device": str(dev.device_kind),
        "jax_version": jax.__version__,
        "hbm_GBps": round(hbm, 1),
        "matmul_TFLOPs": round(tflops, 1),
        "tensor_parallel": opts.tensor_parallel,
        "weights_bytes": weights_bytes,
        "model": model_cfg.name,
        "command": opts.command,
        "rows": [],
        "details": [],
        "not_run": [],
        "notes": [],
    }
    if opts.merge_json is not None:
        earlier = json.loads(opts.merge_json.read_text())
        _label_dense_rows(earlier)
        kept = [(r, d) for r, d in zip(earlier["rows"], earlier["details"]) if r["system"] == "jaxlora"]
        payload["rows"] += [r for r, _ in kept]
        payload["details"] += [d for _, d in kept]
        payload["notes"].append(
            f"rows of plan groups before #{opts.skip_groups} come from an earlier device call "
            f"({earlier.get('command', '?')}), HBM {earlier.get('hbm_GBps')} GB/s there"
        )
    if opts.hf_peer is not None and opts.hf_peer.exists():
        add_peer(payload, json.loads(opts.hf_peer.read_text()))
    elif opts.hf_peer is not None:
        payload["notes"].append(f"HF peer results {opts.hf_peer} missing: the peer did not finish")

    def emit(row: dict, details: dict) -> None:
        payload["rows"].append(row)
        payload["details"].append(details)
        print("  " + json.dumps(row), flush=True)
        write_all(payload, opts.out, plots=False)

    est_s = 5.0 if opts.tiny else 45.0  # one group's compile + runs, a rough upper bound
    for i, group in enumerate(plan):
        if i < opts.skip_groups:
            continue
        left = deadline - time.perf_counter()
        if left < est_s * (1 if group.e2e else 0.6):
            payload["not_run"] += [
                {"group": g.label, "reason": f"wall-clock budget ({opts.budget_s:.0f} s) spent"} for g in plan[i:]
            ]
            break
        print(f"[{i}] {group.label} ({left:.0f} s left)", flush=True)
        try:
            run_group(
                group,
                models[group.quantization],
                tokenizer,
                hbm=hbm,
                tflops=tflops,
                steps=opts.steps,
                emit=emit,
                tensor_parallel=opts.tensor_parallel,
            )
        except Exception as e:  # one broken group must not lose the others
            payload["not_run"].append({"group": group.label, "reason": f"failed: {type(e).__name__}: {e}"[:500]})
            print(f"  FAILED {type(e).__name__}: {e}", flush=True)
        gc.collect()
    payload["wall_s"] = round(time.perf_counter() - t_start, 1)
    write_all(payload, opts.out, plots=opts.plots)
    return payload


# -- the command ------------------------------------------------------------------------------------


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=results_dir(__file__), help="folder for e2e.json, e2e.md and the plots")
    p.add_argument("--tiny", action="store_true", help="toy model on the CPU (runs in seconds)")
    p.add_argument(
        "--budget-s", type=float, default=300.0, help="wall-clock budget: no new group starts once it is spent"
    )
    p.add_argument(
        "--backend", action="append", choices=[b.value for b in LoraBackend], help="repeatable; default: all"
    )
    p.add_argument("--steps", type=int, default=10, help="decode steps timed back to back per cell")
    p.add_argument(
        "--quantize",
        nargs="+",
        choices=("bf16", "fp8", "int8"),
        default=["bf16"],
        help="base weight formats, each group run once per format in this process: bf16 = dense "
        "(float32 with --tiny), fp8 / int8 = weight-only quantized projections",
    )
    p.add_argument(
        "--hf-peer", type=Path, default=None, help="results of benchmarks/engine/hf_peer.py to include as hf-peft rows"
    )
    p.add_argument("--no-plots", action="store_true")
    add_tensor_parallel_arg(p)
    p.add_argument(
        "--skip-groups",
        type=int,
        default=0,
        help="start at this index of the GPU plan (continue an earlier, budget-limited run)",
    )
    p.add_argument(
        "--groups",
        type=int,
        nargs="+",
        default=[],
        metavar="I",
        help="run only these plan groups (indices after the --backend filter, in the given order)",
    )
    p.add_argument(
        "--merge-json",
        type=Path,
        default=None,
        help="an earlier part's e2e.json whose jaxlora rows are kept in this run's results",
    )
    p.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="run nothing: re-render e2e.md and the plots into --out from this e2e.json "
        "(merging --hf-peer rows if given)",
    )


def run(args: argparse.Namespace) -> int:
    """`jaxlora bench` (and `python -m benchmarks.engine.e2e`): runs the plan, or re-renders a results file."""
    if args.steps < 1 or args.budget_s <= 0:
        print("jaxlora bench: --steps must be >= 1, --budget-s > 0", file=sys.stderr)
        return 2
    if args.from_json is not None:
        payload = rerender(args.from_json, args.out, hf_peer=args.hf_peer)
        print(f"rendered {args.out / 'e2e.md'} from {args.from_json} ({len(payload['rows'])} rows)")
        return 0
    opts = Options(
        out=args.out,
        tiny=args.tiny,
        budget_s=args.budget_s,
        backends=tuple(args.backend or DEFAULT_BACKENDS),
        steps=args.steps,
        hf_peer=args.hf_peer,
        plots=not args.no_plots,
        tensor_parallel=args.tensor_parallel or 1,
        skip_groups=args.skip_groups,
        groups=tuple(args.groups),
        merge_json=args.merge_json,
        weights=tuple(dict.fromkeys(args.quantize)),
        command="jaxlora bench " + shlex.join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:]),
    )
    payload = run_benchmark(opts)
    print(f"wrote {args.out / 'e2e.json'} ({len(payload['rows'])} rows, {len(payload['not_run'])} groups not run)")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_args(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
