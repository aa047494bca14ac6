"""Keys of full KV pages for the prefix cache (`jaxlora.engine.kv_pages`): vLLM's block hash.

A page's keys and values depend on every token before it, on its own tokens, and on the weights that
computed them: the base model's and the request's adapter's (LoRA on q/k/v changes them). So a key
chains: key(page i) = SHA-256(key(page i - 1) + the page's token ids), with key(page -1) = the
identity of the weights, a digest of the adapter's weights made when it was registered
(`jaxlora.adapters.registry.adapter_identity`), or `BASE_IDENTITY`. An adapter's name is never part of it: the same name
reloaded with other weights shares nothing, and two names with the same weights share everything.

SHA-256, not Python's `hash`: a key collision would hand one request another's cache, and the
built-in hash of ints is easy to collide on purpose.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

BASE_IDENTITY = hashlib.sha256(b"jaxlora: the base model, no adapter").digest()


def extend_keys(keys: list[bytes], root: bytes, tokens: Sequence[int], page_size: int) -> None:
    """Appends to `keys` (the keys of a sequence's first len(keys) pages, its weights' identity
    `root`) the keys of the pages that follow, whose token ids are `tokens` (whole pages). Each page
    is hashed once: callers keep `keys` and extend it as pages fill."""
    if len(tokens) % page_size:
        raise ValueError(f"{len(tokens)} tokens are not whole pages of {page_size}")
    data = np.asarray(tokens, np.int64).tobytes()
    width = 8 * page_size
    parent = keys[-1] if keys else root
    for i in range(len(tokens) // page_size):
        parent = hashlib.sha256(parent + data[i * width : (i + 1) * width]).digest()
        keys.append(parent)
