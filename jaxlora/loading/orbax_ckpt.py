"""Converted checkpoints: params saved with orbax next to config and tokenizer, for fast restarts.

Folder layout:
    jaxlora_model.json   {"format": 1, "config": ModelConfig fields, "dtype": "float32",
                          "quantization": null | "fp8" | "int8"}
    params/              orbax StandardCheckpointer tree of flat name -> array (a quantized model's
                         projections as `qkernel` in int8 / float8_e4m3fn and `qscale` in float32)
    tokenizer.json, tokenizer_config.json
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jaxlora.config import ModelConfig, RopeScaling
from jaxlora.errors import ModelLoadError
from jaxlora.model.params import LoadedModel, abstract_model, build_model
from jaxlora.model.quant import Quantization, parse_quantization
from jaxlora.tokenizer import Tokenizer, save_tokenizer, tokenizer_from_folder

MARKER = "jaxlora_model.json"
FORMAT_VERSION = 1


def is_converted(folder: Path) -> bool:
    return (folder / MARKER).is_file()


def save_converted(model: LoadedModel, tokenizer: Tokenizer, out: Path) -> None:
    out = out.resolve()
    if (out / "params").exists():
        raise FileExistsError(f"{out} already holds a converted checkpoint; choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    cfg = dataclasses.asdict(model.config)
    meta = {
        "format": FORMAT_VERSION,
        "config": cfg,
        "dtype": jnp.dtype(model.dtype).name,
        "quantization": None if model.quantization is None else model.quantization.value,
    }
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(out / "params", model.flat_params())
    save_tokenizer(tokenizer, out)
    (out / MARKER).write_text(json.dumps(meta, indent=2))


def _config_from_dict(d: dict) -> ModelConfig:
    d = dict(d)
    if d.get("rope_scaling"):
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
    return ModelConfig(**d)


def read_converted_config(folder: Path) -> ModelConfig:
    """The checkpoint's ModelConfig, from its metadata file alone."""
    return _read_meta(folder)[1]


def _read_meta(folder: Path) -> tuple[dict, ModelConfig]:
    """(the metadata file's dict, its config); ModelLoadError for a bad or foreign-format file."""
    try:
        meta = json.loads((folder / MARKER).read_text())
        if meta.get("format") != FORMAT_VERSION:
            raise ModelLoadError(f"{folder}: checkpoint format {meta.get('format')} != {FORMAT_VERSION}")
        return meta, _config_from_dict(meta["config"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{folder / MARKER}: invalid metadata ({e})") from None


def load_converted(
    folder: Path,
    *,
    dtype: jnp.dtype | None = None,
    quantization: Quantization | None = None,
    fused: bool = False,
    kmajor: bool | None = None,
) -> tuple[LoadedModel, Tokenizer]:
    """The checkpoint's model in `dtype` (default: the saved one); fused: in the serving layout
    (jaxlora.model.fused; checkpoints always hold the canonical one, [in, out]), its quantized
    weights stored K-major where `kmajor` says (jaxlora.model.params.build_model).

    quantization: quantize a dense checkpoint's projections at load; for a quantized checkpoint it
    must be None or its own format (re-quantizing quantized weights would compound two errors).
    """
    meta, config = _read_meta(folder)
    try:
        saved_quantization = parse_quantization(meta.get("quantization"))
    except ValueError as e:
        raise ModelLoadError(f"{folder / MARKER}: invalid metadata ({e})") from None
    if saved_quantization is not None and quantization not in (None, saved_quantization):
        raise ModelLoadError(
            f"{folder}: the checkpoint holds {saved_quantization} weights; it cannot be loaded "
            f"as {quantization} (convert the dense source with --quantize {quantization})"
        )
    saved = jnp.dtype(meta.get("dtype", "float32"))
    _, expected = abstract_model(config, saved, saved_quantization)
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in expected.items()}
    try:
        with ocp.StandardCheckpointer() as ckpt:
            arrays = ckpt.restore((folder / "params").resolve(), target)
    except Exception as e:
        raise ModelLoadError(f"{folder}: cannot restore params ({type(e).__name__}: {e})") from None
    model = build_model(
        config,
        arrays,
        dtype=dtype or saved,
        quantization=quantization or saved_quantization,
        fused=fused,
        kmajor=kmajor,
        source=str(folder),
    )
    return model, tokenizer_from_folder(folder, eos_token_ids=config.eos_token_ids)
