"""The Flax Llama on its own: cache consistency, batching, RoPE scaling, random-weight sanity."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlora.config import RopeScaling
from jaxlora.model import init_kv_cache
from jaxlora.model.forward import forward_logits
from jaxlora.model.params import build_model, random_model
from jaxlora.model.rope import inverse_frequencies
from tests.factories import tiny_config
from tests.greedy import batched_greedy


def _full(model, tokens):
    b, t = tokens.shape
    kv = init_kv_cache(model.config, b, 32)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    return np.asarray(forward_logits(model.graphdef, model.params, tokens, pos, kv)[0])


@pytest.mark.parametrize(
    "overrides",
    [{}, {"tie_word_embeddings": False, "attention_bias": True}, {"attention_bias": True, "o_proj_bias": True}],
)
def test_incremental_decode_equals_full_forward(overrides):
    model = random_model(tiny_config(**overrides), seed=1)
    tokens = jax.random.randint(jax.random.key(0), (3, 9), 0, 96)
    full = _full(model, tokens)
    kv = init_kv_cache(model.config, 3, 32)
    logits, kv = forward_logits(
        model.graphdef, model.params, tokens[:, :5], jnp.broadcast_to(jnp.arange(5), (3, 5)), kv
    )
    steps = [np.asarray(logits)]
    for p in range(5, 9):
        logits, kv = forward_logits(model.graphdef, model.params, tokens[:, p : p + 1], jnp.full((3, 1), p), kv)
        steps.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=2e-5, rtol=2e-5)


def test_rows_are_independent_and_row_ids_route_the_cache():
    model = random_model(tiny_config(), seed=2)
    tokens = jax.random.randint(jax.random.key(1), (2, 6), 0, 96)
    full = _full(model, tokens)
    # Prefill row 1 alone into cache row 3 of a 4-row cache, with a padding row dropped (row id 4).
    kv = init_kv_cache(model.config, 4, 32)
    toks = jnp.stack([tokens[1], tokens[0]])
    pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
    logits, kv = forward_logits(model.graphdef, model.params, toks, pos, kv, row_ids=jnp.array([3, 4]))
    np.testing.assert_allclose(np.asarray(logits)[0], full[1], atol=2e-5, rtol=2e-5)
    assert float(jnp.abs(kv.k[:, :3]).max()) == 0.0  # rows 0..2 untouched, padding row dropped


def test_llama3_rope_scaling_changes_only_low_frequencies():
    plain = inverse_frequencies(tiny_config(head_dim=64))
    scaled = inverse_frequencies(
        tiny_config(
            head_dim=64,
            rope_scaling=RopeScaling(
                factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
            ),
        )
    )
    assert scaled[0] == plain[0]  # highest frequency kept
    np.testing.assert_allclose(scaled[-1], plain[-1] / 8.0, rtol=1e-6)  # lowest slowed by `factor`


def test_build_model_rejects_wrong_shape_and_missing_tensor():
    model = random_model(tiny_config())
    flat = {k: np.asarray(v) for k, v in model.flat_params().items()}
    bad = dict(flat, **{"norm.scale": np.ones(5, np.float32)})
    with pytest.raises(ValueError, match=r"src: tensor norm.scale has shape \(5,\), expected \(32,\)"):
        build_model(model.config, bad, source="src")
    missing = {k: v for k, v in flat.items() if k != "layers.mlp.up_proj.kernel"}
    with pytest.raises(ValueError, match=r"src: missing tensor.*up_proj"):
        build_model(model.config, missing, source="src")


def test_bfloat16_runs_close_to_float32():
    model = random_model(tiny_config(), seed=3)
    flat = {k: np.asarray(v) for k, v in model.flat_params().items()}
    bf = build_model(model.config, flat, dtype=jnp.bfloat16)
    tokens = jax.random.randint(jax.random.key(2), (2, 7), 0, 96)
    np.testing.assert_allclose(_full(bf, tokens), _full(model, tokens), atol=5e-2, rtol=5e-2)


def test_unrolled_layers_give_the_same_tokens():
    """The unrolled layer loop (decode steps) changes no greedy token against the scan."""
    from jaxlora.kernels import StepKernels

    model = random_model(tiny_config(head_dim=16, num_layers=3), seed=3)
    prompts = [[5, 6, 7, 8, 9], [11, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48]]
    want = batched_greedy(model, prompts, [0, 0, 0], 6)
    kernels = StepKernels(unroll_layers=True)
    assert kernels.unrolls(len(prompts)) and not kernels.unrolls(len(prompts), tokens_per_row=2)
    got = batched_greedy(model, prompts, [0, 0, 0], 6, kernels=kernels)
    assert got == want


def test_unrolled_layers_trace_and_lower_one_layer(monkeypatch):
    """An unrolled step traces its layer once and lowers it to one function called per layer: a
    warm-cache start, which still traces and lowers every step, does not pay per layer."""
    from jaxlora.kernels import StepKernels
    from jaxlora.model.llama import DecoderLayer

    layers = 5
    model = random_model(tiny_config(head_dim=16, num_layers=layers), seed=3)
    traced = []
    call = DecoderLayer.__call__
    monkeypatch.setattr(DecoderLayer, "__call__", lambda self, *a, **k: traced.append(1) or call(self, *a, **k))
    kernels = StepKernels(unroll_layers=True)
    tokens = jnp.asarray([[3], [4]])
    kv = init_kv_cache(model.config, 2, 8)
    lowered = forward_logits.lower(
        model.graphdef, model.params, tokens, jnp.zeros((2, 1), jnp.int32), kv, kernels=kernels
    )
    assert kernels.unrolls(2) and len(traced) == 1
    text = lowered.as_text()
    callees = [line.split("call @")[1].split("(")[0] for line in text.splitlines() if "call @" in line]
    assert callees.count("body") == layers, callees
