"""Penalties, token history and logprobs against numpy references that share no code with the
sampler: loops over rows and tokens, on random logits pushed away from zero, in mixed batches (rows
penalised and not, greedy and sampled, asking logprobs or not)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxlora.engine.request import TOP_LOGPROBS
from jaxlora.engine.sampling import SamplingArrays, TokenHistory, apply_penalties, sample, top_logprobs, update_history

ROWS, VOCAB = 6, 67
# (repetition, presence, frequency) per row: neutral rows 0 and 4 must come out bit for bit.
PENALTIES = [(1.0, 0.0, 0.0), (1.3, 0.0, 0.0), (0.7, 0.5, 0.0), (1.0, -1.5, 2.0), (1.0, 0.0, 0.0), (2.0, 1.0, -0.4)]


def _logits(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 3, (ROWS, VOCAB)).astype(np.float32)
    return np.where(np.abs(x) < 0.1, np.sign(x + 1e-9) * 0.5, x).astype(np.float32)  # never zero


def _history(seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 4, (ROWS, VOCAB)) * (rng.random((ROWS, VOCAB)) < 0.3)
    seen = (counts > 0) | (rng.random((ROWS, VOCAB)) < 0.2)  # outputs, plus prompt tokens
    return seen, counts.astype(np.int32)


def _arrays() -> SamplingArrays:
    s = SamplingArrays.zeros(ROWS)
    for i, (rep, pres, freq) in enumerate(PENALTIES):
        s.repetition_penalty[i], s.presence_penalty[i], s.frequency_penalty[i] = rep, pres, freq
    return s


def _reference_penalties(logits: np.ndarray, seen: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """vLLM's formulas, one token at a time: repetition over seen tokens (divide positive logits,
    multiply negative ones), then logit -= frequency * count + presence * (count > 0)."""
    out = logits.astype(np.float64).copy()
    for i, (rep, pres, freq) in enumerate(PENALTIES):
        for t in range(VOCAB):
            if seen[i, t]:
                out[i, t] = out[i, t] / rep if out[i, t] > 0 else out[i, t] * rep
            out[i, t] -= freq * counts[i, t] + pres * (1 if counts[i, t] > 0 else 0)
    return out


def test_reference_on_a_hand_computed_case():
    # Row 5: rep 2, presence 1, frequency -0.4. A seen token of logit 3 generated twice:
    # 3 / 2 - (-0.4 * 2 + 1) = 1.5 - 0.2 = 1.3. A seen, never generated logit -1: -1 * 2 = -2.
    logits = np.ones((ROWS, VOCAB), np.float32)
    logits[5, 0], logits[5, 1] = 3.0, -1.0
    seen, counts = np.zeros((ROWS, VOCAB), bool), np.zeros((ROWS, VOCAB), np.int32)
    seen[5, :2], counts[5, 0] = True, 2
    want = _reference_penalties(logits, seen, counts)
    np.testing.assert_allclose(want[5, :2], [1.3, -2.0])


def test_penalties_match_the_reference_and_leave_neutral_rows_bit_for_bit():
    logits, (seen, counts) = _logits(), _history()
    history = TokenHistory(seen=jnp.asarray(seen), counts=jnp.asarray(counts))
    got = np.asarray(apply_penalties(jnp.asarray(logits), _arrays(), history))
    np.testing.assert_allclose(got, _reference_penalties(logits, seen, counts), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[[0, 4]], logits[[0, 4]])
    assert not np.array_equal(got[1], logits[1])


def test_a_greedy_penalised_row_takes_the_argmax_after_the_penalties():
    logits, (seen, counts) = _logits(2), _history(3)
    top = np.argmax(logits, axis=-1)
    seen[np.arange(ROWS), top] = True  # every row's favourite was seen and generated 3 times
    counts[np.arange(ROWS), top] = 3
    s = _arrays()  # all greedy
    history = TokenHistory(seen=jnp.asarray(seen), counts=jnp.asarray(counts))
    ids = np.asarray(sample(jnp.asarray(logits), s, history=history))
    want = np.argmax(_reference_penalties(logits, seen, counts), axis=-1)
    np.testing.assert_array_equal(ids, want)
    assert ids[0] == top[0] and ids[4] == top[4]  # neutral rows keep their argmax
    assert (ids[[3, 5]] != top[[3, 5]]).all()  # strong enough to move the argmax


def test_history_update_matches_a_loop_over_tokens():
    rng = np.random.default_rng(4)
    seen, counts = _history(5)
    T = 23
    tokens = rng.integers(0, VOCAB, T).astype(np.int32)
    rows = rng.integers(0, ROWS + 1, T).astype(np.int32)  # ROWS: padding
    rows[:3] = 2  # one token repeated in a row: counted twice
    tokens[:2] = tokens[2]
    is_output = rng.random(T) < 0.6
    reset = np.array([False, True, False, False, True, False])
    want_seen, want_counts = seen.copy(), counts.copy()
    want_seen[reset], want_counts[reset] = False, 0
    for t in range(T):
        if rows[t] < ROWS:
            want_seen[rows[t], tokens[t]] = True
            want_counts[rows[t], tokens[t]] += int(is_output[t])
    history = TokenHistory(seen=jnp.asarray(seen), counts=jnp.asarray(counts))
    got = update_history(history, jnp.asarray(tokens), jnp.asarray(rows), jnp.asarray(is_output), jnp.asarray(reset))
    np.testing.assert_array_equal(np.asarray(got.seen), want_seen)
    np.testing.assert_array_equal(np.asarray(got.counts), want_counts)


def test_logprobs_are_the_raw_log_softmax_of_the_chosen_and_top_tokens():
    logits = _logits(6)
    ids = np.array([3, 0, VOCAB - 1, 17, 40, 5], np.int32)
    got = top_logprobs(jnp.asarray(logits), jnp.asarray(ids))
    for i in range(ROWS):
        x = logits[i].astype(np.float64)
        logprobs = x - (np.log(np.sum(np.exp(x - x.max()))) + x.max())
        order = sorted(range(VOCAB), key=lambda t: -logprobs[t])[:TOP_LOGPROBS]
        np.testing.assert_array_equal(np.asarray(got.top_ids[i]), order)
        np.testing.assert_allclose(np.asarray(got.top[i]), logprobs[order], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(float(got.chosen[i]), logprobs[ids[i]], rtol=1e-5, atol=1e-5)
    assert (np.exp(np.asarray(got.top)).sum(axis=-1) <= 1 + 1e-5).all()
