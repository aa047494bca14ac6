"""Tiny model, byte-level tokenizer and random adapters for engine tests (fast on CPU)."""

from __future__ import annotations

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from jaxlora.config import TARGET_MODULES, LoraConfig, ModelConfig
from jaxlora.lora.host_adapter import HostAdapter
from jaxlora.model.params import LoadedModel, abstract_model, build_model
from jaxlora.tokenizer import Tokenizer

SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")
EOS = 2
CHARS = "".join(chr(c) for c in range(32, 127))  # printable ASCII, one token each
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def char_tokenizer() -> Tokenizer:
    """One token per printable ASCII character (ids 4..98) after four special tokens, so every
    generated token decodes to exactly one visible character."""
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    vocab.update({c: len(SPECIALS) + i for i, c in enumerate(CHARS)})
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", fuse_unk=False))
    hf.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    hf.decoder = decoders.Fuse()
    hf.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return Tokenizer(hf=hf, chat_template=CHAT_TEMPLATE, eos_token_ids=(EOS,), bos_token_id=1, add_bos=True)


def tiny_model_config(**overrides) -> ModelConfig:
    base = dict(
        vocab_size=len(SPECIALS) + len(CHARS),
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_ids=(EOS,),
        bos_token_id=1,
    )
    base.update(overrides)
    return ModelConfig(**base)


def tiny_model(seed: int = 0, **overrides) -> LoadedModel:
    """Random weights drawn on the host (fast). Large-ish scales keep greedy choices well separated,
    so batching's float reordering never flips an argmax."""
    config = tiny_model_config(**overrides)
    _, expected = abstract_model(config, np.float32)
    rng = np.random.default_rng(seed)
    arrays = {}
    for name, spec in expected.items():
        if name.endswith("scale"):  # RMSNorm
            arrays[name] = np.ones(spec.shape, np.float32)
        else:
            fan_in = spec.shape[-2] if "kernel" in name else 1
            arrays[name] = rng.normal(0, 1 / np.sqrt(fan_in), spec.shape).astype(np.float32)
    return build_model(config, arrays)


def random_adapter(
    name: str, config: ModelConfig, lora: LoraConfig, *, seed: int, rank: int = 4, scale: float = 2.0
) -> HostAdapter:
    """Random A and B on every bank module; large enough to change greedy outputs."""
    rng = np.random.default_rng(seed)
    weights = {}
    for m in lora.target_modules:
        d_in, d_out = config.module_shape(m)
        a = rng.normal(0, scale / np.sqrt(d_in), (config.num_layers, d_in, rank)).astype(np.float32)
        b = rng.normal(0, scale, (config.num_layers, rank, d_out)).astype(np.float32)
        weights[m] = (a, b)
    return HostAdapter(
        name=name,
        rank=rank,
        target_modules=tuple(m for m in TARGET_MODULES if m in weights),
        weights=weights,
        source=f"<random {seed}>",
    )
