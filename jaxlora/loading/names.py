"""Hugging Face tensor names <-> jaxlora flat parameter names (stacked over layers, [in, out])."""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxlora.config import ModelConfig
from jaxlora.errors import ModelLoadError

# HF per-layer suffix -> (flat name, is a Linear weight that needs [out, in] -> [in, out])
LAYER_TENSORS: dict[str, tuple[str, bool]] = {
    "input_layernorm.weight": ("layers.input_layernorm.scale", False),
    "post_attention_layernorm.weight": ("layers.post_attention_layernorm.scale", False),
    **{
        f"self_attn.{m}.weight": (f"layers.self_attn.{m}.kernel", True)
        for m in ("q_proj", "k_proj", "v_proj", "o_proj")
    },
    **{f"self_attn.{m}.bias": (f"layers.self_attn.{m}.bias", False) for m in ("q_proj", "k_proj", "v_proj", "o_proj")},
    **{f"mlp.{m}.weight": (f"layers.mlp.{m}.kernel", True) for m in ("gate_proj", "up_proj", "down_proj")},
}
Array = np.ndarray | jax.Array
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def hf_to_flat(tensors: dict[str, Array], config: ModelConfig, *, source: str) -> dict[str, Array]:
    """Stacks per-layer HF tensors into the flat [num_layers, in, out] layout; unknown or missing
    tensors raise ModelLoadError naming them.

    `tensors` (numpy or device arrays) is consumed: each entry is popped as it is used, so that a
    device-resident model never holds a layer's tensor once its stacked copy exists (a 7B model read
    straight to the device would otherwise need twice its bytes there). Device arrays are transposed
    and stacked on the device (`stack_layers`), numpy ones on the host.
    """
    per_layer: dict[str, list[Array | None]] = {}
    transposed: dict[str, bool] = {}
    flat: dict[str, Array] = {}
    for key in list(tensors):
        value = tensors.pop(key)
        m = _LAYER_RE.match(key)
        if m:
            layer, suffix = int(m.group(1)), m.group(2)
            if suffix.endswith("rotary_emb.inv_freq"):
                continue
            if suffix not in LAYER_TENSORS or layer >= config.num_layers:
                raise ModelLoadError(f"{source}: unexpected tensor {key}")
            name, transpose = LAYER_TENSORS[suffix]
            transposed[name] = transpose
            per_layer.setdefault(name, [None] * config.num_layers)[layer] = value
        elif key == "model.embed_tokens.weight":
            flat["embed_tokens.embedding"] = value
        elif key == "model.norm.weight":
            flat["norm.scale"] = value
        elif key == "lm_head.weight":
            if not config.tie_word_embeddings:
                flat["lm_head.kernel"] = value.T
        else:
            raise ModelLoadError(f"{source}: unexpected tensor {key}")
    flat.update(stack_layers(per_layer, source=source, transposed=transposed))
    return flat


def stack_layers(
    per_layer: dict[str, list[Array | None]], *, source: str, transposed: Mapping[str, bool] | None = None
) -> dict[str, Array]:
    """Per-layer lists -> stacked [num_layers, ...] arrays, each layer's matrix swapped to [in, out]
    first where `transposed[name]`; a missing layer or a shape mismatch is a ModelLoadError naming
    the parameter. Consumes `per_layer` (one parameter's layers are dropped once it is stacked).

    numpy layers stack on the host; if any layer is a jax.Array, the whole parameter is stacked on
    the device in one program, so the host never makes the strided transposed copy."""
    transposed = transposed or {}
    out = {}
    for name in list(per_layer):
        layers = per_layer.pop(name)
        missing = [i for i, a in enumerate(layers) if a is None]
        if missing:
            raise ModelLoadError(f"{source}: missing tensor for layer(s) {missing[:5]} of {name}")
        shapes = {tuple(a.shape) for a in layers}
        if len(shapes) != 1:
            raise ModelLoadError(f"{source}: layers disagree on the shape of {name}: {sorted(shapes)}")
        swap = transposed.get(name, False)
        if all(isinstance(a, np.ndarray) for a in layers):
            out[name] = np.stack([a.T if swap else a for a in layers])
        else:
            out[name] = _stack_on_device(tuple(layers), swap)
        del layers
    return out


@functools.partial(jax.jit, static_argnums=1)
def _stack_on_device(layers: tuple[jax.Array, ...], swap: bool) -> jax.Array:
    """[num_layers, ...] of `layers`, each with its last two axes swapped where `swap`."""
    return jnp.stack([jnp.swapaxes(a, -1, -2) if swap else a for a in layers])


def flat_to_hf(flat: Mapping[str, np.ndarray], config: ModelConfig) -> dict[str, np.ndarray]:
    """The inverse of hf_to_flat: HF tensor names, [out, in] Linear weights, one tensor per layer."""
    inverse = {name: (suffix, t) for suffix, (name, t) in LAYER_TENSORS.items()}
    out: dict[str, np.ndarray] = {}
    for name, value in flat.items():
        value = np.asarray(value)
        if name in inverse:
            suffix, transpose = inverse[name]
            for i in range(config.num_layers):
                layer = value[i].T if transpose else value[i]
                out[f"model.layers.{i}.{suffix}"] = np.ascontiguousarray(layer)
        elif name == "embed_tokens.embedding":
            out["model.embed_tokens.weight"] = value
        elif name == "norm.scale":
            out["model.norm.weight"] = value
        elif name == "lm_head.kernel":
            out["lm_head.weight"] = np.ascontiguousarray(value.T)
        else:
            raise ValueError(f"no Hugging Face name for parameter {name}")
    return out
