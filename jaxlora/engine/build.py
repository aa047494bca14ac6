"""The one place an engine is put together from a config, a loaded model and adapter folders.

    model, tokenizer = jaxlora.loading.load_model(path)
    engine = build_engine(EngineConfig(), model, tokenizer, {"shout": "checkpoints/demo/shout"})
    engine.warmup()

With `config.mesh.tensor > 1` the mesh is made here, once, before anything is allocated, and handed
to both the pager (which splits its bank over it) and the engine's runner (params and page pool).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxlora.adapters import PagedPager, Pager, UnifiedPager
from jaxlora.adapters.register_many import register_many
from jaxlora.config import LoraBank, ModelConfig
from jaxlora.engine.config import EngineConfig
from jaxlora.engine.engine import Engine
from jaxlora.lora.host_adapter import HostAdapter
from jaxlora.model.params import LoadedModel
from jaxlora.parallel import MeshConfig, make_mesh
from jaxlora.parallel.sharding import check_divisible
from jaxlora.tokenizer import Tokenizer


def build_engine(
    config: EngineConfig,
    model: LoadedModel,
    tokenizer: Tokenizer,
    adapters: Mapping[str, str | Path | HostAdapter] | None = None,
    *,
    compile_ahead: bool = True,
) -> Engine:
    """An (un-warmed) engine over `model` whose pager holds `adapters` (name -> PEFT folder or
    HostAdapter), with `config.host_capacity_bytes` of host memory for them. Its steps run the
    kernels `config.kernels` resolves to for this model and platform (`EngineConfig.step_kernels`),
    resolved once as the engine is made.

    `compile_ahead` False leaves the pager's slot writes to compile on first use, as the steps do
    when `Engine.warmup` is not called: for a one-shot command, which runs few of the programs a
    server must have ready (with the persistent compilation cache, a first use is a cache read).

    Raises ValueError when the model cannot be split over `config.mesh` or there are too few
    devices, AdapterError for an adapter that cannot be registered.
    """
    pager, mesh = make_pager(config, model.config, model.dtype, compile_ahead=compile_ahead)
    register_many(pager, adapters or {})
    return Engine(model, tokenizer, config, pager, mesh=mesh)


def make_pager(
    config: EngineConfig, model_config: ModelConfig, dtype: jnp.dtype, *, compile_ahead: bool = True
) -> tuple[Pager | PagedPager | UnifiedPager, jax.sharding.Mesh | None]:
    """The engine's (empty) pager for a model of `model_config` in `dtype`, and the mesh it and the
    engine share: the model's weights are not needed, so a caller can register adapters while they
    load (`jaxlora.engine.load`). `compile_ahead` and the errors are `build_engine`'s."""
    mesh = engine_mesh(config.mesh, model_config)
    if config.lora.bank is not LoraBank.PADDED and mesh is not None:
        raise ValueError(f"lora.bank={config.lora.bank.value!r} runs on one device; use lora.bank='padded' with a mesh")
    if config.lora.bank is LoraBank.UNIFIED:
        # Its pages are the KV pool's: the engine attaches it to its runner; writes compile at warm-up.
        pager = UnifiedPager(
            model_config,
            config.lora,
            page_size=config.page_size,
            host_capacity_bytes=config.host_capacity_bytes,
            dtype=dtype,
        )
        return pager, None
    if config.lora.bank is LoraBank.PAGED:
        # PagedPager takes no compile_writes: its page writes compile at warm-up either way.
        return PagedPager(model_config, config.lora, host_capacity_bytes=config.host_capacity_bytes, dtype=dtype), None
    pager = Pager(
        model_config,
        config.lora,
        host_capacity_bytes=config.host_capacity_bytes,
        dtype=dtype,
        mesh=mesh,
        compile_writes=compile_ahead,
    )
    return pager, mesh


def engine_mesh(mesh_config: MeshConfig, model_config: ModelConfig) -> jax.sharding.Mesh | None:
    """The tensor-parallel mesh `mesh_config` asks for (None: one device), checked against the model
    first so that a bad split fails before anything is allocated."""
    if not mesh_config.is_sharded:
        return None
    check_divisible(model_config, mesh_config.tensor)
    return make_mesh(mesh_config)
