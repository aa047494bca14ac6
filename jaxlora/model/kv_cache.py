"""The KV cache: fixed rows, one per batch slot, passed into the step and returned updated."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxlora.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values of every layer.

    k: [num_layers, rows, max_len, num_kv_heads, head_dim]
    v: [num_layers, rows, max_len, num_kv_heads, head_dim]
    Position p of a row holds the key/value of that row's token at position p; entries past a row's
    current length are stale and masked out by position.
    """

    k: jax.Array
    v: jax.Array

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


def init_kv_cache(config: ModelConfig, rows: int, max_len: int, dtype: jnp.dtype = jnp.float32) -> KVCache:
    shape = (config.num_layers, rows, max_len, config.num_kv_heads, config.head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))
