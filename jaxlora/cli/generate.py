"""`jaxlora generate`: one prompt (`--prompt`) or a resumable JSONL batch (`--input/--output`)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from jaxlora.cli.engine_args import add_engine_args, build_engine
from jaxlora.errors import JaxloraError


def add_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--prompt", help="one prompt (chat template applied); the reply goes to stdout")
    mode.add_argument("--input", type=Path, help="requests, one JSON object per line")
    p.add_argument("--output", type=Path, help="results JSONL for --input (appended; re-running resumes)")
    p.add_argument("--use", default=None, metavar="NAME", help="adapter for --prompt (default: base model)")
    p.add_argument("--raw", action="store_true", help="send --prompt as is, without the chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--no-progress", action="store_true", help="no progress bar even on a terminal")


def run(args: argparse.Namespace) -> int:
    if args.input is not None:
        from jaxlora.engine.batch_job import run_batch_job

        if not args.output:
            print("jaxlora generate: --input needs --output", file=sys.stderr)
            return 2
        return run_batch_job(args)
    return _run_prompt(args)


def _run_prompt(args: argparse.Namespace) -> int:
    from jaxlora.engine import GenerationRequest, SamplingParams

    try:
        engine = build_engine(args)
        sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                  top_k=args.top_k, seed=args.seed)
        prompt = {"prompt": args.prompt} if args.raw else {"messages": [{"role": "user", "content": args.prompt}]}
        engine.warmup()
        start = time.perf_counter()
        handle = engine.submit(GenerationRequest(request_id="cli", adapter=args.use, sampling=sampling, **prompt))
    except (JaxloraError, ValueError, OSError) as e:
        print(f"jaxlora generate: {e}", file=sys.stderr)
        return 2
    engine.run_until_idle()
    result = handle.result()
    seconds = time.perf_counter() - start
    if result.error:
        print(f"jaxlora generate: {result.error}", file=sys.stderr)
        return 1
    print(result.text)
    n = len(result.token_ids)
    print(f"[{n} tokens in {seconds:.2f}s, {n / seconds:.1f} tok/s, finish: {result.finish_reason}]",
          file=sys.stderr)
    return 0
