"""The trainable LoRA weights: one (A, B) pair per target module, stacked over layers.

    params[module]["a"]  [num_layers, in_features, rank]   PEFT's lora_A.weight, transposed
    params[module]["b"]  [num_layers, rank, out_features]  PEFT's lora_B.weight, transposed

The weights are kept UNSCALED, as PEFT stores them; the scale (`alpha / rank`, or `alpha / sqrt(rank)`
with rsLoRA) is applied when the training bank is built and when an adapter is loaded for serving.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxlora.config import TARGET_MODULES, ModelConfig

LoraParams = dict[str, dict[str, jax.Array]]

ALL_LINEAR = "all-linear"


def parse_targets(text: str) -> tuple[str, ...]:
    """`all-linear` or a comma-separated list of module names -> modules in canonical order.

    Raises:
      ValueError: on an unknown module name or an empty list.
    """
    if text.strip() == ALL_LINEAR:
        return TARGET_MODULES
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = sorted(set(names) - set(TARGET_MODULES))
    if unknown:
        raise ValueError(f"unknown target module(s) {unknown}; known: {', '.join(TARGET_MODULES)} or {ALL_LINEAR}")
    if not names:
        raise ValueError("targets must name at least one module")
    return tuple(m for m in TARGET_MODULES if m in names)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdapterSpec:
    """Shape and scale of the adapter being trained (hashable: a static argument of the step)."""

    rank: int = 8
    alpha: float = 16.0
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")
    use_rslora: bool = False

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"rank={self.rank} must be >= 1")
        if self.alpha <= 0:
            raise ValueError(f"alpha={self.alpha} must be > 0")
        unknown = set(self.target_modules) - set(TARGET_MODULES)
        if unknown or not self.target_modules:
            raise ValueError(f"target_modules={self.target_modules} must be a non-empty subset of {TARGET_MODULES}")
        object.__setattr__(self, "target_modules", tuple(m for m in TARGET_MODULES if m in self.target_modules))

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def init_lora_params(key: jax.Array, config: ModelConfig, spec: AdapterSpec) -> LoraParams:
    """PEFT's default init: A kaiming-uniform (a=sqrt(5)), i.e. U(-1/sqrt(in), 1/sqrt(in)); B zeros.

    With B zero the adapter starts as the base model exactly; A's randomness breaks the symmetry.
    """
    params: LoraParams = {}
    keys = jax.random.split(key, len(spec.target_modules))
    for k, module in zip(keys, spec.target_modules):
        d_in, d_out = config.module_shape(module)
        bound = 1.0 / math.sqrt(d_in)
        params[module] = {
            "a": jax.random.uniform(k, (config.num_layers, d_in, spec.rank), jnp.float32, -bound, bound),
            "b": jnp.zeros((config.num_layers, spec.rank, d_out), jnp.float32),
        }
    return params


def count_params(params: LoraParams) -> int:
    return sum(x.size for x in jax.tree_util.tree_leaves(params))
