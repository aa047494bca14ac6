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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """The serving engine's KV cache: one pool of fixed-size pages shared by every sequence.

    k: [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    v: [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    Which pages hold which sequence's positions is host bookkeeping (`jaxlora.engine.kv_pages`),
    sent to each step as block tables (`jaxlora.model.llama.RaggedBatch`).
    """

    k: jax.Array
    v: jax.Array

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def page_size(self) -> int:
        return self.k.shape[2]


def init_paged_kv_cache(
    config: ModelConfig, num_pages: int, page_size: int, dtype: jnp.dtype = jnp.float32
) -> PagedKVCache:
    shape = (config.num_layers, num_pages, page_size, config.num_kv_heads, config.head_dim)
    return PagedKVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def kv_bytes_per_position(config: ModelConfig, dtype: jnp.dtype) -> int:
    """Bytes of keys and values one position takes across every layer."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * jnp.dtype(dtype).itemsize
