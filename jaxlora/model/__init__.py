"""The base model: Llama-family decoder, KV caches (dense rows, and the paged pool the engine serves from), RoPE."""

from jaxlora.model.kv_cache import KVCache, PagedKVCache, init_kv_cache, init_paged_kv_cache
from jaxlora.model.llama import Llama, RaggedBatch

__all__ = ["KVCache", "Llama", "PagedKVCache", "RaggedBatch", "init_kv_cache", "init_paged_kv_cache"]
