"""Writes a model as a Hugging Face folder (config.json + model.safetensors + tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxlora.loading.names import flat_to_hf
from jaxlora.model.params import LoadedModel
from jaxlora.tokenizer import Tokenizer, save_tokenizer
from jaxlora.weights_file import save_safetensors


def save_hf_folder(
    model: LoadedModel, tokenizer: Tokenizer | None, out: Path, flat: dict[str, np.ndarray] | None = None
) -> None:
    """Saves `flat` (default: the model's own parameters) under `model.config` as an HF folder."""
    out.mkdir(parents=True, exist_ok=True)
    flat = flat if flat is not None else {k: np.asarray(v) for k, v in model.flat_params().items()}
    tensors = flat_to_hf(flat, model.config)
    save_safetensors(
        {k: np.ascontiguousarray(v) for k, v in tensors.items()}, out / "model.safetensors", metadata={"format": "pt"}
    )
    cfg = model.config.to_hf_dict()
    cfg["torch_dtype"] = str(np.asarray(next(iter(flat.values()))).dtype)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    if tokenizer is not None:
        save_tokenizer(tokenizer, out)
