"""Per-row sampling on device: the step's argmax (`greedy`), and the sampler program the engine runs
after a step with a row that samples (`sample`, through `jaxlora.engine.runner.packed_sample`).

Each row carries its own temperature, top-k, top-p, min-p, min_tokens and PRNG stream. The key of a
row's n-th generated token is `fold_in(key(seed), n)`: it depends on the request alone, never on the
batch, so a seeded request gives the same tokens whatever it shares a step with.

The order is vLLM's: EOS banned for rows below their min_tokens, then the temperature, then top-k,
top-p and min-p, each filter on the distribution the temperature gives, the most likely token always
kept.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    """Sampling parameters of every row of a step (host numpy in, device arrays inside jit).

    temperature: [b] float32, 0 = greedy.
    top_k: [b] int32, 0 = off.
    top_p: [b] float32 in (0, 1], 1 = off.
    seed: [b] uint32 per-request seed.
    counter: [b] int32 index of the token being sampled within its request (0 = first).
    min_p: [b] float32 in [0, 1], 0 = off: tokens less likely than min_p times the most likely drop.
    min_tokens: [b] int32: EOS is banned while counter < min_tokens.
    """

    temperature: jax.Array | np.ndarray
    top_k: jax.Array | np.ndarray
    top_p: jax.Array | np.ndarray
    seed: jax.Array | np.ndarray
    counter: jax.Array | np.ndarray
    min_p: jax.Array | np.ndarray
    min_tokens: jax.Array | np.ndarray

    @classmethod
    def zeros(cls, rows: int) -> SamplingArrays:
        """Greedy rows (what padding rows get)."""
        return cls(
            temperature=np.zeros(rows, np.float32),
            top_k=np.zeros(rows, np.int32),
            top_p=np.ones(rows, np.float32),
            seed=np.zeros(rows, np.uint32),
            counter=np.zeros(rows, np.int32),
            min_p=np.zeros(rows, np.float32),
            min_tokens=np.zeros(rows, np.int32),
        )


def greedy(logits: jax.Array) -> jax.Array:
    """logits [b, vocab] float32 -> each row's most likely token [b] int32, or -1 where the row's
    logits are not finite (an adapter that blows up: the engine fails that request alone)."""
    finite = jnp.all(jnp.isfinite(logits), axis=-1)
    return jnp.where(finite, jnp.argmax(logits, axis=-1).astype(jnp.int32), -1)


def sample(logits: jax.Array, s: SamplingArrays, *, eos_ids: tuple[int, ...] = ()) -> jax.Array:
    """logits [b, vocab] float32 -> next token ids [b] int32: rows with temperature 0 greedy, the
    others drawn from `filtered_logits`; EOS (`eos_ids`) banned below a row's min_tokens either way.

    Every row pays the vocabulary sort, so the engine runs this only for steps with a row that needs
    it (`SamplingArrays.needs_sampler`, `jaxlora.engine.runner.packed_sample`); a greedy step stops
    at `greedy`.
    """
    banned = ban_eos(logits, s, eos_ids)
    keys = jax.vmap(lambda seed, n: jax.random.fold_in(jax.random.key(seed), n))(s.seed, s.counter)
    drawn = jax.vmap(jax.random.categorical)(keys, filtered_logits(banned, s)).astype(jnp.int32)
    return jnp.where(s.temperature == 0, jnp.argmax(banned, axis=-1).astype(jnp.int32), drawn)


def ban_eos(logits: jax.Array, s: SamplingArrays, eos_ids: tuple[int, ...]) -> jax.Array:
    """logits [b, vocab] with the `eos_ids` columns at -inf in rows below their min_tokens."""
    if not eos_ids:
        return logits
    is_eos = jnp.zeros(logits.shape[-1], bool).at[jnp.asarray(eos_ids)].set(True)
    return jnp.where((s.counter < s.min_tokens)[:, None] & is_eos[None, :], -jnp.inf, logits)


def filtered_logits(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    """logits [b, vocab] -> the temperature-scaled logits [b, vocab] a sampled row draws from, -inf
    where top-k, top-p or min-p drop a token."""
    vocab = logits.shape[-1]
    temperature = jnp.where(s.temperature > 0, s.temperature, 1.0)
    scaled = logits / temperature[:, None]
    sorted_desc = -jnp.sort(-scaled, axis=-1)  # [b, vocab]
    # top-k: keep logits >= the k-th largest (k = 0 keeps everything).
    k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)  # [b, 1]
    # top-p: the smallest prefix of the sorted distribution (after top-k) whose mass reaches top_p
    # (the most likely token always stays).
    top_k_kept = jnp.where(sorted_desc >= kth, sorted_desc, -jnp.inf)
    probs = jax.nn.softmax(top_k_kept, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # top_p 1 keeps every token: float rounding can bring the mass before the last ones to 1.
    keep = ((mass_before < s.top_p[:, None]) | (s.top_p[:, None] >= 1)) & jnp.isfinite(top_k_kept)
    num_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)
    threshold = jnp.take_along_axis(top_k_kept, (num_keep - 1)[:, None], axis=-1)
    # min-p: relative to the most likely token, on the distribution the temperature gives.
    min_p_floor = jnp.where(s.min_p > 0, sorted_desc[:, 0] + jnp.log(jnp.maximum(s.min_p, 1e-30)), -jnp.inf)[:, None]
    return jnp.where((scaled >= threshold) & (scaled >= min_p_floor), scaled, -jnp.inf)
