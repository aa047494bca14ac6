"""Flags shared by every command that runs the engine (generate, demo, serve), and their EngineConfig."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from jaxlora.cli.common import AdapterFlag, add_model_args, add_quantize_arg
from jaxlora.config import AttentionBackend, LoraBackend

if TYPE_CHECKING:
    from jaxlora.engine.load import EngineSpec


def add_engine_args(p: argparse.ArgumentParser, *, adapters_help: str = "register a PEFT adapter folder") -> None:
    add_model_args(p)
    add_quantize_arg(p)
    p.set_defaults(dtype=None)  # None: the engine config's dtype decides
    p.add_argument("--config", type=Path, default=None, help="engine config YAML (see configs/)")
    p.add_argument(
        "--adapter",
        action=AdapterFlag,
        default={},
        metavar="NAME=PATH",
        help=f"{adapters_help} under NAME (repeatable)",
    )
    p.add_argument("--max-slots", type=int, default=None, help="device adapter slots, slot 0 (base) included")
    p.add_argument(
        "--max-lora-rank",
        type=int,
        default=None,
        help="largest adapter rank the bank holds (default: the config's, or the largest rank of "
        "the --adapter folders if that is larger)",
    )
    p.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="host memory for N adapters of the bank's max rank (each host copy is kept at its rank "
        "class: more adapters of lower rank fit)",
    )
    p.add_argument(
        "--prefetch-adapters",
        type=int,
        default=None,
        metavar="N",
        help="page in the adapters of up to N waiting requests ahead of admission, 0 = off (default: the config's, 16)",
    )
    p.add_argument(
        "--lora-backend",
        choices=[b.value for b in LoraBackend],
        default=None,
        help="how the per-row LoRA term is computed (default: the config's)",
    )
    p.add_argument(
        "--attention",
        choices=[a.value for a in AttentionBackend],
        default=None,
        help="decode attention: the Pallas kernel, XLA, or auto (Pallas on GPU; the config's by default)",
    )
    add_tensor_parallel_arg(p)


def add_tensor_parallel_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tensor-parallel",
        type=int,
        default=None,
        metavar="N",
        help="split every layer over N devices (default: the config's mesh.tensor, 1)",
    )


def engine_spec(args: argparse.Namespace, extra_adapters: dict[str, str] | None = None) -> EngineSpec:
    """The flags as an EngineSpec (jaxlora.engine.load): the --adapter folders plus `extra_adapters`."""
    from jaxlora.engine.load import EngineSpec

    return EngineSpec(
        model=args.model,
        config=args.config,
        adapters={**(extra_adapters or {}), **args.adapter},
        quantize=args.quantize,
        dtype=args.dtype,
        max_slots=args.max_slots,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=getattr(args, "max_cpu_loras", None),
        prefetch_adapters=getattr(args, "prefetch_adapters", None),
        lora_backend=args.lora_backend,
        attention=getattr(args, "attention", None),
        tensor_parallel=getattr(args, "tensor_parallel", None),
    )


def engine_config(args: argparse.Namespace, adapters: dict[str, str] | None = None):
    """The EngineConfig from --config with the flag overrides applied.

    Without --max-lora-rank the bank's rank is the config's, raised to the largest rank among
    `adapters` (name -> PEFT folder, default: the --adapter flags), so that every adapter named at
    start-up fits. Raises AdapterError for an adapter_config.json that cannot be read.
    """
    from jaxlora.engine.load import engine_config as spec_config

    spec = engine_spec(args)
    if adapters is not None:
        spec = dataclasses.replace(spec, adapters=adapters)
    return spec_config(spec)


def engine_from_args(args: argparse.Namespace, extra_adapters: dict[str, str] | None = None):
    """Loads the model and returns an (un-warmed) Engine with the --adapter folders (and
    `extra_adapters`) registered (jaxlora.engine.load does the work).

    Raises JaxloraError / ValueError / OSError with a message fit for the command line.
    """
    from jaxlora.engine.load import load_engine

    return load_engine(engine_spec(args, extra_adapters))
