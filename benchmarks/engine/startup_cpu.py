"""Start-up of the command a new user runs first: `jaxlora generate --prompt "Hi"` on the embedded
default model (SmolLM2-135M-Instruct), on the CPU, timed twice as a user meets it.

    python -m benchmarks.engine.startup_cpu                      # writes benchmarks/results/engine/startup_cpu/
    python -m benchmarks.engine.startup_cpu --max-seq-len 1024 --out OUT.json   # another context

"first": an empty persistent compilation cache (a new machine), "second": the same command again,
the cache written by the first. Each row has the wall time from launching the process to its exit,
the command's own start-up line (`jaxlora.cli.startup`: import, load, register, compile, warm-up
run) and the machine's load average before and after, since other processes on a shared machine
stretch every phase. Targets on a 2-core CI machine: first <= 60 s, second <= 15 s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.paths import results_dir
from jaxlora.cli.startup import parse_line

RESULTS = results_dir(__file__) / "startup_cpu.json"
TARGETS_S = {"first": 60.0, "second": 15.0}


def jaxlora_command() -> list[str]:
    """The `jaxlora` console script beside this interpreter, as a user runs it; else the module."""
    script = Path(sys.executable).with_name("jaxlora")
    return [str(script)] if script.exists() else [sys.executable, "-m", "jaxlora.cli.main"]


def generate_args(prompt: str, max_tokens: int | None, max_seq_len: int | None) -> list[str]:
    """`jaxlora generate`'s arguments: the prompt, and the flags given (None: the command's default)."""
    flags = {"--max-tokens": max_tokens, "--max-seq-len": max_seq_len}
    return ["generate", "--prompt", prompt, *(x for k, v in flags.items() if v is not None for x in (k, str(v)))]


def run_once(cache: Path, args: list[str], code: Path | None = None) -> dict:
    """One `jaxlora generate` process on the CPU with `cache` as its compilation cache; `code`: a
    source tree whose jaxlora it runs (on PYTHONPATH), e.g. an export of an older commit."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAXLORA_COMPILATION_CACHE": str(cache)}
    if code is not None:
        env["PYTHONPATH"] = str(code)
    command = [*jaxlora_command(), *args]
    load_before = os.getloadavg()
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr[-4000:]}")
    return {
        "wall_s": round(wall, 2),
        "startup": parse_line(done.stderr),
        "answer": done.stdout.strip(),
        # The command's last line: tokens and seconds from submitting the prompt to its answer.
        "generate_line": done.stderr.strip().splitlines()[-1],
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", default="Hi")
    p.add_argument("--max-tokens", type=int, default=None, help="(default: the command's)")
    p.add_argument("--max-seq-len", type=int, default=None, help="(default: the command's)")
    p.add_argument("--code", type=Path, default=None, help="source tree to run (default: the jaxlora imported here)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    generate = generate_args(args.prompt, args.max_tokens, args.max_seq_len)
    cache = Path(tempfile.mkdtemp(prefix="jaxlora-startup-cache-"))
    try:
        rows = []
        for start in ("first", "second"):
            row = {"start": start, **run_once(cache, generate, args.code)}
            row["target_s"] = TARGETS_S[start]
            row["meets_target"] = row["wall_s"] <= TARGETS_S[start]
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    result = {
        "command": " ".join(["jaxlora", *(repr(a) if a == args.prompt else a for a in generate)]),
        "code": str(args.code or "this checkout"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
