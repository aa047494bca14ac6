"""Small shared builders for tests (tiny configs, random models)."""

from __future__ import annotations

from jaxlora.config import ModelConfig


def tiny_config(**overrides) -> ModelConfig:
    base = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
                max_position_embeddings=128, tie_word_embeddings=True, eos_token_ids=(2,), bos_token_id=1)
    base.update(overrides)
    return ModelConfig(**base)
