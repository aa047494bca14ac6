"""The `s70` setting of benchmarks/serving/trace.py: a Llama-3-70B-shape base in FP8 on one GPU.

The base's projections are FP8 (e4m3, per-channel scales), drawn on the device in that format
(`benchmarks.common.random_fp8_model`: 80 layers, ~70 GB, never a bf16 copy); 32 rank-16 adapters on
q/k/v/o, all resident; the engine is the 7B preset's (configs/llama2-7b-h200.yaml) with its KV pool
sized from the memory the base and bank leave, and its layers scanned (80 unrolled layers would cost
minutes of compile per token budget).

Each row carries its physical bound, from rates measured in the same process (`measure`):

    compute  per request 2 * (prompt + output) * projection weights + 2 * output * LM head
             + causal attention (2 * 2 * L * H * Dh * (prompt + output)^2 / 2), at the FP8 matmul rate
    bytes    per generated token: the step's weight bytes (1-byte projections + scales, bf16 head)
             over the step's decode rows (the row's decode_tokens_per_step), its KV prefix at the
             mean context (prompt + output / 2), and the distinct adapters of the step (at most 32)
             over its rows; at the HBM copy rate
    bound_req_s = 1 / max(compute seconds, bytes seconds) per request (the two overlap at best)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax.numpy as jnp

from benchmarks.common import LLAMA3_70B, TINY, hbm_gbps, matmul_tflops_8bit, random_fp8_model
from jaxlora.config import ATTENTION_MODULES, TARGET_MODULES, ModelConfig
from jaxlora.engine.config import EngineConfig
from jaxlora.model.params import LoadedModel

NAME = "s70"
RANK, NUM_ADAPTERS = 16, 32


def model_config(tiny: bool) -> ModelConfig:
    return TINY if tiny else LLAMA3_70B


def engine_config(preset: EngineConfig, tiny: bool) -> EngineConfig:
    """The size's engine with the pool from memory (num_pages None) and scanned layers (full size)."""
    if tiny:
        return preset
    return dataclasses.replace(preset, num_pages=None, kernels=dataclasses.replace(preset.kernels, unroll_layers=False))


def base_model(config: ModelConfig, dtype: str) -> LoadedModel:
    return random_fp8_model(config, dtype=jnp.dtype(dtype))


def measure(tiny: bool) -> dict[str, float]:
    """The rates the bound divides by, measured on this device."""
    return {
        "hbm_GBps": hbm_gbps(1 << 20 if tiny else 1 << 31),
        "fp8_TFLOPs": matmul_tflops_8bit(256 if tiny else 8192),
    }


def bound(row: Mapping, cfg: ModelConfig, rates: Mapping[str, float]) -> dict:
    """The row's bound fields (module doc) from its mean lengths and decode rows per step."""
    prompt, output = row["mean_prompt_len"] or 0.0, row["mean_output_len"] or 0.0
    rows = max(row.get("decode_tokens_per_step") or 1.0, 1.0)
    projections = cfg.num_layers * sum(math.prod(cfg.module_shape(m)) for m in TARGET_MODULES)
    head = cfg.hidden_size * cfg.vocab_size
    attention = 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * (prompt + output) ** 2 / 2
    flops = 2 * (prompt + output) * projections + 2 * output * head + attention
    scales = 4 * cfg.num_layers * sum(cfg.module_shape(m)[1] for m in TARGET_MODULES)
    weights = projections + scales + 2 * head
    kv_per_position = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    adapter = cfg.num_layers * RANK * sum(sum(cfg.module_shape(m)) for m in ATTENTION_MODULES) * 2
    per_token = weights / rows + (prompt + output / 2) * kv_per_position + min(NUM_ADAPTERS, rows) * adapter / rows
    compute_s = flops / (rates["fp8_TFLOPs"] * 1e12)
    bytes_s = output * per_token / (rates["hbm_GBps"] * 1e9)
    return {
        "bound_req_s": round(1.0 / max(compute_s, bytes_s), 3),
        "bound_compute_req_s": round(1.0 / compute_s, 3),
        "bound_bytes_req_s": round(1.0 / bytes_s, 3),
        **{k: round(v, 4) for k, v in rates.items()},
    }
