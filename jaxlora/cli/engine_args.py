"""Flags shared by every command that runs the engine (generate, demo, serve), and their EngineConfig."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from jaxlora.cli.common import DEFAULT_MODEL_NAME, AdapterFlag, add_model_args, add_quantize_arg
from jaxlora.config import AttentionBackend, LoraBackend, LoraBank

# vLLM's name for each engine flag that means the same thing here (`jaxlora serve --help` lists both).
VLLM_ALIASES = {
    "--adapter": "--lora-modules",
    "--max-batch": "--max-num-seqs",
    "--max-seq-len": "--max-model-len",
    "--kv-memory-fraction": "--gpu-memory-utilization",
    "--tensor-parallel": "--tensor-parallel-size",
    "--quantize": "--quantization",
}


def add_engine_args(p: argparse.ArgumentParser, *, adapters_help: str = "register a PEFT adapter folder") -> None:
    add_model_args(p)
    add_quantize_arg(p, alias=VLLM_ALIASES["--quantize"])
    p.set_defaults(dtype=None)  # None: the engine config's dtype decides
    p.add_argument("--config", type=Path, default=None, help="engine config YAML (see configs/)")
    p.add_argument(
        "--adapter",
        VLLM_ALIASES["--adapter"],
        action=AdapterFlag,
        nargs="+",
        default={},
        metavar="NAME=PATH",
        help=f"{adapters_help} under NAME (repeatable)",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help=f"the base model's id, the `model` that picks no adapter (default: the --model folder or file "
        f"name, {DEFAULT_MODEL_NAME} for the embedded model)",
    )
    add_engine_size_args(p)
    p.add_argument("--max-slots", type=int, default=None, help="device adapter slots, slot 0 (base) included")
    p.add_argument(
        "--max-loras",
        type=int,
        default=None,
        metavar="N",
        help="adapters on the device at once (vLLM's name): --max-slots N+1, slot 0 being the base model",
    )
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
        "--lora-bank",
        choices=[b.value for b in LoraBank],
        default=None,
        help="the device adapter bank: every slot padded to the max rank (padded), adapters at their true rank "
        "in pages of their own pools (paged), or in the KV cache's pages, sharing its memory (unified); paged "
        "and unified run on one device only (default: the config's, padded)",
    )
    p.add_argument(
        "--attention",
        choices=[a.value for a in AttentionBackend],
        default=None,
        help="decode attention: the Pallas kernel, XLA, or auto (Pallas on GPU; the config's by default)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse the KV pages of a prompt prefix that another request on the same weights (base "
        "model or the same adapter weights) computed; never shared across adapters (default: the "
        "config's, on)",
    )
    add_tensor_parallel_arg(p)
    p.add_argument(
        "--compilation-cache",
        default=None,
        metavar="DIR|off",
        help="JAX's persistent compilation cache: a second start reads compiled programs back instead of "
        "compiling them (default: $JAXLORA_COMPILATION_CACHE, else ~/.cache/jaxlora/jax; off: no cache)",
    )


def add_engine_size_args(p: argparse.ArgumentParser) -> None:
    """The engine's static sizes, each overriding --config's (EngineConfig)."""
    p.add_argument(
        "--max-batch", VLLM_ALIASES["--max-batch"], type=int, default=None, metavar="N", help="sequences per step"
    )
    p.add_argument(
        "--max-seq-len",
        VLLM_ALIASES["--max-seq-len"],
        type=int,
        default=None,
        metavar="N",
        help="positions per sequence, prompt and answer (default: the config's)",
    )
    p.add_argument(
        "--token-budgets",
        type=_int_list,
        default=None,
        metavar="T1,T2,...",
        help="step sizes compiled, in tokens (the largest bounds a step)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        metavar="T",
        help="the largest token budget (vLLM's name): the config's smaller budgets are kept",
    )
    p.add_argument(
        "--kv-memory-fraction",
        VLLM_ALIASES["--kv-memory-fraction"],
        type=float,
        default=None,
        metavar="F",
        help="share of the device memory left after weights and adapters that the KV pool takes (GPU)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed of the sampling seeds given to requests without one: a re-run gives the same tokens "
        "(generate: the seed of --prompt and of the batch lines' own seeds, default 0; serve: default random)",
    )


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects comma-separated integers, got {text!r}") from None


def _token_budgets(config, args: argparse.Namespace) -> tuple[int, ...] | None:
    """--token-budgets, with --max-num-batched-tokens as its largest (None: neither given)."""
    budgets, largest = getattr(args, "token_budgets", None), getattr(args, "max_num_batched_tokens", None)
    if largest is None:
        return budgets
    if budgets is not None:
        if max(budgets) != largest:
            raise ValueError(f"--max-num-batched-tokens {largest} is not the largest of --token-budgets {budgets}")
        return budgets
    return (*(b for b in config.token_budgets if b < largest), largest)


def _size_overrides(config, args: argparse.Namespace) -> dict:
    sizes = {
        "max_batch": getattr(args, "max_batch", None),
        "max_seq_len": getattr(args, "max_seq_len", None),
        "token_budgets": _token_budgets(config, args),
        "kv_memory_fraction": getattr(args, "kv_memory_fraction", None),
        "seed": getattr(args, "seed", None),
    }
    return {k: v for k, v in sizes.items() if v is not None}


def add_tensor_parallel_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tensor-parallel",
        VLLM_ALIASES["--tensor-parallel"],
        type=int,
        default=None,
        metavar="N",
        help="split every layer over N devices (default: the config's mesh.tensor, 1)",
    )


def with_tensor_parallel(config, tensor_parallel: int | None):
    """`config` (an EngineConfig) with mesh.tensor set from --tensor-parallel, if given."""
    if tensor_parallel is None:
        return config
    return dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, tensor=tensor_parallel))


def engine_config(args: argparse.Namespace, adapters: dict[str, str] | None = None):
    """The EngineConfig from --config with the flag overrides applied.

    Without --max-lora-rank the bank's rank is the config's, raised to the largest rank among
    `adapters` (name -> PEFT folder, default: the --adapter flags), so that every adapter named at
    start-up fits. Raises AdapterError for an adapter_config.json that cannot be read.
    """
    from jaxlora.engine import EngineConfig

    config = EngineConfig.from_yaml(args.config) if args.config else EngineConfig()
    config = with_sizes(config, _size_overrides(config, args))
    max_rank = args.max_lora_rank
    if max_rank is None:
        from jaxlora.lora.peft_format import read_lora_spec

        folders = (args.adapter if adapters is None else adapters).values()
        max_rank = max([config.lora.max_rank, *(read_lora_spec(f).max_rank for f in folders)])
    max_slots = args.max_slots
    if getattr(args, "max_loras", None) is not None:
        if max_slots is not None and max_slots != args.max_loras + 1:
            raise ValueError(f"--max-loras {args.max_loras} and --max-slots {max_slots} disagree (slots = loras + 1)")
        max_slots = args.max_loras + 1
    lora_overrides = {
        k: v
        for k, v in (
            ("max_slots", max_slots),
            ("max_rank", max_rank),
            ("backend", args.lora_backend),
            ("bank", getattr(args, "lora_bank", None)),
        )
        if v is not None
    }
    config = dataclasses.replace(config, lora=dataclasses.replace(config.lora, **lora_overrides))
    if args.dtype is not None:
        config = dataclasses.replace(config, dtype=args.dtype)
    if getattr(args, "attention", None) is not None:
        config = dataclasses.replace(config, kernels=dataclasses.replace(config.kernels, attention=args.attention))
    if getattr(args, "prefetch_adapters", None) is not None:
        config = dataclasses.replace(config, prefetch_adapters=args.prefetch_adapters)
    if getattr(args, "enable_prefix_caching", None) is not None:
        config = dataclasses.replace(config, enable_prefix_caching=args.enable_prefix_caching)
    return with_tensor_parallel(config, getattr(args, "tensor_parallel", None))


def with_sizes(config, sizes: dict):
    """`config` with the size flags applied; a max_new_tokens_limit the new max_seq_len leaves no room
    for is brought down to fit (one position less), since the flag asked for that context."""
    limit, seq = config.max_new_tokens_limit, sizes.get("max_seq_len")
    if seq is not None and limit is not None and limit >= seq:
        sizes = {**sizes, "max_new_tokens_limit": max(1, seq - 1)}
    return dataclasses.replace(config, **sizes) if sizes else config


def base_model_name(args: argparse.Namespace) -> str:
    """The base model's served id: --served-model-name, else the --model folder's (or file's) name."""
    if getattr(args, "served_model_name", None):
        return args.served_model_name
    if not args.model:
        return DEFAULT_MODEL_NAME
    path = Path(args.model)
    return path.stem if path.suffix == ".gguf" else path.name


def engine_spec(args: argparse.Namespace, extra_adapters: dict[str, str] | None = None):
    """The flags as a jaxlora.engine.load.EngineSpec: the EngineConfig they make (`engine_config`),
    the --adapter folders plus `extra_adapters`."""
    from jaxlora.engine.load import EngineSpec

    adapters = {**(extra_adapters or {}), **args.adapter}
    return EngineSpec(
        model=args.model,
        config=engine_config(args, adapters),
        adapters=adapters,
        quantize=args.quantize,
        max_cpu_loras=args.max_cpu_loras,
    )


def engine_from_args(
    args: argparse.Namespace,
    extra_adapters: dict[str, str] | None = None,
    clock=None,
    *,
    compile_ahead: bool = True,
):
    """Loads the model and returns an (un-warmed) Engine with the --adapter folders (and
    `extra_adapters`) registered: the flags become an EngineSpec here, jaxlora.engine.load does the
    rest. `clock` (a `jaxlora.cli.startup.StartupClock`) gets the "load" and "register" laps;
    `compile_ahead` is `build_engine`'s.

    Raises JaxloraError / ValueError / OSError with a message fit for the command line.
    """
    from jaxlora.engine.load import load_engine

    return load_engine(engine_spec(args, extra_adapters), clock=clock, compile_ahead=compile_ahead)
