"""Trained LoRA weights -> a standard Hugging Face PEFT folder (adapter_config.json + safetensors)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxlora.lora.peft_format import save_peft_adapter
from jaxlora.train.lora_params import AdapterSpec, LoraParams


def save_adapter(
    path: str | Path,
    params: LoraParams,
    spec: AdapterSpec,
    *,
    base_model_name_or_path: str = "",
    dtype: str = "float32",
) -> Path:
    """Writes `params` (unscaled A [L, in, r], B [L, r, out] per module) as a PEFT LoRA folder.

    dtype: "float32", "float16" or "bfloat16" for the saved tensors.
    """
    weights = {m: (np.asarray(p["a"], np.float32), np.asarray(p["b"], np.float32)) for m, p in params.items()}
    return save_peft_adapter(
        path,
        weights=weights,
        rank=spec.rank,
        alpha=spec.alpha,
        target_modules=spec.target_modules,
        base_model_name_or_path=base_model_name_or_path,
        use_rslora=spec.use_rslora,
        dtype=dtype,
    )
