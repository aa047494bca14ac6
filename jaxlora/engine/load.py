"""An engine from a picklable description: the one place a model file, an engine config and adapter
folders become an (un-warmed) Engine.

`jaxlora generate`/`demo`/`serve` fill an `EngineSpec` from their flags; `jaxlora.ray` ships one to
each Ray actor, which loads its own engine from it. Everything in a spec is plain data (paths,
names, numbers, an EngineConfig), so it pickles and means the same on every machine that sees the
same files.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from jaxlora.engine.config import EngineConfig
from jaxlora.engine.engine import Engine
from jaxlora.errors import ModelLoadError
from jaxlora.model.params import LoadedModel
from jaxlora.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineSpec:
    """What to load; None means the `jaxlora` command's default.

    Attributes:
      model: GGUF file, Hugging Face folder or converted checkpoint; None: the embedded default model.
      config: an EngineConfig, taken as is (an adapter of a larger rank than its bank's is refused),
        or the path of an engine config YAML (a preset of configs/), or None: EngineConfig(); from a
        path or None the bank's max rank is raised to the largest rank among `adapters`.
      adapters: name -> PEFT adapter folder, registered at start-up.
      quantize: "fp8" | "int8" weight-only storage of the seven projections, or None (dense).
      max_cpu_loras: host memory for this many adapters of the bank's max rank (None: the config's
        host_capacity_bytes, else a share of the machine's memory).
    """

    model: str | None = None
    config: EngineConfig | str | Path | None = None
    adapters: Mapping[str, str] = dataclasses.field(default_factory=dict)
    quantize: str | None = None
    max_cpu_loras: int | None = None


def engine_config(spec: EngineSpec) -> EngineConfig:
    """The spec's EngineConfig (see EngineSpec.config). Raises AdapterError for an
    adapter_config.json that cannot be read, ValueError for a bad config."""
    from jaxlora.lora.peft_format import read_lora_spec

    if isinstance(spec.config, EngineConfig):
        return spec.config
    config = EngineConfig.from_yaml(spec.config) if spec.config else EngineConfig()
    max_rank = max([config.lora.max_rank, *(read_lora_spec(f).max_rank for f in spec.adapters.values())])
    if max_rank == config.lora.max_rank:
        return config
    return dataclasses.replace(config, lora=dataclasses.replace(config.lora, max_rank=max_rank))


def load_engine(spec: EngineSpec, *, clock=None, compile_ahead: bool = True) -> Engine:
    """Loads the model and returns an (un-warmed) Engine with the spec's adapters registered.

    The adapters are read and registered while the model's weights load on another thread: both
    are mostly file reads and copies that release the GIL, and neither needs the other (the pager
    needs the model's config only, read first from its config file; benchmarks/DECISIONS.md#load-on-device).
    `clock`: anything with `lap_at(name, when)` and `lap(name)`, told "load" when the model is ready
    and "register" when the adapters and the engine are (the adapters' time that ran beside the load
    is in "load"). `compile_ahead`: see `build_engine` (False for a one-shot command that never warms up).

    Raises JaxloraError / ValueError / OSError with a message fit for the command line: the model's
    error first when both the model and an adapter fail.
    """
    from jaxlora.adapters.register_many import register_many
    from jaxlora.adapters.registry import slot_nbytes
    from jaxlora.engine.build import make_pager
    from jaxlora.loading import read_model_config

    config = engine_config(spec)
    # The serving layout (q|k|v, gate|up fused: fewer, wider GEMMs) on one device; a tensor-parallel
    # split needs the separate matrices (jaxlora.model.fused).
    fused = not config.mesh.is_sharded
    model_config = read_model_config(spec.model)
    capacity = _host_capacity(spec, config, slot_nbytes(model_config, config.lora, config.jnp_dtype))
    config = dataclasses.replace(config, host_capacity_bytes=capacity)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="load-model") as pool:
        loading = pool.submit(_timed_load, spec, config, fused)
        adapter_error: BaseException | None = None
        try:
            pager, mesh = make_pager(config, model_config, config.jnp_dtype, compile_ahead=compile_ahead)
            register_many(pager, dict(spec.adapters))
        except Exception as e:  # raised after the model's own error, which says more
            adapter_error = e
        model, tokenizer, loaded_at = loading.result()
    if adapter_error is not None:
        raise adapter_error
    if model.config != model_config:
        raise ModelLoadError(f"{spec.model}: the loaded model's config differs from its config file's")
    if clock is not None:
        clock.lap_at("load", loaded_at)
    engine = Engine(model, tokenizer, config, pager, mesh=mesh)
    if clock is not None:
        clock.lap("register")
    return engine


def _timed_load(spec: EngineSpec, config: EngineConfig, fused: bool) -> tuple[LoadedModel, Tokenizer, float]:
    """(model, tokenizer, the `time.perf_counter()` at which they were ready)."""
    from jaxlora.loading import load_model

    model, tokenizer = load_model(spec.model, dtype=config.jnp_dtype, quantization=spec.quantize, fused=fused)
    return model, tokenizer, time.perf_counter()


def _host_capacity(spec: EngineSpec, config: EngineConfig, slot_bytes: int) -> int:
    """Host bytes registered adapters may take: max_cpu_loras, else the config's, else a share of
    this machine's memory (jaxlora.adapters.host_budget). Printed, since it bounds LoadAdapter."""
    from jaxlora.adapters.host_budget import HOST_SHARE, default_host_capacity_bytes, machine_memory_bytes

    if spec.max_cpu_loras is not None:
        if spec.max_cpu_loras < 1:
            raise ValueError(f"--max-cpu-loras={spec.max_cpu_loras} must be >= 1")
        capacity, origin = spec.max_cpu_loras * slot_bytes, "--max-cpu-loras"
    elif config.host_capacity_bytes is not None:
        capacity, origin = config.host_capacity_bytes, "the engine config's host_capacity_bytes"
    else:
        memory = machine_memory_bytes()
        capacity = default_host_capacity_bytes(memory)
        origin = f"{HOST_SHARE:.0%} of this machine's {memory / 2**30:.1f} GiB; --max-cpu-loras N to change"
    print(
        f"host adapter memory: {capacity / 2**30:.2f} GiB, room for {capacity // slot_bytes} adapters of "
        f"{slot_bytes / 2**20:.1f} MiB at the bank's max rank, more at lower ranks ({origin})",
        file=sys.stderr,
        flush=True,
    )
    return capacity
