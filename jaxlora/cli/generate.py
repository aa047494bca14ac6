"""`jaxlora generate`: one prompt (`--prompt`) or a resumable JSONL batch (`--input/--output`)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from jaxlora.cli import engine_args
from jaxlora.cli.common import warmup_progress
from jaxlora.errors import JaxloraError


def add_args(p: argparse.ArgumentParser) -> None:
    engine_args.add_engine_args(p)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument(
        "--prompt",
        help="one user message (the chat template is applied; --raw: text to complete as is); the reply goes to stdout",
    )
    mode.add_argument("--input", type=Path, help="requests, one JSON object per line")
    p.add_argument("--output", type=Path, help="results JSONL for --input (appended; re-running resumes)")
    p.add_argument("--overwrite", action="store_true", help="replace what --output holds instead of resuming from it")
    p.add_argument(
        "--use",
        default=None,
        metavar="NAME",
        help="adapter for --prompt, one of the --adapter names (default: base model)",
    )
    p.add_argument("--raw", action="store_true", help="send --prompt as raw text, without the chat template")
    sampling = p.add_argument_group(
        "sampling",
        "for --prompt; with --input, the default of every line that leaves the field out. The defaults are "
        "those of every jaxlora API (HTTP, gRPC, batch lines): OpenAI's temperature 1, and a seed from --seed "
        "(default 0: a re-run gives the same tokens; a batch line without a seed gets one derived from --seed "
        "and its custom_id, so a resumed job gives the same tokens)",
    )
    sampling.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="tokens to generate at most (default, as OpenAI's: the rest of the context for a chat, 16 with --raw)",
    )
    sampling.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: 1, OpenAI's)")
    sampling.add_argument("--top-p", type=float, default=None, help="(default: 1, off)")
    sampling.add_argument("--top-k", type=int, default=None, help="0 = off (default: 0)")
    sampling.add_argument(
        "--repetition-penalty",
        type=float,
        default=None,
        help="vLLM's: > 0, over the prompt and the output (default: 1, off)",
    )
    sampling.add_argument(
        "--presence-penalty", type=float, default=None, help="OpenAI's: [-2, 2], over the output (default: 0, off)"
    )
    sampling.add_argument(
        "--frequency-penalty", type=float, default=None, help="OpenAI's: [-2, 2], over the output (default: 0, off)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar even on a terminal")
    add_ray_args(p)


def add_ray_args(p: argparse.ArgumentParser) -> None:
    ray = p.add_argument_group("Ray (pip install 'jaxlora[ray]')")
    ray.add_argument(
        "--ray",
        action="store_true",
        help="run --input (JSONL or Parquet) on Ray Data replicas; --output is then a folder of part files",
    )
    ray.add_argument(
        "--ray-address", default=None, metavar="ADDR", help="Ray cluster to join (default: start a local one)"
    )
    ray.add_argument("--replicas", type=int, default=1, metavar="N", help="engines, one Ray actor each (default 1)")
    ray.add_argument("--replica-cpus", type=float, default=1.0, metavar="N", help="CPUs reserved per replica")
    ray.add_argument(
        "--rows-per-block",
        type=int,
        default=None,
        metavar="N",
        help="requests per Ray Data block, the unit a replica takes and results come back in (default 16)",
    )
    ray.add_argument(
        "--replica-gpus",
        type=float,
        default=None,
        metavar="N",
        help="GPUs per replica (default: 1 when the cluster has GPUs, else 0)",
    )


_SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "repetition_penalty", "presence_penalty")
_SAMPLING_FLAGS += ("frequency_penalty",)


def sampling_flags(args: argparse.Namespace) -> dict:
    """The sampling flags given, as SamplingParams fields (the others keep their defaults)."""
    return {name: getattr(args, name) for name in _SAMPLING_FLAGS if getattr(args, name) is not None}


def line_defaults(args: argparse.Namespace):
    """What the batch lines that leave a field out get: the sampling flags, the served name of the
    base model, and the job's seed (--seed, default 0)."""
    from jaxlora.engine.batch_job import LineDefaults

    return LineDefaults(
        sampling=sampling_flags(args), base_model=engine_args.base_model_name(args), seed=_job_seed(args)
    )


def _job_seed(args: argparse.Namespace) -> int:
    return 0 if getattr(args, "seed", None) is None else args.seed


