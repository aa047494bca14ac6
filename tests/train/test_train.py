"""Training on a tiny random model: the loss falls, the base stays frozen, checkpoints resume, the saved
PEFT folder loads back into the serving pager with the same logits, and the engine serving it
generates the training path's greedy tokens."""

from __future__ import annotations

import dataclasses
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlora.adapters import Pager
from jaxlora.config import LoraConfig
from jaxlora.engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from jaxlora.kernels import StepKernels
from jaxlora.lora.peft_format import load_peft_adapter
from jaxlora.model.kv_cache import init_kv_cache
from jaxlora.train.data import Example, make_batch
from jaxlora.train.export import save_adapter
from jaxlora.train.loop import TrainConfig, train
from jaxlora.train.lora_params import AdapterSpec, init_lora_params, parse_targets
from jaxlora.train.step import OptimizerConfig, lora_logits
from tests.factories import word_tokenizer

# Logits computed in float32 two ways (jitted training path vs the serving bank, padded to another
# rank): they differ in summation order only. Logits here are O(10).
TOL = {"atol": 1e-4, "rtol": 1e-4}


def _examples(vocab: int, n: int, seed: int) -> list[Example]:
    """Random 'prompts' followed by a response that repeats a fixed pattern the adapter can learn."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        prompt = rng.integers(3, vocab, rng.integers(4, 9))
        response = np.array([7, 11, 13, 17, 19, 23, 2])
        ids = np.concatenate([prompt, response]).astype(np.int32)
        out.append(Example(ids=ids, loss_mask=np.arange(len(ids)) >= len(prompt)))
    return out


# Every test uses the same adapter spec, optimizer and shapes, so they share one compiled step.
SPEC = AdapterSpec(rank=4, alpha=8.0, target_modules=parse_targets("all-linear"))
OPTIM = OptimizerConfig(learning_rate=3e-2, num_steps=16, warmup_steps=2)


def _config(**kw) -> TrainConfig:
    return TrainConfig(spec=SPEC, optim=OPTIM, batch_size=4, max_len=32, seed=0, **kw)


def _serving_pager(model, adapter) -> Pager:
    """A pager holding `adapter` in slot 1, written."""
    pager = Pager(model.config, LoraConfig(max_slots=2, max_rank=8), dtype=model.dtype)
    pager.register(adapter.name, adapter)
    pager.acquire(adapter.name)
    pager.commit()
    assert pager.is_ready(adapter.name) == 1
    pager.release(adapter.name)
    return pager


def _engine_greedy(model, pager: Pager, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy ids of every prompt on the pager's adapter, one continuous batch of the engine."""
    config = EngineConfig(
        max_batch=len(prompts), max_seq_len=32, token_budgets=(8, 32), max_new_tokens_limit=16, lora=pager.lora_config
    )
    engine = Engine(model, word_tokenizer(model.config.vocab_size), config, pager)
    name = pager.list()[0].name
    outputs = engine.generate(
        [
            GenerationRequest(
                request_id=str(i),
                prompt_ids=p,
                adapter=name,
                sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
            )
            for i, p in enumerate(prompts)
        ]
    )
    assert all(o.error is None for o in outputs), outputs
    return [list(o.token_ids) for o in outputs]


def _training_greedy(model, params, spec, prompt: list[int], max_tokens: int, eos: int) -> list[int]:
    """Greedy ids with the training path's full-sequence logits (causal: padding after the last
    token does not change its logits, so one padded width compiles once)."""
    tokens = np.zeros((1, len(prompt) + max_tokens), np.int32)
    tokens[0, : len(prompt)] = prompt
    out: list[int] = []
    while len(out) < max_tokens and eos not in out:
        logits = lora_logits(
            params, model.params, jnp.asarray(tokens), graphdef=model.graphdef, spec=spec, kernels=StepKernels()
        )
        out.append(int(np.asarray(logits)[0, len(prompt) + len(out) - 1].argmax()))
        tokens[0, len(prompt) + len(out) - 1] = out[-1]
    return out


def _base_logits(model, tokens):
    module = model.module()
    b, t = tokens.shape
    hidden, _ = module(tokens, jnp.broadcast_to(jnp.arange(t), (b, t)), init_kv_cache(model.config, b, t))
    return module.logits(hidden)


