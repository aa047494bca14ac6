"""`jaxlora demo`: the main job. One mixed batch on one copy of the base weights: every prompt is
answered by the base model and by every demo adapter, and the answers are printed side by side with
the behaviour each one shows."""

from __future__ import annotations

import argparse
import sys
import textwrap
import time
from pathlib import Path

from jaxlora.cli import engine_args
from jaxlora.cli.common import warmup_progress
from jaxlora.errors import JaxloraError

DEFAULT_PROMPTS = (
    "What is the capital of Italy?",
    "How many legs does a spider have?",
    "Give me one tip for sleeping better.",
)


def add_args(p: argparse.ArgumentParser) -> None:
    engine_args.add_engine_args(p, adapters_help="also register this PEFT adapter folder")
    p.add_argument(
        "--demo-dir",
        type=Path,
        default=None,
        help="folder of demo adapters, one PEFT folder each (default: checkpoints/demo)",
    )
    p.add_argument("--prompt", action="append", default=None, help="prompt to ask (repeatable)")
    p.add_argument("--max-tokens", type=int, default=48)


def demo_adapters(folder: Path) -> dict[str, str]:
    """Every PEFT folder directly under `folder`, by folder name."""
    return {d.name: str(d) for d in sorted(folder.iterdir()) if (d / "adapter_config.json").is_file()}


def run(args: argparse.Namespace) -> int:
    from jaxlora.engine import GenerationRequest, SamplingParams
    from jaxlora.train.demo import DEMO_DIR, shown_behaviours

    folder = args.demo_dir or DEMO_DIR
    if args.demo_dir is not None and not folder.is_dir():
        print(f"jaxlora demo: error: --demo-dir {folder}: no such folder", file=sys.stderr)
        return 2
    prompts = tuple(args.prompt or DEFAULT_PROMPTS)
    try:
        adapters = demo_adapters(folder) if folder.is_dir() else {}
        engine = engine_args.engine_from_args(args, extra_adapters=adapters)
        names = [None, *{**adapters, **args.adapter}]
        print(
            f"base model + {len(names) - 1} adapters ({', '.join(map(str, names[1:]))}) x {len(prompts)} "
            f"prompts = {len(names) * len(prompts)} rows in one continuous batch; warming up...",
            file=sys.stderr,
            flush=True,
        )
        engine.warmup(progress=warmup_progress)
        start = time.perf_counter()
        handles = [
            (
                name,
                prompt,
                engine.submit(
                    GenerationRequest(
                        request_id=f"{i}-{j}",
                        messages=[{"role": "user", "content": prompt}],
                        adapter=name,
                        sampling=SamplingParams(max_tokens=args.max_tokens),
                    ),
                    stream=False,
                ),
            )
            for i, prompt in enumerate(prompts)
            for j, name in enumerate(names)
        ]
    except (JaxloraError, ValueError, OSError) as e:
        print(f"jaxlora demo: {e}", file=sys.stderr)
        return 2
    engine.run_until_idle()
    seconds = time.perf_counter() - start
    tokens = 0
    for prompt in prompts:
        print(f"\n=== {prompt}")
        for name, p, handle in handles:
            if p != prompt:
                continue
            result = handle.result()
            tokens += len(result.token_ids)
            text = result.error or result.text.strip()
            shows = ", ".join(shown_behaviours(text)) or "-"
            print(f"  [{name or 'base'}] (shows: {shows})")
            print(textwrap.indent(textwrap.fill(text, 96), "      "))
    stats = engine.stats()
    print(
        f"\n{len(handles)} rows, {tokens} tokens in {seconds:.1f}s ({tokens / seconds:.1f} tok/s), "
        f"compiles after warm-up: {stats.get('compiles_after_warmup')}",
        file=sys.stderr,
    )
    return 0
