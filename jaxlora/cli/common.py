"""Arguments shared by several subcommands."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # the embedded default model's id


def warmup_progress(what: str, k: int, n: int) -> None:
    """Engine.warmup's progress callback for the commands: one stderr line per compiled shape."""
    print(f"  compiled {what} ({k}/{n})", file=sys.stderr, flush=True)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="GGUF file, Hugging Face folder or converted checkpoint (default: the embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="parameter/activation dtype")


def add_quantize_arg(p: argparse.ArgumentParser, *, alias: str | None = None) -> None:
    p.add_argument(
        "--quantize",
        *([alias] if alias else []),
        choices=("fp8", "int8"),
        default=None,
        help="store the seven projections weight-only quantized, one scale per output channel "
        "(default: dense; a checkpoint converted with --quantize loads quantized)",
    )


class AdapterFlag(argparse.Action):
    """`--adapter NAME=PATH` (repeatable) into {name: path}. A malformed flag, an invalid or repeated
    name, or a path that is no adapter folder is a usage error at parse time, before any model loads.
    With nargs="+" one flag takes several (vLLM's `--lora-modules a=PATH b=PATH`)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        for value in values if isinstance(values, list) else [values]:
            self._add(namespace, value)

    def _add(self, namespace, value: str) -> None:
        from jaxlora.errors import AdapterError
        from jaxlora.lora.validate import check_adapter_name

        adapters = dict(getattr(namespace, self.dest) or {})  # never mutate the shared default
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise argparse.ArgumentError(self, f"expects NAME=PATH, got {value!r}")
        try:
            check_adapter_name(name)
        except AdapterError as e:
            raise argparse.ArgumentError(self, str(e)) from None
        if name in adapters:
            raise argparse.ArgumentError(self, f"{name!r} is given twice ({adapters[name]} and {path})")
        if not (Path(path) / "adapter_config.json").is_file():
            raise argparse.ArgumentError(
                self, f"{name}={path}: no adapter_config.json there (not a PEFT adapter folder)"
            )
        adapters[name] = path
        setattr(namespace, self.dest, adapters)
