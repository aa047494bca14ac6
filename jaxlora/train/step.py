"""The jitted training step: masked next-token loss, gradients for the LoRA weights only.

The frozen base parameters are an argument of the step (never a closure constant, never copied, no
gradient taken). Inside the loss the trainable weights become a two-slot adapter bank (slot 0 all
zero, slot 1 the adapter with its scale folded into B) and every row runs with slot 1, so training
goes through exactly the LoRA path that serving uses.

Everything that shapes the computation (graph, adapter spec, optimizer settings, LoRA backend) is a
hashable keyword-only static argument, so runs with equal settings share one compiled step.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxlora.config import LoraConfig
from jaxlora.kernels import StepKernels
from jaxlora.lora.bank import Bank, bank_groups
from jaxlora.model.kv_cache import init_kv_cache
from jaxlora.train.lora_params import AdapterSpec, LoraParams

TRAIN_SLOT = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW on a linear warm-up + cosine decay (to `final_lr_fraction` of the peak), global-norm clipped."""

    learning_rate: float = 2e-4
    num_steps: int = 100
    warmup_steps: int = 10
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    final_lr_fraction: float = 0.1

    def __post_init__(self) -> None:
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate={self.learning_rate} must be > 0")
        if self.num_steps < 1 or self.warmup_steps < 0:
            raise ValueError(f"num_steps={self.num_steps} must be >= 1 and warmup_steps={self.warmup_steps} >= 0")
        if self.max_grad_norm <= 0 or self.weight_decay < 0:
            raise ValueError(f"max_grad_norm={self.max_grad_norm} must be > 0, weight_decay={self.weight_decay} >= 0")

    def schedule(self) -> optax.Schedule:
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0,
            peak_value=self.learning_rate,
            warmup_steps=min(self.warmup_steps, self.num_steps - 1),
            decay_steps=self.num_steps,
            end_value=self.final_lr_fraction * self.learning_rate,
        )

    def build(self) -> optax.GradientTransformation:
        return optax.chain(
            optax.clip_by_global_norm(self.max_grad_norm), optax.adamw(self.schedule(), weight_decay=self.weight_decay)
        )


def training_bank(params: LoraParams, spec: AdapterSpec) -> Bank:
    """A [L, 2, ...] bank (see jaxlora.lora.bank) whose slot 1 holds `params`, scale folded into B."""
    lora = LoraConfig(max_slots=2, max_rank=spec.rank, target_modules=spec.target_modules)
    bank: Bank = {}
    for group, modules in bank_groups(lora):
        a = jnp.concatenate([params[m]["a"] for m in modules], axis=-1)  # [L, in, G*r]
        bank[group] = {
            "a": _with_zero_slot(a),
            "b": {m: _with_zero_slot(spec.scale * params[m]["b"]) for m in modules},
        }
    return bank


def _with_zero_slot(x: jax.Array) -> jax.Array:
    """[L, ...] -> [L, 2, ...] with slot 0 zero and slot 1 = x."""
    return jnp.stack([jnp.zeros_like(x), x], axis=1)


def lora_logits(
    params: LoraParams,
    base_params: nnx.State,
    tokens: jax.Array,
    *,
    graphdef: nnx.GraphDef,
    spec: AdapterSpec,
    kernels: StepKernels,
) -> jax.Array:
    """Full-sequence logits [b, t, vocab] float32 of the base model with the adapter on every row."""
    model = nnx.merge(graphdef, base_params)
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    # The model attends through a KV cache; a fresh one just long enough serves as scratch space.
    kv = init_kv_cache(model.cfg, b, t, dtype=model.embed_tokens.embedding[...].dtype)
    slot_ids = jnp.full((b,), TRAIN_SLOT, jnp.int32)
    hidden, _ = model(tokens, positions, kv, bank=training_bank(params, spec), slot_ids=slot_ids, kernels=kernels)
    return model.logits(hidden)


def masked_loss(
    params: LoraParams,
    base_params: nnx.State,
    batch: dict,
    *,
    graphdef: nnx.GraphDef,
    spec: AdapterSpec,
    kernels: StepKernels,
) -> tuple[jax.Array, jax.Array]:
    """(mean cross-entropy over the weighted (response) tokens, their number).

    batch: tokens [b, t] int32, targets [b, t] int32, weights [b, t] float32 (see data.Batch).
    """
    logits = lora_logits(params, base_params, batch["tokens"], graphdef=graphdef, spec=spec, kernels=kernels)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])  # [b, t]
    count = jnp.sum(batch["weights"])
    return jnp.sum(losses * batch["weights"]) / jnp.maximum(count, 1.0), count


@functools.partial(jax.jit, static_argnames=("graphdef", "spec", "optim", "kernels"), donate_argnums=(0, 1))
def train_step(
    params: LoraParams,
    opt_state: optax.OptState,
    base_params: nnx.State,
    batch: dict,
    *,
    graphdef: nnx.GraphDef,
    spec: AdapterSpec,
    optim: OptimizerConfig,
    kernels: StepKernels,
) -> tuple[LoraParams, optax.OptState, dict]:
    """One AdamW update of the LoRA weights. params and opt_state are donated (updated in place).

    Returns (params, opt_state, metrics {loss, tokens, grad_norm}); base_params are only read.
    """
    loss_fn = functools.partial(masked_loss, graphdef=graphdef, spec=spec, kernels=kernels)
    (loss, count), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, base_params, batch)
    updates, opt_state = optim.build().update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, {"loss": loss, "tokens": count, "grad_norm": optax.tree.norm(grads)}


@functools.partial(jax.jit, static_argnames=("graphdef", "spec", "kernels"))
def eval_step(
    params: LoraParams,
    base_params: nnx.State,
    batch: dict,
    *,
    graphdef: nnx.GraphDef,
    spec: AdapterSpec,
    kernels: StepKernels,
) -> tuple[jax.Array, jax.Array]:
    """(summed cross-entropy over the weighted tokens, their number): sum over batches, then divide."""
    loss, count = masked_loss(params, base_params, batch, graphdef=graphdef, spec=spec, kernels=kernels)
    return loss * count, count
