"""Hugging Face `config.json` -> ModelConfig, for the Llama family."""

from __future__ import annotations

from typing import Any

from jaxlora.config import ModelConfig, RopeScaling
from jaxlora.errors import ModelLoadError

# model_type -> (q/k/v bias, o bias) when the config does not say.
SUPPORTED_MODEL_TYPES = {"llama": None, "mistral": None, "qwen2": (True, False)}


def model_config_from_hf(cfg: dict[str, Any], *, source: str) -> ModelConfig:
    """Builds a ModelConfig from a parsed HF config; raises ModelLoadError for unsupported ones."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"{source}: unsupported architecture model_type={model_type!r} "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{source}: unsupported hidden_act={cfg['hidden_act']!r} (only silu)")
    if model_type == "mistral" and cfg.get("sliding_window") not in (None, 0):
        if cfg["sliding_window"] < cfg.get("max_position_embeddings", 0):
            raise ModelLoadError(
                f"{source}: sliding-window attention (sliding_window={cfg['sliding_window']}) is not supported"
            )
    try:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        bias = SUPPORTED_MODEL_TYPES[model_type]
        qkv_bias, o_bias = bias if bias else (bool(cfg.get("attention_bias", False)),) * 2
        eos = cfg.get("eos_token_id")
        rope = cfg.get("rope_parameters") or {}
        return ModelConfig(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            rope_scaling=_rope_scaling(cfg.get("rope_scaling") or rope, source),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            o_proj_bias=o_bias,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
            name=str(cfg.get("_name_or_path") or model_type),
        )
    except KeyError as e:
        raise ModelLoadError(f"{source}: config.json lacks required field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{source}: invalid config.json: {e}") from None


def _rope_scaling(rs: dict[str, Any], source: str) -> RopeScaling | None:
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ModelLoadError(f"{source}: unsupported rope scaling type {kind!r} (supported: llama3)")
    return RopeScaling(
        factor=float(rs["factor"]),
        low_freq_factor=float(rs["low_freq_factor"]),
        high_freq_factor=float(rs["high_freq_factor"]),
        original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
    )
