"""Ragged paged attention in plain JAX: the reference the kernel must equal, and the XLA attention path.

Same contract as `ragged.ragged_paged_attention` (see its docstring), computed the direct
way and sharing no index math with the kernel: every token finds its sequence by comparing its flat
index with the sequences' ranges, gathers that sequence's pages into a dense [ctx, KVH, Dh] context
(ctx = pages_per_seq * page_size), masks positions past its own and takes a float32 softmax.

Memory is T x ctx x KVH x Dh per gathered tensor; tokens are processed in chunks that keep it near
`_CHUNK_BYTES`, so a long context does not blow up the working set.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_F32 = jnp.float32
_HIGHEST = lax.Precision.HIGHEST
_CHUNK_BYTES = 256 * 2**20  # one gathered K (or V) chunk, in the page dtype


def _token_layout(num_tokens: int, q_start: jax.Array, q_len: jax.Array, kv_len: jax.Array):
    """Per flat token: (its sequence [T], its absolute position [T], whether a sequence covers it [T])."""
    t = jnp.arange(num_tokens)[:, None]  # [T, 1]
    covers = (t >= q_start[None, :]) & (t < q_start[None, :] + q_len[None, :])  # [T, S]
    seq = jnp.argmax(covers, axis=1)  # [T]
    is_token = jnp.any(covers, axis=1)
    position = kv_len[seq] - q_len[seq] + (jnp.arange(num_tokens) - q_start[seq])
    return seq, position, is_token


def _attend(q, context_k, context_v, position, is_token):
    """One token: q [H, Dh], its sequence's context_k / context_v [ctx, KVH, Dh], its position and
    whether a sequence covers it (scalars) -> [H, Dh] float32."""
    num_heads, head_dim = q.shape
    num_kv = context_k.shape[1]
    visible = (jnp.arange(context_k.shape[0]) <= position) & is_token  # [ctx]
    # Positions a token may not see can hold NaN: zero the values too, not just the weights.
    v = jnp.where(visible[:, None, None], context_v, 0).astype(_F32)
    qg = q.reshape(num_kv, num_heads // num_kv, head_dim).astype(_F32)  # [KVH, G, Dh]
    scores = jnp.einsum("kgd,xkd->kgx", qg, context_k.astype(_F32), precision=_HIGHEST) * head_dim**-0.5
    # A padding token sees nothing: an all -inf row would give NaN, so its scores are all 0 instead.
    scores = jnp.where(visible, scores, jnp.where(is_token, -jnp.inf, 0.0))
    weights = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("kgx,xkd->kgd", weights, v, precision=_HIGHEST).reshape(num_heads, head_dim)
    return jnp.where(is_token, out, 0.0)


@jax.jit
def ragged_paged_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    layer: jax.Array,
    q_start: jax.Array,
    q_len: jax.Array,
    kv_len: jax.Array,
    block_tables: jax.Array,
) -> jax.Array:
    """q [T, H, Dh], k_pages / v_pages [L, P, page_size, KVH, Dh], layer int32 scalar, q_start / q_len /
    kv_len [S] int32, block_tables [S, pages_per_seq] int32 -> [T, H, Dh] in q.dtype, zeros at padding."""
    num_tokens = q.shape[0]
    _, _, page_size, num_kv, head_dim = k_pages.shape
    pages_per_seq = block_tables.shape[1]
    ctx = pages_per_seq * page_size
    seq, position, is_token = _token_layout(num_tokens, q_start, q_len, kv_len)

    def token(args):
        q_t, seq_t, position_t, is_token_t = args
        table = block_tables[seq_t]  # [pages_per_seq]; entries past kv_len may be garbage: clipped, then masked
        context = lambda pages: pages.at[layer, table].get(mode="clip").reshape(ctx, num_kv, head_dim)  # noqa: E731
        return _attend(q_t, context(k_pages), context(v_pages), position_t, is_token_t)

    # lax.map vmaps `token` over chunks of tokens and loops over the chunks.
    chunk_tokens = max(1, _CHUNK_BYTES // (ctx * num_kv * head_dim * k_pages.dtype.itemsize))
    out = lax.map(token, (q, seq, position, is_token), batch_size=min(num_tokens, chunk_tokens))
    return out.astype(q.dtype)
