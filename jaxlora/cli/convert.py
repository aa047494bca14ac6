"""`jaxlora convert SRC --out DIR [--quantize fp8|int8]`: save a model as an orbax checkpoint that loads
fast (quantized: start-up then skips quantizing)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxlora.cli.common import DTYPES, add_quantize_arg
from jaxlora.errors import ModelLoadError


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "source",
        nargs="?",
        default=None,
        help="GGUF file or Hugging Face folder (default: the embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument("--out", required=True, type=Path, help="output folder, e.g. checkpoints/smollm2-135m")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    add_quantize_arg(p)


def run(args: argparse.Namespace) -> int:
    from jaxlora.loading import timed_load
    from jaxlora.loading.orbax_ckpt import save_converted

    try:
        model, tok, load_s = timed_load(args.source, dtype=DTYPES[args.dtype], quantization=args.quantize)
        save_converted(model, tok, args.out)
        _, _, fast_s = timed_load(args.out, dtype=DTYPES[args.dtype])
    except (ModelLoadError, FileExistsError) as e:
        print(f"jaxlora convert: {e}", file=sys.stderr)
        return 2
    weights = f" ({args.quantize} projections)" if args.quantize else ""
    print(
        f"converted {args.source or 'default model'} -> {args.out}{weights}: load {load_s:.2f}s from the source, "
        f"{fast_s:.2f}s from the converted checkpoint"
    )
    return 0
