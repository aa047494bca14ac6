"""Random ragged batches over a paged KV cache, poisoned wherever attention must not read.

Pages are handed out in shuffled order; pages no sequence references, and offsets past kv_len in a
sequence's last page, hold NaN; block-table entries past a sequence's pages are garbage ints (out of
range too); padding query rows are NaN; page 0 is always one of the NaN pages. A kernel that reads any of them shows NaN in its result.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from tests.kernels.kernel_data import random_array


@dataclasses.dataclass(frozen=True, kw_only=True)
class RaggedBatch:
    q: jax.Array  # [T, H, Dh]; NaN in padding rows
    k_pages: jax.Array  # [L, P, page_size, KVH, Dh]
    v_pages: jax.Array  # [L, P, page_size, KVH, Dh]
    q_start: jax.Array  # [S] int32
    q_len: jax.Array  # [S] int32
    kv_len: jax.Array  # [S] int32
    block_tables: jax.Array  # [S, pages_per_seq] int32
    is_token: np.ndarray  # [T] bool, False at padding rows

    def args(self, layer: int | jax.Array) -> tuple:
        """Positional arguments of ragged_paged_attention (and its reference) for `layer`."""
        return (
            self.q,
            self.k_pages,
            self.v_pages,
            jnp.asarray(layer, jnp.int32),
            self.q_start,
            self.q_len,
            self.kv_len,
            self.block_tables,
        )


def ragged_batch(
    rng: np.random.Generator,
    *,
    seqs: list[tuple[int, int]],
    num_tokens: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    pages_per_seq: int,
    layers: int = 2,
    dtype=jnp.float32,
    gap: int = 0,
    spare_pages: int = 3,
) -> RaggedBatch:
    """seqs: (q_len, kv_len) per sequence. Sequences with tokens are packed in a shuffled order, `gap`
    padding rows apart, from flat index 0; rows after the last one are padding."""
    q_len = np.array([n for n, _ in seqs], np.int32)
    kv_len = np.array([c for _, c in seqs], np.int32)
    if (q_len > kv_len).any() or (kv_len > pages_per_seq * page_size).any() or spare_pages < 1:
        raise ValueError(f"bad test batch {seqs} for {pages_per_seq=} x {page_size=}")
    num_used = -(-kv_len // page_size)  # [S] pages each sequence references
    num_pages = int(num_used.sum()) + spare_pages
    # Page 0 is never handed out: a masked-off read lands on page 0 (a masked load's `other`), so a
    # load that forgot its mask reads NaN there.
    page_ids = 1 + rng.permutation(num_pages - 1)
    tables = rng.integers(-2 * num_pages, 3 * num_pages, (len(seqs), pages_per_seq)).astype(np.int32)
    k = np.full((layers, num_pages, page_size, kv_heads, head_dim), np.nan, np.float32)
    v = k.copy()
    taken = 0
    for s, (used, length) in enumerate(zip(num_used, kv_len)):
        tables[s, :used] = page_ids[taken : taken + used]
        taken += used
        for j, page in enumerate(tables[s, :used]):
            valid = min(page_size, length - j * page_size)  # offsets past kv_len stay NaN
            for pages in (k, v):
                pages[:, page, :valid] = random_array(rng, (layers, valid, kv_heads, head_dim), jnp.float32)
    q_start = rng.integers(0, num_tokens + 8, len(seqs)).astype(np.int32)  # arbitrary where q_len is 0
    row = 0
    for s in rng.permutation(len(seqs)):
        if q_len[s]:
            q_start[s] = row
            row += q_len[s] + gap
    if row - gap > num_tokens:
        raise ValueError(f"{seqs} with {gap=} needs more than {num_tokens=} rows")
    is_token = np.zeros(num_tokens, bool)
    for start, n in zip(q_start, q_len):
        is_token[start : start + n] = True
    q = np.where(
        is_token[:, None, None], np.asarray(random_array(rng, (num_tokens, heads, head_dim), jnp.float32)), np.nan
    )
    i32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
    return RaggedBatch(
        q=jnp.asarray(q, dtype),
        k_pages=jnp.asarray(k, dtype),
        v_pages=jnp.asarray(v, dtype),
        q_start=i32(q_start),
        q_len=i32(q_len),
        kv_len=i32(kv_len),
        block_tables=i32(tables),
        is_token=is_token,
    )
