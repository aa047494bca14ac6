"""Registering PEFT folders at start-up, as `jaxlora serve --adapter NAME=PATH ...` does it
(`jaxlora.engine.build.build_engine` -> `register_many`), one thread against several.

    python -m benchmarks.engine.register_peft                     # 7B shape, s1 adapters, 200 folders
    python -m benchmarks.engine.register_peft --n 2000 --threads 1,8 --out OUT.json

The folders are S-LoRA's `s1` setting on the 7B shape (rank 8 on q/k/v/o, bf16 safetensors, 16.8 MB
each) written as `benchmarks/serving/server_api.py` writes them for the served trace: four real
weight sets, the other folders links to their files, so the page cache holds the bytes after the
first pass, as on a server whose adapters were just written or read. Each row registers every
folder into a fresh pager (pageable host memory: on the CPU there is no pinned memory) and gives
ms per adapter and the figure for 2,000 adapters at that rate.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import jax.numpy as jnp

from benchmarks.common import LLAMA2_7B
from benchmarks.engine.paging import weight_pool
from benchmarks.paths import results_dir
from benchmarks.serving.server_api import write_adapter_folders
from jaxlora.adapters import Pager
from jaxlora.adapters.register_many import default_threads, register_many
from jaxlora.config import ATTENTION_MODULES, LoraConfig

RESULTS = results_dir(__file__) / "register_peft.json"
RANK = 8
WEIGHT_SETS = 4


def time_registration(folders: dict[str, Path], lora: LoraConfig, threads: int) -> dict:
    """Registers `folders` into a fresh pager from `threads` threads; the row."""
    pager = Pager(LLAMA2_7B, lora, dtype=jnp.bfloat16, compile_writes=False)
    start = time.perf_counter()
    register_many(pager, folders, threads=threads)
    seconds = time.perf_counter() - start
    per_adapter = seconds / len(folders)
    return {
        "threads": threads,
        "adapters": len(folders),
        "seconds": round(seconds, 3),
        "ms_per_adapter": round(per_adapter * 1e3, 2),
        "projected_2000_s": round(per_adapter * 2000, 1),
        "host_bytes": pager.registered_bytes,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=200, help="PEFT folders to register")
    p.add_argument("--threads", default=None, help="comma-separated thread counts (default: 1 and the default)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    counts = [int(x) for x in args.threads.split(",")] if args.threads else sorted({1, default_threads()})
    lora = LoraConfig(max_slots=8, max_rank=RANK, target_modules=ATTENTION_MODULES)
    rows = []
    with tempfile.TemporaryDirectory(prefix="jaxlora-register-") as tmp:
        pool = weight_pool(LLAMA2_7B, RANK, ATTENTION_MODULES, WEIGHT_SETS)
        folders = write_adapter_folders(pool, ranks=(RANK,) * WEIGHT_SETS, n=args.n, out=Path(tmp))
        del pool
        time_registration(dict(list(folders.items())[:WEIGHT_SETS]), lora, 1)  # warm imports and page cache
        for threads in counts:
            row = time_registration(folders, lora, threads)
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {
        "command": "python -m benchmarks.engine.register_peft " + " ".join(argv if argv is not None else sys.argv[1:]),
        "setting": f"7B shape, rank {RANK} on q/k/v/o, bf16 PEFT folders ({WEIGHT_SETS} weight sets, the rest links)",
        "machine": {
            "cpus": os.cpu_count(),
            "default_threads": default_threads(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
