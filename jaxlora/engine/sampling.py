"""Per-row sampling on device: the step's argmax (`greedy`), and the sampler program the engine runs
after a step with a row that samples (`sample`, through `jaxlora.engine.runner.packed_sample`).

Each row carries its own temperature, top-k, top-p and PRNG stream. The key of a row's n-th generated
token is `fold_in(key(seed), n)`: it depends on the request alone, never on the batch, so a seeded
request gives the same tokens whatever it shares a step with.
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
    """

    temperature: jax.Array | np.ndarray
    top_k: jax.Array | np.ndarray
    top_p: jax.Array | np.ndarray
    seed: jax.Array | np.ndarray
    counter: jax.Array | np.ndarray

    @classmethod
    def zeros(cls, rows: int) -> SamplingArrays:
        """Greedy rows (what padding rows get)."""
        return cls(
            temperature=np.zeros(rows, np.float32),
            top_k=np.zeros(rows, np.int32),
            top_p=np.ones(rows, np.float32),
            seed=np.zeros(rows, np.uint32),
            counter=np.zeros(rows, np.int32),
        )


def greedy(logits: jax.Array) -> jax.Array:
    """logits [b, vocab] float32 -> each row's most likely token [b] int32, or -1 where the row's
    logits are not finite (an adapter that blows up: the engine fails that request alone)."""
    finite = jnp.all(jnp.isfinite(logits), axis=-1)
    return jnp.where(finite, jnp.argmax(logits, axis=-1).astype(jnp.int32), -1)


def sample(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    """logits [b, vocab] float32 -> next token ids [b] int32: rows with temperature 0 greedy, the
    others drawn after top-k and top-p filtering.

    Every row pays the vocabulary sort, so the engine runs this only for steps with a sampled row
    (`jaxlora.engine.runner.packed_sample`); a greedy step stops at `greedy`.
    """
    return jnp.where(s.temperature == 0, greedy(logits), _sample_filtered(logits, s))


def _sample_filtered(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    vocab = logits.shape[-1]
    temperature = jnp.where(s.temperature > 0, s.temperature, 1.0)
    scaled = logits / temperature[:, None]
    sorted_desc = -jnp.sort(-scaled, axis=-1)  # [b, vocab]
    # top-k: keep logits >= the k-th largest (k = 0 keeps everything).
    k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)  # [b, 1]
    sorted_desc = jnp.where(sorted_desc >= kth, sorted_desc, -jnp.inf)
    # top-p: the smallest prefix of the sorted distribution whose mass reaches top_p (the most
    # likely token always stays).
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (mass_before < s.top_p[:, None]) & jnp.isfinite(sorted_desc)
    num_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)
    threshold = jnp.take_along_axis(sorted_desc, (num_keep - 1)[:, None], axis=-1)
    filtered = jnp.where(scaled >= threshold, scaled, -jnp.inf)
    keys = jax.vmap(lambda seed, n: jax.random.fold_in(jax.random.key(seed), n))(s.seed, s.counter)
    return jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)
