"""`jaxlora merge --adapter PATH --out DIR`: the base model with one adapter merged in, as an HF folder."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxlora.cli.common import DTYPES, add_model_args
from jaxlora.errors import JaxloraError


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--adapter", required=True, type=Path, help="PEFT adapter folder")
    p.add_argument("--out", required=True, type=Path, help="output Hugging Face model folder")


def run(args: argparse.Namespace) -> int:
    from jaxlora.loading import load_model
    from jaxlora.loading.hf_writer import save_hf_folder
    from jaxlora.lora.merge import merged_params
    from jaxlora.lora.peft_format import load_peft_adapter

    if not (args.adapter / "adapter_config.json").is_file():  # before the model loads
        print(
            f"jaxlora merge: error: --adapter {args.adapter}: no adapter_config.json there (not a PEFT adapter folder)",
            file=sys.stderr,
        )
        return 2
    try:
        model, tok = load_model(args.model, dtype=DTYPES[args.dtype])
        adapter = load_peft_adapter(args.adapter, name=_name(args.adapter), model_config=model.config, max_rank=1 << 30)
        save_hf_folder(
            model, tok, args.out, merged_params(model.flat_params(), adapter.weights, quantization=model.quantization)
        )
    except (JaxloraError, OSError) as e:
        print(f"jaxlora merge: {e}", file=sys.stderr)
        return 2
    print(f"merged {args.adapter} into {args.model or 'the default model'} -> {args.out}")
    return 0


def _name(path: Path) -> str:
    # Adapter names must be plain; a folder name may not be, and here the name is only a label.
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in path.resolve().name) or "adapter"
