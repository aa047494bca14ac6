"""Per-row sampling on device: the step's argmax (`greedy`), and the sampler program the engine runs
after a step with a row that samples (`sample`, through `jaxlora.engine.runner.packed_sample`).

Each row carries its own temperature, top-k, top-p, min-p, min_tokens and PRNG stream. The key of a
row's n-th generated token is `fold_in(key(seed), n)`: it depends on the request alone, never on the
batch, so a seeded request gives the same tokens whatever it shares a step with.

The order is vLLM's: EOS banned for rows below their min_tokens, then the penalties
(`apply_penalties`), then the temperature, then top-k, top-p and min-p, each filter on the
distribution the temperature gives, the most likely token always kept. A greedy row with a penalty
takes the argmax of the penalised logits. Logprobs (`top_logprobs`) are those of the raw
distribution, before any of this (vLLM's default `raw_logprobs`).

The penalties read each row's token history (`TokenHistory`), kept on the device in a fixed shape:
which tokens a row has seen (prompt or output) and how often each was generated, one [rows, vocab]
array each, updated from the tokens every sampler step feeds (`update_history`). A row's output
token n-1 is the input of the step that samples token n, so the history a step reads after its own
update holds exactly the prompt and the outputs before the token it samples. Fixed shape: the
program never changes with the lengths or the values, at the cost of rows x vocab words of device
memory.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxlora.engine.request import TOP_LOGPROBS


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
    repetition_penalty: [b] float32 > 0, 1 = off (vLLM): logits of seen tokens (prompt or output),
      positive ones divided by it, negative ones multiplied.
    presence_penalty: [b] float32 in [-2, 2], 0 = off (OpenAI): subtracted once from the logit of
      every token generated so far.
    frequency_penalty: [b] float32 in [-2, 2], 0 = off (OpenAI): subtracted from each logit times
      the number of times its token was generated so far.
    """

    temperature: jax.Array | np.ndarray
    top_k: jax.Array | np.ndarray
    top_p: jax.Array | np.ndarray
    seed: jax.Array | np.ndarray
    counter: jax.Array | np.ndarray
    min_p: jax.Array | np.ndarray
    min_tokens: jax.Array | np.ndarray
    repetition_penalty: jax.Array | np.ndarray
    presence_penalty: jax.Array | np.ndarray
    frequency_penalty: jax.Array | np.ndarray

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
            repetition_penalty=np.ones(rows, np.float32),
            presence_penalty=np.zeros(rows, np.float32),
            frequency_penalty=np.zeros(rows, np.float32),
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenHistory:
    """The tokens each row has seen, on the device (module doc).

    seen: [rows, vocab] bool, the row's prompt and outputs so far (repetition_penalty).
    counts: [rows, vocab] int32, times the row generated each token so far (presence and frequency).
    """

    seen: jax.Array
    counts: jax.Array

    @classmethod
    def zeros(cls, rows: int, vocab: int) -> TokenHistory:
        return cls(seen=jnp.zeros((rows, vocab), bool), counts=jnp.zeros((rows, vocab), jnp.int32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Logprobs:
    """Log-probabilities of the raw distribution (log_softmax of the logits), every row.

    chosen: [b] float32, of the token each row took.
    top_ids: [b, TOP_LOGPROBS] int32, the most likely tokens, most likely first.
    top: [b, TOP_LOGPROBS] float32, their log-probabilities.
    """

    chosen: jax.Array
    top_ids: jax.Array
    top: jax.Array


def greedy(logits: jax.Array) -> jax.Array:
    """logits [b, vocab] float32 -> each row's most likely token [b] int32, or -1 where the row's
    logits are not finite (an adapter that blows up: the engine fails that request alone)."""
    finite = jnp.all(jnp.isfinite(logits), axis=-1)
    return jnp.where(finite, jnp.argmax(logits, axis=-1).astype(jnp.int32), -1)


def sample(
    logits: jax.Array, s: SamplingArrays, *, eos_ids: tuple[int, ...] = (), history: TokenHistory | None = None
) -> jax.Array:
    """logits [b, vocab] float32 -> next token ids [b] int32: rows with temperature 0 greedy, the
    others drawn from `filtered_logits`; EOS (`eos_ids`) banned below a row's min_tokens and the
    penalties applied (with a `history`) either way.

    Every row pays the vocabulary sort, so the engine runs this only for steps with a row that needs
    it (`jaxlora.engine.step_inputs.HostInputs.samples`, `jaxlora.engine.runner.packed_sample`); a greedy step stops
    at `greedy`.
    """
    banned = ban_eos(logits, s, eos_ids)
    if history is not None:
        banned = apply_penalties(banned, s, history)
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


def apply_penalties(logits: jax.Array, s: SamplingArrays, history: TokenHistory) -> jax.Array:
    """logits [b, vocab] with each row's repetition, frequency and presence penalties applied (vLLM's
    order and formulas). A row at the neutral values (1, 0, 0) keeps its logits bit for bit."""
    rep = s.repetition_penalty[:, None]
    penalised = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(history.seen, penalised, logits)
    counts = history.counts.astype(logits.dtype)
    return logits - s.frequency_penalty[:, None] * counts - s.presence_penalty[:, None] * (counts > 0)


def update_history(
    history: TokenHistory, tokens: jax.Array, rows: jax.Array, is_output: jax.Array, reset: jax.Array
) -> TokenHistory:
    """The history after a step: rows with `reset` [S] bool emptied (a new request on the row), then
    every token of the step added to its row.

    tokens: [T] int32 the step's input ids; rows: [T] int32 the row of each, S (out of range, dropped)
    for padding; is_output: [T] bool, the token is a generated one (counts), not the prompt.
    """
    seen = jnp.where(reset[:, None], False, history.seen)
    counts = jnp.where(reset[:, None], 0, history.counts)
    seen = seen.at[rows, tokens].set(True, mode="drop")
    counts = counts.at[rows, tokens].add(is_output.astype(jnp.int32), mode="drop")
    return TokenHistory(seen=seen, counts=counts)


def top_logprobs(logits: jax.Array, ids: jax.Array) -> Logprobs:
    """logits [b, vocab] float32 (raw: before penalties and temperature), ids [b] int32 the tokens
    taken -> their log-probabilities and the TOP_LOGPROBS most likely tokens' (`Logprobs`)."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    top, top_ids = jax.lax.top_k(logprobs, TOP_LOGPROBS)
    chosen = jnp.take_along_axis(logprobs, jnp.maximum(ids, 0)[:, None], axis=-1)[:, 0]
    return Logprobs(chosen=chosen, top_ids=top_ids.astype(jnp.int32), top=top)
