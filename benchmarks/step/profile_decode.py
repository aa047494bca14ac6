"""Where the decode step's time goes (Llama-2-7B shape, bf16, batch 64): one H200 call.

  step variants   the engine's jitted decode step, no adapters, for each (layer loop, attention)
                  choice: lax.scan or unrolled layers x the XLA or the Pallas ragged attention
  lora variants   the fastest base variant with 64 distinct rank-16 all-module adapters, per LoRA
                  backend (xla, ragged, pallas)
  matmul probes   the seven projections alone: lax.scan over stacked weights, unrolled static
                  slices of the stacked weights, and a loop over separate per-layer arrays
  profiles        per-op device time (XLA Ops line of the profiler) for the base variants and the
                  pallas LoRA step, top ops by total time

    python -m benchmarks.step.profile_decode [--tiny] [--out DIR] [--only NAME ...]

Writes DIR/profile_decode.json when --out is given.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import LLAMA2_7B, TINY, hbm_gbps, random_bank, slot_pattern, time_decode
from jaxlora.config import TARGET_MODULES, LoraBackend, LoraConfig
from jaxlora.engine.config import EngineConfig
from jaxlora.engine.runner import Runner
from jaxlora.kernels import KernelConfig
from jaxlora.model.params import random_model

# Every variant names each choice (no "auto"): the plain XLA step, then one change at a time.
PLAIN = dict(attention="xla", unroll_layers=False, quant_matmul="xla", gemm="xla")
BASE_VARIANTS = {
    "scan/xla-attn": dict(),
    "scan/pallas-attn": dict(attention="pallas"),
    "unroll/xla-attn": dict(unroll_layers=True),
    "unroll/pallas-attn": dict(attention="pallas", unroll_layers=True),
}


def device_op_times(fn, steps: int = 5) -> list[tuple[str, float, int]]:
    """(op name, total ms per call, launches per call) on the GPU from a profiler trace of `fn()`."""
    from jax.profiler import ProfileData

    jax.block_until_ready(fn())
    d = tempfile.mkdtemp()
    jax.profiler.start_trace(d)
    jax.block_until_ready([fn() for _ in range(steps)])
    jax.profiler.stop_trace()
    totals: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.defaultdict(int)
    for path in glob.glob(d + "/**/*.xplane.pb", recursive=True):
        for plane in ProfileData.from_file(path).planes:
            if "GPU" not in plane.name and "gpu" not in plane.name:
                continue
            lines = list(plane.lines)
            names = [line.name for line in lines]
            print(f"    (plane {plane.name}: lines {names[:8]})", flush=True)
            # Kernel launches sit on the stream lines; an "XLA Ops" line, when present, names HLO ops.
            pick = [ln for ln in lines if ln.name == "XLA Ops"] or [ln for ln in lines if "Stream" in ln.name]
            for line in pick:
                for ev in line.events:
                    try:
                        stats = dict(ev.stats)
                    except (TypeError, ValueError):
                        stats = {}
                    name = str(stats.get("hlo_op", ev.name))
                    totals[name] += ev.duration_ns / 1e6 / steps
                    counts[name] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])
    return [(name, round(ms, 3), counts[name] // steps) for name, ms in ranked]


def print_ops(title: str, ops: list[tuple[str, float, int]], top: int = 18) -> None:
    total = sum(ms for _, ms, _ in ops)
    print(f"  device ops of {title}: {total:.2f} ms per step in {sum(n for *_, n in ops)} launches", flush=True)
    for name, ms, n in ops[:top]:
        print(f"    {ms:8.3f} ms  x{n:<4d} {name[:110]}", flush=True)
    # Group by kernel family (name up to the first digit/dot): what a kind of op costs in all layers.
    families: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for name, ms, n in ops:
        key = name.split(".")[0].rstrip("0123456789_")[:60]
        families[key][0] += ms
        families[key][1] += n
    for key, (ms, n) in sorted(families.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"    family {ms:8.3f} ms  x{n:<5d} {key}", flush=True)


def step_fn(runner, bank, slots, position):
    from benchmarks.common import decode_inputs
    from jaxlora.engine.runner import ragged_step

    inputs = jax.device_put(decode_inputs(runner, slots, position))
    static = runner.step_static

    def run():
        ids, runner.kv = ragged_step(runner.params, bank, runner.kv, last_ids=runner.last_ids, **inputs, **static)
        return ids

    return run


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out")
    p.add_argument("--only", nargs="*", default=None)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--no-profile", action="store_true")
    args = p.parse_args()
    model_cfg = TINY if args.tiny else LLAMA2_7B
    B, seq, position = args.batch, 256, 192
    interpret = jax.default_backend() == "cpu"
    results: dict = {"device": jax.devices()[0].device_kind, "batch": B, "max_seq_len": seq, "position": position}
    if not args.tiny:
        results["hbm_GBps"] = round(hbm_gbps(), 1)
        print("hbm GB/s", results["hbm_GBps"], flush=True)
    model = random_model(model_cfg, dtype=jnp.bfloat16)

    def runner_for(kernels: KernelConfig, lora: LoraConfig | None = None) -> Runner:
        config = EngineConfig(
            max_batch=B,
            max_seq_len=seq,
            token_budgets=(B,),
            num_pages=B * seq // 16,
            max_new_tokens_limit=seq - 1,
            dtype="bfloat16",
            kernels=kernels,
            **({"lora": lora} if lora else {}),
        )
        return Runner(model, config, kernels=config.step_kernels(fused_projections=model.fused))

    base: dict[str, float] = {}
    for name, kw in BASE_VARIANTS.items():
        if args.only and name not in args.only:
            continue
        t0 = time.perf_counter()
        runner = runner_for(KernelConfig(**{**PLAIN, **kw}))
        zeros = np.zeros(B, np.int32)
        try:
            time_decode(runner, None, zeros, position, steps=1)
        except Exception as e:  # a probe: report and go on to the next variant
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
            continue
        compile_s = time.perf_counter() - t0
        base[name] = time_decode(runner, None, zeros, position, steps=10)
        print(f"{name}: {base[name]:.3f} ms (compile + first steps {compile_s:.1f} s)", flush=True)
        if not args.no_profile and not interpret:
            ops = device_op_times(step_fn(runner, None, zeros, position))
            print_ops(name, ops)
            results.setdefault("ops", {})[name] = ops[:30]
        del runner
    results["base_step_ms"] = base
    best = min(base, key=base.get) if base else "scan/pallas-attn"
    print("fastest base variant:", best, flush=True)

    lora_steps: dict[str, float] = {}
    if not args.only or "lora" in args.only:
        lora = LoraConfig(max_slots=65, max_rank=16, target_modules=TARGET_MODULES, backend="xla")
        bank = random_bank(model_cfg, lora, 64, jnp.bfloat16)
        slots = slot_pattern(B, 64)
        for backend in LoraBackend:
            runner = runner_for(
                KernelConfig(**{**PLAIN, **BASE_VARIANTS[best]}),
                lora=LoraConfig(max_slots=65, max_rank=16, target_modules=TARGET_MODULES, backend=backend),
            )
            time_decode(runner, bank, slots, position, steps=1)
            lora_steps[backend] = time_decode(runner, bank, slots, position, steps=10)
            print(f"lora {backend} d=64 r16 all ({best}): {lora_steps[backend]:.3f} ms", flush=True)
            if backend != "ragged" and not args.no_profile and not interpret:
                ops = device_op_times(step_fn(runner, bank, slots, position))
                print_ops(f"{backend} lora ({best})", ops, top=30)
                results.setdefault("ops", {})[f"lora-{backend}"] = ops[:60]
            del runner
        del bank
    results["lora_step_ms"] = lora_steps

    if not args.only or "mm" in args.only:
        results["matmul_ms"] = matmul_probes(model, model_cfg, B)
    print("RESULTS", json.dumps({k: v for k, v in results.items() if k != "ops"}), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "profile_decode.json").write_text(json.dumps(results, indent=1))


def timed(fn, *args, reps: int = 10) -> float:
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    outs = [fn(*args) for _ in range(reps)]
    jax.block_until_ready(outs)
    return (time.perf_counter() - t0) / reps * 1e3


def _layer(h, lw):
    q = h @ lw["q_proj"]
    q = q.at[:, : lw["k_proj"].shape[1]].add(h @ lw["k_proj"] + h @ lw["v_proj"])
    h = h + q @ lw["o_proj"]
    a = jax.nn.silu(h @ lw["gate_proj"]) * (h @ lw["up_proj"])
    return (h + a @ lw["down_proj"]).astype(h.dtype)


def matmul_probes(model, model_cfg, B: int) -> dict[str, float]:
    flat = model.flat_params()
    w = {m: flat[f"layers.{'self_attn' if m[0] in 'qkvo' else 'mlp'}.{m}.kernel"] for m in TARGET_MODULES}
    x = jnp.ones((B, model_cfg.hidden_size), jnp.bfloat16)
    out = {}
    out["scan_mm"] = timed(jax.jit(lambda w, x: jax.lax.scan(lambda h, lw: (_layer(h, lw), None), x, w)[0]), w, x)

    def unrolled(w, x):
        for i in range(model_cfg.num_layers):
            x = _layer(x, {m: a[i] for m, a in w.items()})
        return x

    out["unroll_static_slices_mm"] = timed(jax.jit(unrolled), w, x)
    layers = [{m: w[m][i] for m in w} for i in range(model_cfg.num_layers)]
    jax.block_until_ready(layers)

    def loop(layers, x):
        for lw in layers:
            x = _layer(x, lw)
        return x

    out["separate_arrays_mm"] = timed(jax.jit(loop), layers, x)
    print("matmul probes (ms):", {k: round(v, 3) for k, v in out.items()}, flush=True)
    return out


if __name__ == "__main__":
    main()
