"""The base model: Llama-family decoder, KV cache, RoPE."""

from jaxlora.model.kv_cache import KVCache, init_kv_cache
from jaxlora.model.llama import Llama

__all__ = ["KVCache", "Llama", "init_kv_cache"]
