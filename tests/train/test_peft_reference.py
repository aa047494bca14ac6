"""A trained adapter, saved by jaxlora, loads in Hugging Face PEFT and gives the same logits."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxlora.kernels import StepKernels
from jaxlora.loading.hf_folder import load_hf_arrays
from jaxlora.model.kv_cache import init_kv_cache
from jaxlora.model.params import build_model
from jaxlora.train.data import Example
from jaxlora.train.export import save_adapter
from jaxlora.train.loop import TrainConfig, train
from jaxlora.train.lora_params import AdapterSpec, parse_targets
from jaxlora.train.step import OptimizerConfig, lora_logits

# float32 on both sides (torch vs XLA): summation order differs; the tiny model's logits are O(1).
TOL = {"atol": 1e-4, "rtol": 1e-4}
PROMPTS = [[1, 17, 99, 5, 42, 8, 3], [1, 200, 201, 202], [1, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9]]


@pytest.mark.reference
def test_trained_adapter_matches_peft(reference, tmp_path):
    tiny = reference({"kind": "make_tiny_model", "seed": 0})
    config, arrays = load_hf_arrays(tiny["path"])
    model = build_model(config, arrays)
    rng = np.random.default_rng(0)
    examples = []
    for _ in range(16):
        ids = np.concatenate([[1], rng.integers(3, config.vocab_size, 6), [50, 60, 70, 2]]).astype(np.int32)
        examples.append(Example(ids=ids, loss_mask=np.arange(len(ids)) >= 7))
    # Every projection, and rsLoRA's alpha / sqrt(r) scale, which PEFT must read back from the config.
    spec = AdapterSpec(rank=4, alpha=8.0, target_modules=parse_targets("all-linear"), use_rslora=True)
    run = TrainConfig(
        spec=spec, optim=OptimizerConfig(learning_rate=1e-2, num_steps=8, warmup_steps=1), batch_size=4, max_len=16
    )
    result = train(model, examples, [], run, progress=False)
    folder = save_adapter(tmp_path / "adapter", result.params, spec)

    peft = reference(
        {
            "kind": "generate",
            "model": {"hf_dir": str(tiny["path"])},
            "prompts": PROMPTS,
            "n_new": 1,
            "adapters": {"trained": str(folder)},
            "rows": [{"prompt": i, "adapter": a} for i in range(len(PROMPTS)) for a in ("trained", None)],
        }
    )
    for row in peft["rows"]:
        tokens = jnp.asarray([PROMPTS[row["prompt"]]], jnp.int32)
        ours = lora_logits(
            result.params, model.params, tokens, graphdef=model.graphdef, spec=spec, kernels=StepKernels()
        )[0]
        if row["adapter"] is None:  # the base rows: PEFT with the adapter disabled
            base = model.module()
            n = tokens.shape[1]
            hidden, _ = base(tokens, jnp.arange(n)[None], init_kv_cache(config, 1, n))
            np.testing.assert_allclose(np.asarray(base.logits(hidden)[0]), row["logits"], **TOL)
            assert np.abs(np.asarray(ours) - row["logits"]).max() > 1e-2  # the adapter does change them
        else:
            np.testing.assert_allclose(np.asarray(ours), row["logits"], **TOL)
