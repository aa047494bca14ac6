"""Hugging Face tensor names <-> jaxlora flat parameter names (stacked over layers, [in, out])."""

from __future__ import annotations

import re
from collections.abc import Mapping

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
# flat name -> (HF per-layer suffix, transposed): LAYER_TENSORS read the other way.
FLAT_LAYER_TENSORS: dict[str, tuple[str, bool]] = {flat: (suffix, t) for suffix, (flat, t) in LAYER_TENSORS.items()}
# The tensors outside the layers: flat name -> (HF name, is a Linear weight stored [out, in]).
GLOBAL_TENSORS: dict[str, tuple[str, bool]] = {
    "embed_tokens.embedding": ("model.embed_tokens.weight", False),
    "norm.scale": ("model.norm.weight", False),
    "lm_head.kernel": ("lm_head.weight", True),
}
_GLOBAL_BY_HF = {hf: (flat, t) for flat, (hf, t) in GLOBAL_TENSORS.items()}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def hf_to_flat(tensors: Mapping[str, np.ndarray], config: ModelConfig, *, source: str) -> dict[str, np.ndarray]:
    """Stacks per-layer HF tensors; unknown or missing tensors raise ModelLoadError naming them."""
    per_layer: dict[str, list[np.ndarray | None]] = {}
    flat: dict[str, np.ndarray] = {}
    for key, value in tensors.items():
        m = _LAYER_RE.match(key)
        if m:
            layer, suffix = int(m.group(1)), m.group(2)
            if suffix.endswith("rotary_emb.inv_freq"):
                continue
            if suffix not in LAYER_TENSORS or layer >= config.num_layers:
                raise ModelLoadError(f"{source}: unexpected tensor {key}")
            name, transpose = LAYER_TENSORS[suffix]
            per_layer.setdefault(name, [None] * config.num_layers)[layer] = value.T if transpose else value
        elif key in _GLOBAL_BY_HF:
            name, transpose = _GLOBAL_BY_HF[key]
            if name != "lm_head.kernel" or not config.tie_word_embeddings:
                flat[name] = value.T if transpose else value
        else:
            raise ModelLoadError(f"{source}: unexpected tensor {key}")
    flat.update(stack_layers(per_layer, source=source))
    return flat


def stack_layers(per_layer: Mapping[str, list[np.ndarray | None]], *, source: str) -> dict[str, np.ndarray]:
    """Per-layer lists -> stacked [num_layers, ...] arrays; a missing layer or a shape mismatch is a
    ModelLoadError naming the parameter."""
    out = {}
    for name, layers in per_layer.items():
        missing = [i for i, a in enumerate(layers) if a is None]
        if missing:
            raise ModelLoadError(f"{source}: missing tensor for layer(s) {missing[:5]} of {name}")
        shapes = {a.shape for a in layers}
        if len(shapes) != 1:
            raise ModelLoadError(f"{source}: layers disagree on the shape of {name}: {sorted(shapes)}")
        out[name] = np.stack(layers)
    return out


def flat_to_hf(flat: Mapping[str, np.ndarray], config: ModelConfig) -> dict[str, np.ndarray]:
    """The inverse of hf_to_flat: HF tensor names, [out, in] Linear weights, one tensor per layer."""
    out: dict[str, np.ndarray] = {}
    for name, value in flat.items():
        value = np.asarray(value)
        if name in FLAT_LAYER_TENSORS:
            suffix, transpose = FLAT_LAYER_TENSORS[name]
            for i in range(config.num_layers):
                layer = value[i].T if transpose else value[i]
                out[f"model.layers.{i}.{suffix}"] = np.ascontiguousarray(layer)
        elif name in GLOBAL_TENSORS:
            hf, transpose = GLOBAL_TENSORS[name]
            out[hf] = np.ascontiguousarray(value.T) if transpose else value
        else:
            raise ValueError(f"no Hugging Face name for parameter {name}")
    return out
