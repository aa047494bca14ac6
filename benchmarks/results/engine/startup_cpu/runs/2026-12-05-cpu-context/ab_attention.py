"""A/B of the XLA ragged attention on the CPU, one layer, SmolLM2-135M's heads (9 query, 3 KV, 64 wide),
page_size 16, 8 sequences: the whole-table read (`--old FILE`, ragged_xla.py of ef459aa) against the
chunked read at chunk_pages 16 and 32, per table width (ctx), context in use (kv) and step size (T).

    git show ef459aa:pallas_kernels/attention/ragged_xla.py > /tmp/old_ragged_xla.py
    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/results/engine/startup_cpu/runs/2026-12-05-cpu-context/ab_attention.py \
        --old /tmp/old_ragged_xla.py
"""

import argparse
import importlib.util
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.attention.ragged_xla import ragged_paged_attention_xla as new

H, KVH, D, PS, S = 9, 3, 64, 16, 8


def ms_per_call(fn, num_tokens, pages_per_seq, kv, reps=20, **kw):
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((1, S * pages_per_seq + 1, PS, KVH, D), np.float32))
    q = jnp.asarray(rng.standard_normal((num_tokens, H, D), np.float32))
    tables = jnp.asarray(np.arange(S * pages_per_seq).reshape(S, pages_per_seq) + 1, jnp.int32)
    per_seq = num_tokens // S
    i32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
    args = (q, k, k, i32(0), i32(np.arange(S) * per_seq), i32(np.full(S, per_seq)), i32(np.full(S, kv)), tables)
    f = jax.jit(lambda *a: fn(*a, **kw))
    f(*args).block_until_ready()
    start = time.perf_counter()
    for _ in range(reps):
        f(*args).block_until_ready()
    return (time.perf_counter() - start) / reps * 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--old", required=True)
    args = p.parse_args()
    spec = importlib.util.spec_from_file_location("old_ragged_xla", args.old)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    for pages in (64, 256):
        for kv in (40, 1000, pages * PS):
            for tokens in (8, 256):
                row = dict(ctx=pages * PS, kv=kv, T=tokens, load_average=[round(x, 2) for x in os.getloadavg()])
                row["old_ms"] = round(ms_per_call(old.ragged_paged_attention_xla, tokens, pages, kv), 2)
                for cp in (16, 32):
                    row[f"chunk{cp}_ms"] = round(ms_per_call(new, tokens, pages, kv, chunk_pages=cp), 2)
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