def run(args: argparse.Namespace) -> int:
    problem = _usage_problem(args)
    if problem:
        print(f"jaxlora generate: error: {problem}", file=sys.stderr)
        return 2
    if args.ray:
        return _run_ray(args)
    if args.input is not None:
        from jaxlora.engine.batch_job import run_batch_job

        return run_batch_job(
            args.input,
            args.output,
            lambda: engine_args.engine_from_args(args),
            overwrite=args.overwrite,
            progress=not args.no_progress,
            warmup_progress=warmup_progress,
            defaults=line_defaults(args),
            adapters=args.adapter,
        )
    return _run_prompt(args)


def _usage_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the flags taken together (checked before anything loads), or None."""
    ray_flags = args.ray_address is not None or args.replicas != 1 or args.replica_gpus is not None
    ray_flags = ray_flags or args.rows_per_block is not None
    if ray_flags and not args.ray:
        return "--ray-address, --replicas, --replica-gpus and --rows-per-block go with --ray"
    if args.ray and args.input is None:
        return "--ray runs a batch: give --input and --output"
    if args.input is not None:
        if args.output is None:
            return "--input needs --output"
        if args.use is not None or args.raw:
            return "--use and --raw go with --prompt; batch lines name their own adapter and prompt kind"
        return None
    if args.output is not None or args.overwrite:
        return "--output and --overwrite go with --input"
    if args.use is not None and args.use not in args.adapter:
        given = ", ".join(args.adapter) or "none"
        return f"--use {args.use}: no --adapter {args.use}=PATH was given (adapters given: {given})"
    return None


def _run_ray(args: argparse.Namespace) -> int:
    try:
        from jaxlora.ray import RayJob, run_ray_job
    except ImportError as e:
        print(f"jaxlora generate: --ray needs Ray ({e}); pip install 'jaxlora[ray]'", file=sys.stderr)
        return 2
    from jaxlora.cli import compile_cache

    try:
        job = RayJob(
            replicas=args.replicas,
            cpus_per_replica=args.replica_cpus,
            gpus_per_replica=args.replica_gpus,
            **({"rows_per_block": args.rows_per_block} if args.rows_per_block is not None else {}),
            compilation_cache=str(compile_cache.cache_dir(flag=getattr(args, "compilation_cache", None)) or "") or None,
        )
    except ValueError as e:
        print(f"jaxlora generate: error: {e}", file=sys.stderr)
        return 2
    try:
        spec = engine_args.engine_spec(args)
    except (JaxloraError, ValueError, OSError) as e:
        print(f"jaxlora generate: {e}", file=sys.stderr)
        return 2
    return run_ray_job(
        args.input,
        args.output,
        spec,
        job,
        address=args.ray_address,
        overwrite=args.overwrite,
        progress=not args.no_progress,
        defaults=line_defaults(args),
    )


def _run_prompt(args: argparse.Namespace) -> int:
    """One prompt, one answer. Nothing is warmed up: of the step programs a server compiles ahead,
    one answer runs a few (a prompt's budget, then decode's), and each compiles, or is read from the
    compilation cache, on first use. The answer's time includes that."""
    from jaxlora.cli.startup import StartupClock
    from jaxlora.engine import GenerationRequest, SamplingParams
    from jaxlora.engine.request import DEFAULT_TEMPERATURE

    clock = StartupClock(getattr(args, "started", None))
    clock.lap("import")
    try:
        sampling = SamplingParams(
            **{"temperature": DEFAULT_TEMPERATURE, "seed": _job_seed(args), **sampling_flags(args)}
        )
        engine = engine_args.engine_from_args(args, clock=clock, compile_ahead=False)
        prompt = {"prompt": args.prompt} if args.raw else {"messages": [{"role": "user", "content": args.prompt}]}
        clock.print("jaxlora generate", getattr(args, "compilation_cache_dir", None))
        start = time.perf_counter()
        request = GenerationRequest(request_id="cli", adapter=args.use, sampling=sampling, **prompt)
        handle = engine.submit(request, stream=False)
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
    print(
        f"[{n} tokens in {seconds:.2f}s, {n / seconds:.1f} tok/s, finish: {result.finish_reason}; "
        "the time includes the first use of each step program]",
        file=sys.stderr,
    )
    return 0
