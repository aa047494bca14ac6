"""Models and KV caches allocated directly in their tensor-parallel shards (never whole on one
device), with the layouts of jaxlora.parallel.sharding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from jaxlora.config import ModelConfig
from jaxlora.model.kv_cache import KVCache, PagedKVCache, init_kv_cache, init_paged_kv_cache
from jaxlora.model.params import LoadedModel, abstract_model, build_model, draw_params
from jaxlora.parallel.sharding import KV_SPEC, check_divisible, param_spec, tensor_size


def random_sharded_model(
    config: ModelConfig, mesh: Mesh, *, dtype: jnp.dtype, seed: int = 0, std: float = 0.02
) -> LoadedModel:
    """A random model drawn directly in its shards (`param_spec`): no device ever holds it whole.

    The values do not depend on the mesh (see `draw_params`): the same seed gives the same model on
    one device and split over n, so their outputs can be compared.
    """
    tensor = tensor_size(mesh)
    check_divisible(config, tensor)
    _, expected = abstract_model(config, dtype)
    shardings = {n: NamedSharding(mesh, param_spec(n, s.shape, tensor)) for n, s in expected.items()}
    arrays = draw_params(config, dtype=dtype, seed=seed, std=std, shardings=shardings)
    return build_model(config, arrays, dtype=dtype, source="random")


def init_sharded_kv_cache(config: ModelConfig, rows: int, max_len: int, dtype: jnp.dtype, mesh: Mesh) -> KVCache:
    """A zero cache allocated directly in shards (never whole on one device)."""
    check_divisible(config, tensor_size(mesh))
    sharding = NamedSharding(mesh, KV_SPEC)
    make = jax.jit(lambda: init_kv_cache(config, rows, max_len, dtype), out_shardings=KVCache(k=sharding, v=sharding))
    return make()


def init_sharded_paged_kv_cache(
    config: ModelConfig, num_pages: int, page_size: int, dtype: jnp.dtype, mesh: Mesh
) -> PagedKVCache:
    """A zero page pool allocated directly in shards, split by KV heads like the dense cache."""
    check_divisible(config, tensor_size(mesh))
    sharding = NamedSharding(mesh, KV_SPEC)
    make = jax.jit(
        lambda: init_paged_kv_cache(config, num_pages, page_size, dtype),
        out_shardings=PagedKVCache(k=sharding, v=sharding),
    )
    return make()