def test_training_lowers_the_loss_and_leaves_the_base_untouched(tiny_model):
    before = jax.tree.map(np.array, tiny_model.params)
    examples = _examples(tiny_model.config.vocab_size, 24, seed=0)
    result = train(tiny_model, examples[:20], examples[20:], _config(eval_every=8), progress=False)
    losses = [h["loss"] for h in result.history]
    evals = [h["eval_loss"] for h in result.history if "eval_loss" in h]
    assert len(evals) == 2
    assert np.mean(losses[-4:]) < 0.3 * losses[0], losses
    assert evals[-1] < 0.3 * losses[0], evals
    after = jax.tree.map(np.array, tiny_model.params)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after)))


def test_fresh_adapter_is_the_base_model_exactly(tiny_model):
    spec = SPEC
    params = init_lora_params(jax.random.key(0), tiny_model.config, spec)
    assert all(np.any(np.asarray(p["a"]) != 0) and not np.any(np.asarray(p["b"])) for p in params.values())
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 12)), jnp.int32)
    got = lora_logits(params, tiny_model.params, tokens, graphdef=tiny_model.graphdef, spec=spec, kernels=StepKernels())
    np.testing.assert_array_equal(np.asarray(got), np.asarray(_base_logits(tiny_model, tokens)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_saved_adapter_loads_back_with_the_same_logits(tiny_model, tmp_path, dtype):
    config = _config()
    result = train(tiny_model, _examples(96, 16, seed=1), [], config, progress=False)
    folder = save_adapter(tmp_path / "a", result.params, config.spec, dtype=dtype)
    assert {p.name for p in folder.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    adapter = load_peft_adapter(folder, name="a", model_config=tiny_model.config, max_rank=8)
    params = result.params
    if dtype == "bfloat16":  # compare against the weights as stored
        params = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), params)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 96, (3, 10)), jnp.int32)
    expected = lora_logits(
        params, tiny_model.params, tokens, graphdef=tiny_model.graphdef, spec=config.spec, kernels=StepKernels()
    )
    pager = _serving_pager(tiny_model, adapter)
    module = tiny_model.module()
    hidden, _ = module(
        tokens,
        jnp.broadcast_to(jnp.arange(10), (3, 10)),
        init_kv_cache(tiny_model.config, 3, 10),
        bank=pager.bank,
        slot_ids=jnp.ones((3,), jnp.int32),
    )
    got = module.logits(hidden)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), **TOL)
    assert np.abs(np.asarray(expected) - np.asarray(_base_logits(tiny_model, tokens))).max() > 1e-2
    # Served by the engine, the adapter generates what the training path's logits pick.
    prompts = [[int(t) for t in row] for row in np.asarray(tokens)[:, :7]]
    eos = tiny_model.config.eos_token_ids[0]
    served = _engine_greedy(tiny_model, pager, prompts, max_tokens=8)
    assert served == [_training_greedy(tiny_model, params, config.spec, p, 8, eos) for p in prompts]


def test_resume_continues_exactly(tiny_model, tmp_path):
    examples = _examples(96, 16, seed=2)
    config = _config(checkpoint_every=8, eval_every=0)
    full = train(tiny_model, examples, [], config, checkpoint_dir=tmp_path / "run", progress=False)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["16", "8"]
    shutil.rmtree(tmp_path / "run" / "16")  # as if the run had stopped after step 8
    resumed = train(tiny_model, examples, [], config, checkpoint_dir=tmp_path / "run", resume=True, progress=False)
    assert resumed.start_step == 8
    assert [h["step"] for h in resumed.history] == list(range(1, 17))
    for x, y in zip(jax.tree.leaves(full.params), jax.tree.leaves(resumed.params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6)
    other = TrainConfig(spec=SPEC, optim=dataclasses.replace(OPTIM, learning_rate=1e-3), batch_size=4, max_len=32)
    with pytest.raises(ValueError, match="optim differ"):
        train(tiny_model, examples, [], other, checkpoint_dir=tmp_path / "run", resume=True, progress=False)


def test_batch_weights_count_the_response_tokens():
    batch = make_batch(_examples(96, 2, seed=3), max_len=32)
    assert batch.weights.sum() == 2 * 7  # every response token (EOS included) is a target once
