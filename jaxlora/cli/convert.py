"""`jaxlora convert SRC --out DIR`: save a model as an orbax checkpoint that loads fast."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxlora.cli.common import DTYPES
from jaxlora.errors import ModelLoadError


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", nargs="?", default=None,
                   help="GGUF file or Hugging Face folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, type=Path, help="output folder, e.g. checkpoints/smollm2-135m")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")


def run(args: argparse.Namespace) -> int:
    from jaxlora.loading import timed_load
    from jaxlora.loading.orbax_ckpt import save_converted

    try:
        model, tok, load_s = timed_load(args.source, dtype=DTYPES[args.dtype])
        save_converted(model, tok, args.out)
        _, _, fast_s = timed_load(args.out, dtype=DTYPES[args.dtype])
    except (ModelLoadError, FileExistsError) as e:
        print(f"jaxlora convert: {e}", file=sys.stderr)
        return 2
    print(f"converted {args.source or 'default model'} -> {args.out}: load {load_s:.2f}s from the source, "
          f"{fast_s:.2f}s from the converted checkpoint")
    return 0
