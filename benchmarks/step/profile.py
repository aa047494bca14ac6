"""Where a ragged step's time goes: the engine's jitted step on chosen mixes of decode rows and prompt
chunks (Llama-2-7B shape, bf16), timed per LoRA backend and attention kernel, with a per-op split.

A composition is D decode rows (one token each, contexts uniform in [ctx/2, 3*ctx/2]) plus prompt
chunks (length, cached prefix), packed into a step of T tokens exactly as the engine packs them. The
serving trace's steady state is the model: decode rows at a mean context of ~390 (prompt mean 260 plus
half the output mean), and prompt chunks filling the rest of the budget.

    python3 -m benchmarks.step.profile [--tiny] [--layers 8] [--out DIR] [--profile]

--profile adds a per-op device-time split (attention / GEMM / LoRA / other) of the named cases; run
it with XLA_FLAGS=--xla_gpu_enable_command_buffer= so that the kernels show one by one. Timings are
of `--layers` layers (the per-step fixed cost, embedding and sampling, is small): multiply the layer
part by num_layers / layers for the 32-layer model. Writes DIR/step_profile.json after every case.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import LLAMA2_7B, TINY, hbm_gbps, random_bank
from jaxlora.config import ATTENTION_MODULES, TARGET_MODULES, LoraConfig
from jaxlora.engine.runner import ragged_step, sampling_arrays
from jaxlora.engine.static_arg import Hashed
from jaxlora.kernels import GEMM_COMPILER_OPTIONS, StepKernels
from jaxlora.model import RaggedBatch, init_paged_kv_cache
from jaxlora.model.params import random_model

PAGE = 16


@dataclasses.dataclass(frozen=True)
class Mix:
    """decode rows at mean context `ctx`, plus prompt chunks (length, cached prefix), in T tokens."""

    name: str
    budget: int
    decode: int
    ctx: int
    chunks: tuple[tuple[int, int], ...] = ()

    @property
    def tokens(self) -> int:
        return self.decode + sum(n for n, _ in self.chunks)


H200_MIXES = (
    Mix("d64", 64, 64, 390),
    Mix("d128", 128, 128, 390),
    Mix("d256", 256, 256, 390),
    Mix("d128+p128", 256, 128, 390, ((128, 0),)),
    Mix("d121+p139 (pad 512)", 512, 121, 390, ((139, 0),)),
    Mix("d128+p384", 512, 128, 390, ((260, 0), (124, 0))),
    Mix("d256+p256", 512, 256, 390, ((256, 0),)),
    Mix("p512", 512, 0, 390, ((256, 0), (256, 0))),
    Mix("d256+p768", 1024, 256, 390, ((300, 0), (300, 0), (168, 0))),
    Mix("p1024", 1024, 0, 390, ((512, 0), (512, 0))),
    Mix("p2048", 2048, 0, 390, ((512, 0), (512, 0), (512, 0), (512, 0))),
)
TINY_MIXES = (
    Mix("d8", 8, 8, 20),
    Mix("d4+p12", 16, 4, 20, ((12, 0),)),
    Mix("p16", 16, 0, 20, ((10, 0), (6, 4))),
)


def settings(tiny: bool) -> dict[str, LoraConfig | None]:
    rank = 4 if tiny else 8
    return {
        "none": None,
        "s1": LoraConfig(max_slots=65, max_rank=rank, target_modules=ATTENTION_MODULES),
        "all": LoraConfig(max_slots=65, max_rank=2 * rank, target_modules=TARGET_MODULES),
    }


def mix_inputs(mix: Mix, *, rows: int, pages_per_seq: int, num_pages: int, vocab: int, distinct: int) -> dict:
    """The step's inputs for `mix`, packed as the runner packs a plan (decode rows first)."""
    rng = np.random.default_rng(0)
    T = mix.budget
    if mix.tokens > T or mix.decode + len(mix.chunks) > rows:  # the caller skips such mixes
        raise ValueError(f"{mix.name}: {mix.tokens} tokens / {mix.decode + len(mix.chunks)} rows do not fit")
    positions, slot_ids = np.zeros(T, np.int32), np.zeros(T, np.int32)
    write_page, write_offset = np.full(T, num_pages, np.int32), np.zeros(T, np.int32)
    q_start, q_len, kv_len = (np.zeros(rows, np.int32) for _ in range(3))
    tables = (np.arange(rows * pages_per_seq, dtype=np.int32) % num_pages).reshape(rows, pages_per_seq)
    spans = [(1, int(rng.integers(mix.ctx // 2, 3 * mix.ctx // 2)) - 1) for _ in range(mix.decode)]
    spans += list(mix.chunks)
    offset = 0
    for row, (length, prefix) in enumerate(spans):
        pos = np.arange(prefix, prefix + length, dtype=np.int32)
        span = slice(offset, offset + length)
        positions[span] = pos
        slot_ids[span] = 0 if distinct == 0 else 1 + row % distinct
        write_page[span], write_offset[span] = tables[row, pos // PAGE], pos % PAGE
        q_start[row], q_len[row], kv_len[row] = offset, length, prefix + length
        offset += length
    batch = RaggedBatch(q_start, q_len, kv_len, tables, write_page, write_offset)
    return dict(
        tokens=rng.integers(0, vocab, T, dtype=np.int32),
        src=np.full(T, -1, np.int32),
        positions=positions,
        slot_ids=slot_ids,
        batch=batch,
        sampling=sampling_arrays([], rows),
    )


def time_step(params, bank, kv, inputs, static, reps: int) -> tuple[float, object]:
    ids = jnp.zeros(inputs["sampling"].temperature.shape[0], jnp.int32)
    for _ in range(2):
        ids, kv = ragged_step(params, bank, kv, last_ids=ids, **inputs, **static)
    ids.block_until_ready()
    t0 = time.perf_counter()
    for _ in range(reps):
        ids, kv = ragged_step(params, bank, kv, last_ids=ids, **inputs, **static)
    ids.block_until_ready()
    return (time.perf_counter() - t0) / reps * 1e3, kv


def op_split(fn) -> dict:
    """Device ms per step by kind (attention, gemm, lora, other) from a profiler trace of `fn`, and
    the 40 ops with the most time ("top": name, ms per step, launches per step)."""
    from benchmarks.step.profile_decode import device_op_times

    split: dict[str, float] = {"attention": 0.0, "gemm": 0.0, "lora": 0.0, "other": 0.0, "launches": 0}
    ops = device_op_times(fn)
    for name, ms, n in ops[:25]:
        print(f"    {ms:8.3f} ms  x{n:<4d} {name[:110]}", flush=True)
    for name, ms, n in ops:
        low = name.lower()
        if "attention" in low:
            kind = "attention"
        elif any(k in low for k in ("shrink", "expand", "group", "lora", "bgmv", "sgmv")):
            kind = "lora"
        elif any(k in low for k in ("gemm", "dot", "cublas", "matmul")):
            kind = "gemm"
        else:
            kind = "other"
        split[kind] += ms
        split["launches"] += n
    out: dict = {k: round(v, 3) for k, v in split.items()}
    out["top"] = [[name[:120], round(ms, 4), n] for name, ms, n in ops[:40]]  # name, ms per step, launches
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tiny", action="store_true", help="CPU smoke run on a tiny model (interpret-mode kernels)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rows", type=int, default=260, help="max_batch: rows of the step")
    p.add_argument("--settings", nargs="+", default=["none", "s1", "all"])
    p.add_argument("--backends", nargs="+", default=["pallas", "xla"])
    p.add_argument("--attention", nargs="+", default=["pallas"])
    p.add_argument(
        "--variants",
        nargs="+",
        default=["fused/" + ("xla" if jax.default_backend() != "gpu" else "cublas")],
        help="LAYOUT/GEMM pairs to time, e.g. separate/xla fused/xla fused/cublas (projection layout, "
        "jaxlora.model.fused; the step's GEMM compile options, jaxlora.lora.apply.GemmBackend)",
    )
    p.add_argument("--mixes", nargs="+", default=None, help="names of the mixes to run (default all)")
    p.add_argument(
        "--profile",
        nargs="*",
        default=None,
        help="mix names to split by op kind (the pallas backend, and the no-adapter setting)",
    )
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--budget-s", type=float, default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    start = time.perf_counter()
    model_cfg = dataclasses.replace(TINY if args.tiny else LLAMA2_7B, num_layers=args.layers)
    mixes = [m for m in (TINY_MIXES if args.tiny else H200_MIXES) if args.mixes is None or m.name in args.mixes]
    rows = 8 if args.tiny else args.rows
    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    variants = [tuple(v.split("/")) for v in args.variants]
    if any(len(v) != 2 or v[0] not in ("separate", "fused") or v[1] not in GEMM_COMPILER_OPTIONS for v in variants):
        p.error(f"--variants take LAYOUT/GEMM with LAYOUT separate|fused and GEMM one of {list(GEMM_COMPILER_OPTIONS)}")
    # Both layouts from one draw (the same weights): a fused model is the separate one's matrices concatenated.
    models = {
        layout: random_model(model_cfg, dtype=dtype, fused=layout == "fused") for layout in {v[0] for v in variants}
    }
    max_ctx = max(max([3 * m.ctx // 2] + [n + q for n, q in m.chunks]) for m in mixes)
    pages_per_seq = -(-max_ctx // PAGE)
    num_pages = min(rows * pages_per_seq, 64 if args.tiny else 8192)
    kv = init_paged_kv_cache(model_cfg, num_pages, PAGE, dtype)
    out = {
        "device": str(jax.devices()[0].device_kind),
        "jax_version": jax.__version__,
        "layers": args.layers,
        "rows": rows,
        "hbm_gbps": None if args.tiny else round(hbm_gbps(), 1),
        "cases": [],
    }
    for name in args.settings:
        lora = settings(args.tiny)[name]
        bank = None if lora is None else random_bank(model_cfg, lora, lora.max_slots - 1, dtype)
        for (layout, gemm), backend in itertools.product(variants, args.backends if lora is not None else ["xla"]):
            model = models[layout]
            for attention in args.attention:
                kernels = StepKernels.for_platform(backend, attention=attention, gemm=gemm)
                static = dict(graphdef=Hashed(model.graphdef), kernels=kernels)
                for mix in mixes:
                    if mix.decode + len(mix.chunks) > rows:
                        print(f"{mix.name}: needs more than {rows} rows, skipped", flush=True)
                        continue
                    if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
                        print(f"budget spent: {name}/{backend}/{attention}/{mix.name} not run", flush=True)
                        continue
                    inputs = jax.device_put(
                        mix_inputs(
                            mix,
                            rows=rows,
                            pages_per_seq=pages_per_seq,
                            num_pages=num_pages,
                            vocab=model_cfg.vocab_size,
                            distinct=0 if lora is None else lora.max_slots - 1,
                        )
                    )
                    t0 = time.perf_counter()
                    ms, kv = time_step(model.params, bank, kv, inputs, static, args.reps)
                    case = dict(
                        setting=name,
                        layout=layout,
                        gemm=gemm,
                        backend=backend if lora is not None else "none",
                        attention=attention,
                        mix=mix.name,
                        budget=mix.budget,
                        tokens=mix.tokens,
                        decode=mix.decode,
                        step_ms=round(ms, 3),
                        compile_and_time_s=round(time.perf_counter() - t0, 1),
                    )
                    if args.profile is not None and mix.name in args.profile and (backend == "pallas" or lora is None):

                        def run(inputs=inputs):
                            nonlocal kv
                            ids, kv = ragged_step(
                                model.params, bank, kv, last_ids=jnp.zeros(rows, jnp.int32), **inputs, **static
                            )
                            return ids

                        case["ops_ms"] = op_split(run)
                    print(json.dumps(case), flush=True)
                    out["cases"].append(case)
                    if args.out is not None:
                        args.out.mkdir(parents=True, exist_ok=True)
                        (args.out / "step_profile.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
