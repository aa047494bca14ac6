"""The ragged engine on the GPU, checked end to end before it is timed: the same mixed-adapter
requests through engines that differ only in kernels (Pallas attention + Pallas LoRA, the GPU
defaults, against XLA attention + XLA LoRA) give the same greedy tokens, with zero compiles after
warm-up. A toy model (float32), so the two paths agree to the last token. The shipped engine runs
the serving layout (q|k|v and gate|up fused, jaxlora.model.fused) with cuBLAS GEMMs; the XLA one the
separate layout with XLA's GEMM choice, so the check also covers the layout and the fused-output
LoRA kernel.

    python -m benchmarks.engine.gpu_check --out $OUT
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import TINY, adapter_name, random_bank, word_tokenizer
from jaxlora.adapters import ResidentBank
from jaxlora.config import LoraConfig
from jaxlora.engine.config import EngineConfig
from jaxlora.engine.engine import Engine
from jaxlora.engine.request import GenerationRequest, SamplingParams
from jaxlora.kernels import KernelConfig
from jaxlora.model.params import random_model


def run(
    backend: str, attention: str, model, requests, gemm: str = "auto"
) -> tuple[list[tuple[int, ...]], int | None, float]:
    lora = LoraConfig(max_slots=8, max_rank=8, backend=backend)
    config = EngineConfig(
        max_batch=8,
        max_seq_len=128,
        token_budgets=(8, 32, 64),
        page_size=16,
        num_pages=40,
        max_new_tokens_limit=48,
        lora=lora,
        kernels=KernelConfig(attention=attention, gemm=gemm),
    )
    source = ResidentBank(random_bank(model.config, lora, 6, model.dtype, seed=1), [adapter_name(i) for i in range(6)])
    tokenizer = word_tokenizer(model.config.vocab_size)
    engine = Engine(model, tokenizer, config, source)
    engine.warmup()
    t0 = time.perf_counter()
    outs = engine.generate(requests)
    errors = [o.error for o in outs if o.error]
    if errors:
        raise RuntimeError(errors[0])
    return [o.token_ids for o in outs], engine.compiles_after_warmup, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = random_model(TINY, dtype=jnp.float32)
    fused = random_model(TINY, dtype=jnp.float32, fused=True)  # the same weights, the serving layout
    rng = np.random.default_rng(0)
    requests = [
        GenerationRequest(
            request_id=f"r{i}",
            prompt_ids=rng.integers(3, TINY.vocab_size, int(n)).tolist(),
            adapter=adapter_name(i % 6) if i % 4 else None,
            sampling=SamplingParams(max_tokens=int(m)),
        )
        for i, (n, m) in enumerate(zip(rng.integers(1, 70, 14), rng.integers(4, 40, 14)))
    ]
    result = {"device": jax.devices()[0].device_kind}
    fast, compiles, seconds = run("pallas", "pallas", fused, requests)
    slow, _, _ = run("xla", "xla", model, requests, gemm="xla")
    same = sum(a == b for a, b in zip(fast, slow))
    result.update(
        requests=len(requests),
        identical=same,
        compiles_after_warmup=compiles,
        seconds=round(seconds, 2),
        tokens=[list(t) for t in fast],  # to compare runs under different XLA flags
        first_difference=next(([i, list(a), list(b)] for i, (a, b) in enumerate(zip(fast, slow)) if a != b), None),
    )
    print(json.dumps(result), flush=True)
    (args.out / "engine_gpu_check.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
