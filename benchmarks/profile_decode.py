"""Where the decode step's time goes (Llama-2-7B shape, bf16, batch 64): ablations, one H200 call.

  full        the engine's jitted decode step, no adapters (bank=None), cache of prompt+gen = 256
  short_kv    the same with an 8-position cache: attention and KV traffic almost gone
  scan_mm     only the seven projections per layer, lax.scan over the stacked weights (as the model)
  loop_mm     the same matmuls, a Python loop over per-layer weight arrays (no dynamic slicing)
  + copies in the compiled full step larger than 64 MB (a weight or KV copy per layer shows here)

    PYTHONPATH=. python3 benchmarks/profile_decode.py
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jaxlora.bench.e2e import LLAMA2_7B, TINY, time_decode  # noqa: E402
from jaxlora.config import TARGET_MODULES  # noqa: E402
from jaxlora.engine.config import EngineConfig  # noqa: E402
from jaxlora.engine.runner import Runner  # noqa: E402
from jaxlora.lora.apply import LoraRuntime  # noqa: E402
from jaxlora.model.params import random_model  # noqa: E402

B = 64
MODEL = TINY if "--tiny" in sys.argv else LLAMA2_7B


def timed(fn, *args, reps: int = 10) -> float:
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    outs = [fn(*args) for _ in range(reps)]
    jax.block_until_ready(outs)
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    model = random_model(MODEL, dtype=jnp.bfloat16)
    flat = model.flat_params()
    w = {m: flat[f"layers.{'self_attn' if m[0] in 'qkvo' else 'mlp'}.{m}.kernel"] for m in TARGET_MODULES}
    results = {}
    for name, seq in (("full", 256), ("short_kv", 16)):
        config = EngineConfig(max_batch=B, max_seq_len=seq, prefill_buckets=(8,), prefill_batch=1,
                              max_new_tokens_limit=seq - 1, dtype="bfloat16")
        runner = Runner(model, config, runtime=LoraRuntime())
        results[name] = time_decode(runner, None, np.zeros(B, np.int32), seq // 2, steps=1)
        results[name] = time_decode(runner, None, np.zeros(B, np.int32), seq // 2, steps=10)
        print(name, round(results[name], 3), "ms", flush=True)
        if name == "full":
            from jaxlora.engine.runner import decode_step
            from jaxlora.engine.sampling import SamplingArrays
            hlo = decode_step.lower(model.params, None, runner.kv, np.zeros(B, np.int32), np.zeros(B, np.int32),
                                    np.zeros(B, np.int32), SamplingArrays.zeros(B), graphdef=model.graphdef,
                                    runtime=runner.runtime).compile().as_text()
            big = []
            for line in hlo.splitlines():
                m = re.search(r"= (bf16|f32)\[([\d,]+)\]\S* (copy|dynamic-slice|dynamic-update-slice|fusion)\(", line)
                if m:
                    n = np.prod([int(d) for d in m.group(2).split(",")]) * (2 if m.group(1) == "bf16" else 4)
                    if n > 64e6:
                        big.append(f"{m.group(3)} {m.group(1)}[{m.group(2)}] {n / 1e6:.0f} MB")
            print("big ops in the compiled step:", len(big), flush=True)
            for b in sorted(set(big), key=big.count, reverse=True)[:12]:
                print("  ", big.count(b), "x", b, flush=True)
        del runner

    x = jnp.ones((B, MODEL.hidden_size), jnp.bfloat16)

    @jax.jit
    def scan_mm(w, x):
        def layer(h, lw):
            q = h @ lw["q_proj"]
            q = q.at[:, :lw["k_proj"].shape[1]].add(h @ lw["k_proj"] + h @ lw["v_proj"])
            h = h + q @ lw["o_proj"]
            a = jax.nn.silu(h @ lw["gate_proj"]) * (h @ lw["up_proj"])
            return (h + a @ lw["down_proj"]).astype(h.dtype), None
        return jax.lax.scan(layer, x, w)[0]

    results["scan_mm"] = timed(scan_mm, w, x)
    print("scan_mm", round(results["scan_mm"], 3), "ms", flush=True)
    layers = [{m: w[m][i] for m in w} for i in range(MODEL.num_layers)]
    jax.block_until_ready(layers)
    del w, flat

    @jax.jit
    def loop_mm(layers, x):
        h = x
        for lw in layers:
            q = h @ lw["q_proj"]
            q = q.at[:, :lw["k_proj"].shape[1]].add(h @ lw["k_proj"] + h @ lw["v_proj"])
            h = h + q @ lw["o_proj"]
            a = jax.nn.silu(h @ lw["gate_proj"]) * (h @ lw["up_proj"])
            h = (h + a @ lw["down_proj"]).astype(h.dtype)
        return h

    results["loop_mm"] = timed(loop_mm, layers, x)
    print("loop_mm", round(results["loop_mm"], 3), "ms", flush=True)
    print("RESULTS", results, flush=True)


if __name__ == "__main__":
    main()
