"""Arguments shared by several subcommands."""

from __future__ import annotations

import argparse

import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="GGUF file, Hugging Face folder or converted checkpoint (default: the embedded "
                        "SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="parameter/activation dtype")


def add_quantize_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantize", choices=("fp8", "int8"), default=None,
                   help="store the seven projections weight-only quantized, one scale per output channel "
                        "(default: dense; a checkpoint converted with --quantize loads quantized)")


def parse_adapter_flags(values: list[str] | None) -> dict[str, str]:
    """`NAME=PATH` flags -> {name: path}; a malformed or repeated flag is an argparse error."""
    out: dict[str, str] = {}
    for v in values or []:
        name, sep, path = v.partition("=")
        if not sep or not name or not path:
            raise argparse.ArgumentTypeError(f"--adapter expects NAME=PATH, got {v!r}")
        if name in out:
            raise argparse.ArgumentTypeError(f"--adapter {name!r} given twice")
        out[name] = path
    return out
