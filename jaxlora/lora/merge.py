"""Merging an adapter into the base weights: W' = W + A @ B (PEFT scale already folded into B).

A merged model serves one adapter at the base model's cost: the "heavy steady traffic" path.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

from jaxlora.errors import ModelLoadError

_MODULE_PARAM = {
    "q_proj": "layers.self_attn.q_proj.kernel",
    "k_proj": "layers.self_attn.k_proj.kernel",
    "v_proj": "layers.self_attn.v_proj.kernel",
    "o_proj": "layers.self_attn.o_proj.kernel",
    "gate_proj": "layers.mlp.gate_proj.kernel",
    "up_proj": "layers.mlp.up_proj.kernel",
    "down_proj": "layers.mlp.down_proj.kernel",
}


def merged_params(
    flat_params: Mapping[str, npt.ArrayLike],
    weights: Mapping[str, tuple[np.ndarray, np.ndarray]],
    *,
    quantization: str | None,
) -> dict[str, np.ndarray]:
    """Flat parameters (`LoadedModel.flat_params()`) with every module's delta added.

    weights: module -> (A [L, in, r], B [L, r, out]) with the scale folded into B.
    quantization: the base model's (`LoadedModel.quantization`); None for dense weights.
    Kernels are [L, in, out], so the delta of layer l is A[l] @ B[l]; it is added in float32.
    Raises ModelLoadError for a quantized base: its merged weights would have to be quantized again.
    """
    if quantization is not None:
        raise ModelLoadError(
            f"cannot merge into {quantization} base weights; merge into the dense "
            f"model (load it without --quantize, or from the unconverted source)"
        )
    flat = {k: np.asarray(v) for k, v in flat_params.items()}
    for module, (a, b) in weights.items():
        name = _MODULE_PARAM[module]
        base = flat[name]
        delta = np.einsum("lir,lro->lio", a.astype(np.float32), b.astype(np.float32))
        flat[name] = (base.astype(np.float32) + delta).astype(base.dtype)
    return flat
