"""`jaxlora generate --ray` against single-process `jaxlora generate` on the same requests and machine.

    python -m benchmarks.engine.ray_batch                       # CPU: the embedded SmolLM2, 1 and 2 replicas
    python -m benchmarks.engine.ray_batch --shape 7b            # GPU: a random Llama-2-7B-shape model, 1 replica
    python -m benchmarks.engine.ray_batch --smoke               # a tiny model, a few rows (checks the script)

Every run is a `jaxlora` command in its own process, as a user runs it, with a compilation cache of
its own (every run starts cold). Two rates per run:
- `rows_per_s_e2e`: requests / the command's wall time, model load and warm-up included;
- `rows_per_s` / `tokens_per_s`: generation alone. Single-process: the summary line's (measured
  after warm-up). Ray: the replicas warm up inside the job, so the rate counts every row from the
  first replica's end of warm-up to the job's end (`since_ready` in the summary line: requests,
  tokens, seconds). An earlier rate counted from the first result batch (`after_first`); once a
  replica held 2 x max_batch rows it counted the tokens decoded before that batch returned but not
  their time, and read 1.65x the single process's rate on the 7B shape.
`ratio` is the Ray run's rate over the single-process one. Results: one JSON file (`--out`), with
the machine's load average before and after, since a shared machine skews CPU figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.paths import ROOT, results_dir

SMOLLM2_ENGINE = {
    "max_batch": 16,
    "max_seq_len": 256,
    "token_budgets": [32, 128],
    "page_size": 16,
    "max_new_tokens_limit": 128,
    "max_queue": 256,
    "lora": {"max_slots": 4, "max_rank": 8, "backend": "xla"},
}


@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmark setting: the model and engine, the requests, the replica counts to run."""

    name: str
    rows: int
    max_tokens: int
    replicas: tuple[int, ...]
    engine: dict[str, Any] | None  # None: the shipped config file `config_file`
    config_file: str | None = None
    prompt_vocab: int = 0  # > 0: prompts of `w<id>` words, id < this (the random models' word tokenizer)
    prompt_words: int = 0  # their longest prompt


