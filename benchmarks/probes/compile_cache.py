"""Which warm-up programs a second start reads from JAX's persistent compilation cache, and why the
others miss: the same engine warmed up in fresh processes over one cache folder.

Each run is a child process (JAX decides once per process whether a cache is in use) that builds
the preset's engine over a random-weight model of the 7B shape with `--layers` layers, turns the
cache on at `--cache`, warms up with JAX's compiler log at DEBUG (one "cache hit" / "cache miss"
line per compiled program) and dumps every lowered module (`jax_dump_ir_to`). A row per run gives
the hits and misses per program name and the warm-up's compile seconds; for each program that
missed in a later run, the first lines that differ between that run's module and the first run's
(locations stripped: the cache key ignores them).

    python -m benchmarks.probes.compile_cache --layers 4 --runs 2 --out /tmp/cc.json    # GPU
    python -m benchmarks.probes.compile_cache --tiny --runs 2 --out /tmp/cc.json        # CPU smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PRESET = Path(__file__).resolve().parents[2] / "configs" / "llama2-7b-h200.yaml"
_LOC = re.compile(r"\s*loc\(.*?\)\s*$|#loc\d*( = loc\(.*\))?")


class _Capture(logging.Handler):
    """Collects JAX's persistent-cache hit / miss lines."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "cache hit" in msg.lower() or "cache miss" in msg.lower():
            self.lines.append(msg)


def _program(line: str) -> str:
    m = re.search(r"for '([^']+)'", line)
    return m.group(1) if m else line[:80]


def child(args: argparse.Namespace) -> dict:
    """One start: build, warm up, report hits and misses."""
    import jax

    jax.config.update("jax_compilation_cache_dir", args.cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_dump_ir_to", args.dump)
    capture = _Capture()
    for name in ("jax._src.compiler", "jax._src.compilation_cache", "jax._src.cache_key"):
        lg = logging.getLogger(name)
        lg.setLevel(logging.DEBUG)
        lg.addHandler(capture)

    from benchmarks.common import LLAMA2_7B, TINY, word_tokenizer
    from jaxlora.engine import EngineConfig
    from jaxlora.model.params import random_model

    if args.tiny:
        model_config = TINY
        config = EngineConfig(max_batch=8, max_seq_len=64, token_budgets=(8, 16), page_size=16)
    else:
        model_config = dataclasses.replace(LLAMA2_7B, num_layers=args.layers)
        config = EngineConfig.from_yaml(PRESET)
    model = random_model(model_config, dtype=config.jnp_dtype, fused=True)
    from jaxlora.engine.build import build_engine

    engine = build_engine(config, model, word_tokenizer(model_config.vocab_size))
    start = time.perf_counter()
    engine.warmup()
    hits = [_program(x) for x in capture.lines if "hit" in x.lower()]
    misses = [_program(x) for x in capture.lines if "miss" in x.lower()]
    return {
        "warmup_s": round(time.perf_counter() - start, 2),
        "compile_s": round(engine.warmup_seconds["compile"], 2),
        "hits": hits,
        "misses": misses,
        "backend": jax.default_backend(),
    }


def _modules(dump: Path) -> dict[str, list[list[str]]]:
    """Per program name (`jit_packed_step`), the location-free text of each module dumped for it."""
    out: dict[str, list[list[str]]] = {}
    for p in sorted(dump.glob("*.mlir")):
        name = re.sub(r"^jax_ir\d+_|_compile\.mlir$", "", p.name)
        lines = [_LOC.sub("", line) for line in p.read_text().splitlines() if not line.startswith("#loc")]
        out.setdefault(name, []).append(lines)
    return out


def _first_difference(a: str, b: str, context: int = 160) -> str:
    """Where two lines first differ, with `context` characters of each around it."""
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    lo = max(0, i - context)
    return f"at char {i} of {len(a)}/{len(b)}: -{a[lo : i + context]!r} +{b[lo : i + context]!r}"


def module_diffs(first: Path, later: Path, limit: int = 6) -> dict[str, list[list[str]]]:
    """Per program name, for each module of the later dump whose location-free text is in no module
    of that name in the first dump: where its lines first differ from the first dump's module with
    the same signature line (else the same length), for up to `limit` differing lines."""
    a, b = _modules(first), _modules(later)
    out: dict[str, list[list[str]]] = {}
    for name, texts in b.items():
        for text in texts:
            olds = a.get(name, [])
            if text in olds:
                continue
            main = next((line for line in text if "func.func public @main" in line), None)
            old = next((o for o in olds if main in o), None) or next((o for o in olds if len(o) == len(text)), [])
            differing = [(x, y) for x, y in zip(old, text) if x != y]
            lines = [_first_difference(x, y) for x, y in differing[:limit]]
            if len(old) != len(text):
                lines.append(f"{len(old)} lines against {len(text)}")
            out.setdefault(name, []).append([f"{len(differing)} differing lines", *lines])
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cache", default="")
    ap.add_argument("--dump", default="")
    args = ap.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return
    work = Path(tempfile.mkdtemp(prefix="ccprobe-"))
    rows = []
    for i in range(args.runs):
        dump = work / f"ir{i}"
        cmd = [sys.executable, "-m", "benchmarks.probes.compile_cache", "--child", "--out", str(args.out)]
        cmd += ["--cache", str(work / "cache"), "--dump", str(dump), "--layers", str(args.layers)]
        cmd += ["--tiny"] if args.tiny else []
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not lines:
            print(proc.stdout[-3000:], proc.stderr[-6000:], file=sys.stderr)
            raise SystemExit(f"run {i} failed (rc {proc.returncode})")
        row = json.loads(lines[-1][len("RESULT ") :])
        row["run"] = i
        row["process_s"] = round(time.perf_counter() - t0, 2)
        if i:
            row["diffs_vs_first"] = module_diffs(work / "ir0", dump)
        rows.append(row)
        summary = {k: (len(v) if isinstance(v, list) else v) for k, v in row.items() if k != "diffs_vs_first"}
        print(json.dumps(summary), "misses:", sorted(set(row["misses"])), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"layers": args.layers, "tiny": args.tiny, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
