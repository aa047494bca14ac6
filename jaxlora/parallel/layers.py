"""The tensor-parallel collectives of a Llama step, as one device sees them inside `shard_map`.

Every function takes `axis`, the mesh axis the weights are split over (None: one device, where each
is the plain op). Which way an embedding table or LM head is split is read off its local shape
(jaxlora.parallel.sharding decides it): fewer rows than the vocabulary means vocab-parallel, else
fewer columns than the hidden size means hidden-parallel.

Per step the model then issues: one all-reduce for the embedding (vocab-parallel) or one
all-gather (hidden-parallel); two all-reduces per layer (after o_proj and after down_proj, the
LoRA terms of both already added to the partial sums); one all-gather of the logits (vocab-parallel
head) or one all-reduce (hidden-parallel head).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def all_reduce(x: jax.Array, axis: str | None) -> jax.Array:
    """Sums the partial outputs of a row-parallel layer (o_proj, down_proj)."""
    return x if axis is None else jax.lax.psum(x, axis)


def _shard_start(axis: str, size: int) -> jax.Array:
    return jax.lax.axis_index(axis) * size


def embed(table: jax.Array, tokens: jax.Array, *, vocab_size: int, axis: str) -> jax.Array:
    """tokens [...] int32 -> [..., D] with this device's slice of the table ([V/n, D] or [V, D/n])."""
    rows = table.shape[0]
    if rows < vocab_size:  # vocab-parallel: rows of other shards read as zeros, the sum fills them in
        local = tokens - _shard_start(axis, rows)
        inside = (local >= 0) & (local < rows)
        x = jnp.take(table, jnp.where(inside, local, 0), axis=0)
        return jax.lax.psum(jnp.where(inside[..., None], x, jnp.zeros((), x.dtype)), axis)
    x = jnp.take(table, tokens, axis=0)  # hidden-parallel: [..., D/n]
    return jax.lax.all_gather(x, axis, axis=x.ndim - 1, tiled=True)


def project_logits(hidden: jax.Array, weight: jax.Array, *, vocab_size: int, transposed: bool, axis: str) -> jax.Array:
    """hidden [..., D] (the same on every device) -> logits [..., V] on every device.

    weight: this device's slice of the LM head [D, V] (transposed=False) or of the tied embedding
    table [V, D] (transposed=True).
    """
    w = weight.T if transposed else weight  # [D or D/n, V or V/n]
    dtype = jnp.result_type(hidden, w)
    hidden, w = hidden.astype(dtype), w.astype(dtype)
    if w.shape[1] < vocab_size:  # vocab-parallel: each device owns a slice of the vocabulary
        return jax.lax.all_gather(hidden @ w, axis, axis=hidden.ndim - 1, tiled=True)
    d_local = w.shape[0]  # hidden-parallel: partial dot products over this device's hidden slice
    h = jax.lax.dynamic_slice_in_dim(hidden, _shard_start(axis, d_local), d_local, axis=hidden.ndim - 1)
    return jax.lax.psum(h @ w, axis)
