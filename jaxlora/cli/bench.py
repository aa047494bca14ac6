"""`jaxlora bench`: end-to-end decode speed against the memory-bandwidth floor (jaxlora.bench.e2e).

jaxlora bench --tiny --out /tmp/bench          # CPU, toy model, seconds
jaxlora bench --out benchmarks/results         # GPU: Llama-2-7B shape, the issue-8 plan
jaxlora bench --quantize bf16 fp8 int8 ...     # every group once per base weight format
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from jaxlora.cli.engine_args import add_tensor_parallel_arg

BACKENDS = ("pallas", "xla", "ragged")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--out", type=Path, default=Path("benchmarks/results"), help="folder for e2e.json, e2e.md and the plots"
    )
    p.add_argument("--tiny", action="store_true", help="toy model on the CPU (runs in seconds)")
    p.add_argument(
        "--budget-s", type=float, default=300.0, help="wall-clock budget: no new group starts once it is spent"
    )
    p.add_argument("--backend", action="append", choices=BACKENDS, help="repeatable; default: all three")
    p.add_argument("--steps", type=int, default=10, help="decode steps timed back to back per cell")
    p.add_argument(
        "--quantize",
        nargs="+",
        choices=("bf16", "fp8", "int8"),
        default=["bf16"],
        help="base weight formats, each group run once per format in this process: bf16 = dense "
        "(float32 with --tiny), fp8 / int8 = weight-only quantized projections",
    )
    p.add_argument(
        "--hf-peer", type=Path, default=None, help="results of benchmarks/hf_peer.py to include as hf-peft rows"
    )
    p.add_argument("--no-plots", action="store_true")
    add_tensor_parallel_arg(p)
    p.add_argument(
        "--skip-groups",
        type=int,
        default=0,
        help="start at this index of the GPU plan (continue an earlier, budget-limited run)",
    )
    p.add_argument(
        "--merge-json",
        type=Path,
        default=None,
        help="an earlier part's e2e.json whose jaxlora rows are kept in this run's results",
    )
    p.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="run nothing: re-render e2e.md and the plots into --out from this e2e.json "
        "(merging --hf-peer rows if given)",
    )


def run(args: argparse.Namespace) -> int:
    from jaxlora.bench import e2e

    if args.steps < 1 or args.budget_s <= 0:
        print("jaxlora bench: --steps must be >= 1, --budget-s > 0", file=sys.stderr)
        return 2
    if args.from_json is not None:
        payload = e2e.rerender(args.from_json, args.out, hf_peer=args.hf_peer)
        print(f"rendered {args.out / 'e2e.md'} from {args.from_json} ({len(payload['rows'])} rows)")
        return 0
    opts = e2e.Options(
        out=args.out,
        tiny=args.tiny,
        budget_s=args.budget_s,
        backends=tuple(args.backend or BACKENDS),
        steps=args.steps,
        hf_peer=args.hf_peer,
        plots=not args.no_plots,
        tensor_parallel=args.tensor_parallel or 1,
        skip_groups=args.skip_groups,
        merge_json=args.merge_json,
        weights=tuple(dict.fromkeys(args.quantize)),
        command="jaxlora bench " + shlex.join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:]),
    )
    payload = e2e.run(opts)
    print(f"wrote {args.out / 'e2e.json'} ({len(payload['rows'])} rows, {len(payload['not_run'])} groups not run)")
    return 0
