"""Loading base models from GGUF files, Hugging Face folders and converted (orbax) checkpoints."""

from __future__ import annotations

import time
from pathlib import Path

import jax.numpy as jnp

from jaxlora.config import ModelConfig
from jaxlora.errors import ModelLoadError
from jaxlora.loading.default_model import default_model_path
from jaxlora.model.params import LoadedModel, abstract_model, assemble_model, build_model
from jaxlora.model.quant import Quantization, parse_quantization
from jaxlora.tokenizer import Tokenizer, tokenizer_from_folder

__all__ = ["default_model_path", "load_model", "read_model_config"]


def read_model_config(source: str | Path | None = None) -> ModelConfig:
    """The ModelConfig `load_model(source)` will give, from the config file or metadata alone (no
    weights read): what a caller needs to prepare adapters while the weights load."""
    path = default_model_path() if source is None else Path(source)
    if path.is_dir():
        from jaxlora.loading.orbax_ckpt import is_converted, read_converted_config

        if is_converted(path):
            return read_converted_config(path)
        from jaxlora.loading.hf_folder import read_hf_config

        return read_hf_config(path)
    if path.suffix == ".gguf" or path.is_file():
        from jaxlora.loading.gguf_file import read_gguf_config

        return read_gguf_config(path)
    raise ModelLoadError(f"{path}: no such model file or folder")


def load_model(
    source: str | Path | None = None,
    *,
    dtype: jnp.dtype = jnp.float32,
    quantization: Quantization | str | None = None,
    fused: bool = False,
    kmajor: bool | None = None,
) -> tuple[LoadedModel, Tokenizer]:
    """Loads a base model and its tokenizer.

    Args:
      source: None for the embedded default (SmolLM2-135M-Instruct GGUF), a `.gguf` file, a Hugging
        Face folder (config.json + safetensors), or a folder written by `jaxlora convert`.
      dtype: activation dtype and that of every dense parameter (float32 or bfloat16).
      quantization: "fp8" or "int8" stores the seven projections weight-only quantized
        (jaxlora.model.quant); None keeps them dense, except that a checkpoint converted with a
        quantization loads in its own format.
      fused: hold q|k|v and gate|up as one projection each, the serving layout (jaxlora.model.fused:
        fewer, wider GEMMs per decode step); tensor-parallel engines need False.
      kmajor: the serving layout's quantized projections stored K-major (`qkernel_t`); None: the
        format's default, jaxlora.kernels.KMAJOR_SERVING (jaxlora.model.params.build_model).
    """
    quantization = parse_quantization(quantization)
    layout = dict(dtype=dtype, quantization=quantization, fused=fused, kmajor=kmajor)
    path = default_model_path() if source is None else Path(source)
    if path.is_dir():
        from jaxlora.loading.orbax_ckpt import is_converted, load_converted

        if is_converted(path):
            return load_converted(path, dtype=dtype, quantization=quantization, fused=fused, kmajor=kmajor)
        model = _load_hf(path, **layout)
        return model, tokenizer_from_folder(path, eos_token_ids=model.config.eos_token_ids)
    if path.suffix == ".gguf" or path.is_file():
        from jaxlora.loading.gguf_file import load_gguf_arrays, metadata
        from jaxlora.loading.gguf_tokenizer import tokenizer_from_gguf

        config, arrays, reader = load_gguf_arrays(path, quantization=quantization)
        model = build_model(config, arrays, **layout, source=str(path))
        return model, tokenizer_from_gguf(reader, metadata(reader), source=str(path))
    raise ModelLoadError(f"{path}: no such model file or folder")


def _load_hf(
    path: Path, *, dtype: jnp.dtype, quantization: Quantization | None, fused: bool, kmajor: bool | None
) -> LoadedModel:
    """A Hugging Face folder's model. A dense base goes from the mapped files to the device in one
    pass (jaxlora.loading.hf_placement); a quantized one is read whole and quantized by
    `build_model` (its weights change format on the device, one tensor at a time)."""
    from jaxlora.loading.hf_folder import load_hf_arrays, read_hf_config, safetensors_files

    if quantization is not None:
        config, arrays = load_hf_arrays(path)
        return build_model(
            config, arrays, dtype=dtype, quantization=quantization, fused=fused, kmajor=kmajor, source=str(path)
        )
    from jaxlora.loading.hf_placement import load_hf_placed

    config = read_hf_config(path)
    _, expected = abstract_model(config, dtype, None, fused, kmajor)
    arrays = load_hf_placed(path, safetensors_files(path), config, expected)
    return assemble_model(config, arrays, dtype=dtype, quantization=None, fused=fused, kmajor=kmajor, source=str(path))


def timed_load(source: str | Path | None = None, **kw) -> tuple[LoadedModel, Tokenizer, float]:
    start = time.perf_counter()
    model, tok = load_model(source, **kw)
    return model, tok, time.perf_counter() - start
