"""The sampler's filters against a numpy reference that shares no code with it: EOS banned below
min_tokens, temperature, top-k, top-p and min-p, for many rows with different settings at once."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxlora.engine.sampling import SamplingArrays, ban_eos, filtered_logits, sample

ROWS, VOCAB, EOS = 7, 50, (3, 11)


def _reference_filtered(logits: np.ndarray, row: dict) -> np.ndarray:
    """One row, a loop over tokens in probability order (vLLM's order: top-k, top-p, then min-p on
    the tempered distribution)."""
    scaled = logits / (row["temperature"] if row["temperature"] > 0 else 1.0)
    order = sorted(range(VOCAB), key=lambda t: -scaled[t])
    kept = set(order[: row["top_k"]] if row["top_k"] else order)
    probs = np.exp(scaled - scaled.max())
    in_k = np.array([probs[t] if t in kept else 0.0 for t in range(VOCAB)])
    in_k /= in_k.sum()
    top_p, mass = set(), 0.0
    for t in order:
        if t in kept and (row["top_p"] >= 1 or mass < row["top_p"] or not top_p):  # 1: off
            top_p.add(t)
            mass += in_k[t]
    full = probs / probs.sum()
    min_p = {t for t in range(VOCAB) if full[t] >= row["min_p"] * full.max()}
    return np.array([scaled[t] if t in top_p & min_p else -np.inf for t in range(VOCAB)], np.float32)


def _rows() -> list[dict]:
    base = dict(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0, counter=0, min_tokens=0)
    return [
        base,
        {**base, "min_p": 0.3},
        {**base, "min_p": 0.05, "top_k": 12},
        {**base, "temperature": 1.7, "top_p": 0.6, "min_p": 0.1},
        {**base, "temperature": 0.0, "counter": 1, "min_tokens": 4},  # greedy, EOS banned
        {**base, "temperature": 0.5, "counter": 2, "min_tokens": 2},  # EOS allowed again
        {**base, "min_p": 1.0},  # only the most likely token
    ]


def _arrays(rows: list[dict]) -> SamplingArrays:
    s = SamplingArrays.zeros(len(rows))
    for i, r in enumerate(rows):
        for name in ("temperature", "top_k", "top_p", "min_p", "counter", "min_tokens"):
            getattr(s, name)[i] = r[name]
        s.seed[i] = 100 + i
    return s


@pytest.fixture
def logits() -> np.ndarray:
    rng = np.random.default_rng(0)
    x = rng.normal(0, 2, (ROWS, VOCAB)).astype(np.float32)
    x[4, EOS[1]] = 50.0  # the greedy row's argmax is EOS: the ban must move it
    return x


def test_filters_match_the_numpy_reference_row_by_row(logits):
    rows = _rows()
    s = _arrays(rows)
    got = np.asarray(filtered_logits(jnp.asarray(logits), s))
    for i, row in enumerate(rows):
        want = _reference_filtered(logits[i], row)
        np.testing.assert_array_equal(np.isfinite(got[i]), np.isfinite(want), err_msg=f"row {i}")
        np.testing.assert_allclose(got[i][np.isfinite(want)], want[np.isfinite(want)], rtol=1e-6, err_msg=f"row {i}")
    assert np.isfinite(got[6]).sum() == 1  # min_p 1 keeps the most likely token alone


def test_eos_is_banned_below_min_tokens_only(logits):
    s = _arrays(_rows())
    banned = np.asarray(ban_eos(jnp.asarray(logits), s, EOS))
    below = [i for i, r in enumerate(_rows()) if r["counter"] < r["min_tokens"]]
    assert below == [4]
    assert np.isneginf(banned[4, list(EOS)]).all()
    others = [i for i in range(ROWS) if i != 4]
    np.testing.assert_array_equal(banned[others], logits[others])
    ids = np.asarray(sample(jnp.asarray(logits), s, eos_ids=EOS))
    masked = logits[4].copy()
    masked[list(EOS)] = -np.inf
    assert ids[4] == int(np.argmax(masked)) != EOS[1]


def test_draws_fall_inside_the_reference_support_and_follow_its_probabilities(logits):
    rows = [{**_rows()[3]}] * 1
    s = _arrays(rows)
    want = _reference_filtered(logits[3], rows[0])
    probs = np.exp(want - want[np.isfinite(want)].max())
    probs /= probs.sum()
    counts = np.zeros(VOCAB)
    for seed in range(400):
        s.seed[0] = seed
        counts[int(sample(jnp.asarray(logits[3:4]), s, eos_ids=EOS)[0])] += 1
    assert counts[~np.isfinite(want)].sum() == 0
    np.testing.assert_allclose(counts / counts.sum(), probs, atol=0.08)