CASES = {
    "smollm2": Case("smollm2-135m (embedded), CPU", rows=96, max_tokens=32, replicas=(1, 2), engine=SMOLLM2_ENGINE),
    "7b": Case(
        "llama-2-7b shape (random weights), GPU",
        rows=1024,
        max_tokens=128,
        replicas=(1,),
        engine=None,
        config_file="configs/llama2-7b-h200.yaml",
        prompt_vocab=30000,
        prompt_words=128,
    ),
    "smoke": Case(
        "tiny random model, CPU (smoke)",
        rows=24,
        max_tokens=8,
        replicas=(1, 2),
        engine={**SMOLLM2_ENGINE, "max_batch": 8, "max_seq_len": 64, "token_budgets": [32], "max_new_tokens_limit": 16},
        prompt_vocab=100,
        prompt_words=16,
    ),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=("smollm2", "7b"), default="smollm2")
    p.add_argument("--smoke", action="store_true", help="a tiny model and a few rows: checks the script")
    p.add_argument("--rows", type=int, default=None, help="requests (default: the case's)")
    p.add_argument("--out", type=Path, default=results_dir(__file__) / "ray_batch.json")
    p.add_argument("--note", default="", help="free text stored with the results (e.g. the machine's other load)")
    p.add_argument("--write-model", type=Path, default=None, help=argparse.SUPPRESS)  # the child that draws it
    args = p.parse_args(argv)
    if args.write_model:
        _write_model(args.shape, args.smoke, args.write_model)
        return 0
    case = CASES["smoke" if args.smoke else args.shape]
    if args.rows:
        case = dataclasses.replace(case, rows=args.rows)
    with tempfile.TemporaryDirectory(prefix="ray_batch_") as tmp:
        work = Path(tmp)
        model = _model(case, args.smoke, args.shape, work)
        requests = _write_requests(work / "requests.jsonl", case)
        config = _config(case, work)
        base = ["--config", config, "--no-progress", "--input", str(requests), *(["--model", model] if model else [])]
        load_before = os.getloadavg()
        runs = [_run("single-process", [*base, "--output", str(work / "single.jsonl")], _env(work / "cache-single"))]
        for n in case.replicas:
            out = work / f"ray-{n}"
            flags = [*base, "--output", str(out), "--ray", "--replicas", str(n)]
            runs.append(_run(f"ray, {n} replica(s)", flags, _env(work / f"cache-ray-{n}")))
            shutil.rmtree(out, ignore_errors=True)
    single = runs[0]
    for run in runs[1:]:
        run["ratio_tokens_per_s"] = round(run["tokens_per_s"] / single["tokens_per_s"], 3)
        run["ratio_rows_per_s_e2e"] = round(run["rows_per_s_e2e"] / single["rows_per_s_e2e"], 3)
    payload = {
        "case": case.name,
        "rows": case.rows,
        "max_tokens": case.max_tokens,
        "machine": {"cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "device": _device(),  # after the runs: this process then takes the device only briefly
        "note": args.note,
        "runs": runs,
    }
    _merge(args.out, "smoke" if args.smoke else args.shape, payload)
    print(json.dumps(payload, indent=1))
    return 0


def _model(case: Case, smoke: bool, shape: str, work: Path) -> str | None:
    """The --model path: None for the embedded SmolLM2, else a checkpoint drawn and written by a
    child process (this one must not hold the device while the measured commands run)."""
    if not smoke and shape == "smollm2":
        return None
    flags = ["--smoke"] if smoke else ["--shape", shape]
    subprocess.run(
        [sys.executable, "-m", "benchmarks.engine.ray_batch", *flags, "--write-model", str(work / "model")],
        check=True,
        cwd=ROOT,
    )
    return str(work / "model")


def _write_model(shape: str, smoke: bool, out: Path) -> None:
    import jax.numpy as jnp

    from benchmarks.common import LLAMA2_7B, TINY, word_tokenizer
    from jaxlora.loading.orbax_ckpt import save_converted
    from jaxlora.model.params import random_model

    config = TINY if smoke else LLAMA2_7B
    dtype = jnp.float32 if smoke else jnp.bfloat16
    save_converted(random_model(config, dtype=dtype), word_tokenizer(config.vocab_size), out)


def _write_requests(path: Path, case: Case) -> Path:
    rng = random.Random(0)
    with open(path, "w") as f:
        for i in range(case.rows):
            if case.prompt_vocab:
                length = rng.randrange(case.prompt_words // 4, case.prompt_words)
                prompt = " ".join(f"w{rng.randrange(3, case.prompt_vocab)}" for _ in range(length))
            else:
                prompt = f"Request {i}: tell me something about the number {rng.randrange(1000)}."
            f.write(json.dumps({"custom_id": f"r{i}", "prompt": prompt, "max_tokens": case.max_tokens}) + "\n")
    return path


def _config(case: Case, work: Path) -> str:
    if case.engine is None:
        return str(ROOT / case.config_file)
    import yaml

    path = work / "engine.yaml"
    path.write_text(yaml.safe_dump({"engine": case.engine}))
    return str(path)


def _env(cache: Path) -> dict[str, str]:
    # A compilation cache of each run's own: every run starts cold, so wall times compare.
    return {**os.environ, "JAXLORA_COMPILATION_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}


def _run(label: str, flags: list[str], env: dict[str, str]) -> dict[str, Any]:
    command = [sys.executable, "-m", "jaxlora.cli.main", "generate", *flags]
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{label} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    summary = json.loads(done.stderr.strip().splitlines()[-1])
    after = summary.get("since_ready")
    if after:  # Ray: generation after the replicas are warm
        rows_per_s = after["requests"] / after["seconds"] if after["seconds"] else 0.0
        tokens_per_s = after["generated_tokens"] / after["seconds"] if after["seconds"] else 0.0
    else:
        rows_per_s = summary["requests"] / summary["seconds"] if summary["seconds"] else 0.0
        tokens_per_s = summary["tokens_per_s"]
    row = {
        "run": label,
        "wall_s": round(wall, 2),
        "rows_per_s_e2e": round(summary["requests"] / wall, 3),
        "rows_per_s": round(rows_per_s, 3),
        "tokens_per_s": round(tokens_per_s, 2),
        "summary": summary,
    }
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row


def _device() -> str:
    try:
        import jax

        return f"{jax.devices()[0].device_kind} (jax {jax.__version__})"
    except Exception as e:  # the figure is still worth keeping without the device's name
        return f"unknown ({e})"


def _merge(path: Path, key: str, payload: dict[str, Any]) -> None:
    """Results of each shape under its own key, so the CPU and GPU runs share one file."""
    results = json.loads(path.read_text()) if path.is_file() else {}
    results[key] = payload
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
