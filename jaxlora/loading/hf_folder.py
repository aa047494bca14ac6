"""Hugging Face model folders: config.json + model.safetensors (or a sharded index)."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, for bf16 safetensors)
import numpy as np
from safetensors import safe_open

from jaxlora.config import ModelConfig
from jaxlora.errors import ModelLoadError
from jaxlora.loading.hf_config import model_config_from_hf
from jaxlora.loading.names import hf_to_flat


def read_hf_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder}: no config.json")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: invalid JSON: {e}") from None
    return model_config_from_hf(cfg, source=str(path))


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a folder: the sharded index's files, or every *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index}: invalid sharded index ({e})") from None
        files = sorted({folder / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{index}: lists {f.name}, which does not exist")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
            raise ModelLoadError(f"{folder}: only pickle weights (*.bin/*.pt); jaxlora loads safetensors only")
        raise ModelLoadError(f"{folder}: no *.safetensors weight files")
    return files


def read_tensors(files: list[Path]) -> dict[str, np.ndarray]:
    """All tensors of the files as numpy arrays (bf16 via ml_dtypes)."""
    out: dict[str, np.ndarray] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="numpy") as st:
                for key in st.keys():
                    out[key] = st.get_tensor(key)
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
            raise ModelLoadError(f"{f}: cannot read safetensors file ({type(e).__name__}: {e})") from None
    return out


def load_hf_arrays(folder: Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """(config, flat parameter arrays) of an HF Llama-family folder."""
    config = read_hf_config(folder)
    tensors = read_tensors(safetensors_files(folder))
    return config, hf_to_flat(tensors, config, source=str(folder))
