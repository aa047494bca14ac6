"""Every tiny model, adapter and tokenizer the tests build (fast on CPU). Import from here.

Models: two shapes, one builder each.
  tiny_config()      vocabulary 96, tied embeddings: model-level tests, with `word_tokenizer`;
                     drawn with `jaxlora.model.params.random_model`, or `confident_model`.
  char_config()      the same layers over `char_tokenizer`'s 99 ids, untied: engine, CLI and
                     serving tests, drawn with `tiny_model` (host draw, greedy choices well apart).
Adapters: `random_adapter` (one, on given modules) and `random_adapters` (many, random ranks and
module subsets), A and B drawn at fan-in scale so that an adapter changes greedy outputs.
Tokenizers: `char_tokenizer` (one visible character per token) and `word_tokenizer` (`w<id>` words).
Files: `save_sharded` (a sharded Hugging Face weights folder).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from jaxlora.config import TARGET_MODULES, LoraConfig, ModelConfig
from jaxlora.lora.host_adapter import HostAdapter
from jaxlora.model.params import LoadedModel, abstract_model, build_model, random_model
from jaxlora.tokenizer import Tokenizer

# Tokenizers.

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


def word_tokenizer(vocab_size: int = 96) -> Tokenizer:
    """A word-level tokenizer over `w0 .. w{n-1}` (ids = numbers) with a trivial chat template."""
    vocab = {f"w{i}": i for i in range(vocab_size)}
    hf = HFTokenizer(models.WordLevel(vocab, unk_token="w0"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    return Tokenizer(
        hf=hf,
        chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}",
        eos_token_ids=(EOS,),
        bos_token_id=1,
    )


# Models.


def tiny_config(**overrides) -> ModelConfig:
    base = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        eos_token_ids=(EOS,),
        bos_token_id=1,
    )
    base.update(overrides)
    return ModelConfig(**base)


def char_config(**overrides) -> ModelConfig:
    """`tiny_config`'s layers over `char_tokenizer`'s vocabulary, with an untied LM head."""
    base = dict(
        vocab_size=len(SPECIALS) + len(CHARS),
        intermediate_size=64,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    base.update(overrides)
    return tiny_config(**base)


def tiny_model(seed: int = 0, **overrides) -> LoadedModel:
    """A `char_config` model with random weights drawn on the host (fast). Large-ish scales keep
    greedy choices well separated, so batching's float reordering never flips an argmax."""
    config = char_config(**overrides)
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


def confident_model(seed: int = 3) -> LoadedModel:
    """A `tiny_config` random model whose (tied) embeddings are large enough for confident
    predictions: with the default N(0, 0.02) init no logit can exceed ~0.7, so training an adapter
    could hardly lower the loss."""
    model = random_model(tiny_config(), seed=seed)
    arrays = {k: v * 25.0 if k == "embed_tokens.embedding" else v for k, v in model.flat_params().items()}
    return build_model(model.config, arrays)


# Adapters.


def tiny_lora(**overrides) -> LoraConfig:
    base = dict(max_slots=8, max_rank=4, target_modules=("q_proj", "v_proj", "o_proj", "down_proj"))
    base.update(overrides)
    return LoraConfig(**base)


def random_adapter(
    name: str,
    config: ModelConfig,
    *,
    modules: tuple[str, ...],
    rank: int = 4,
    rng: np.random.Generator | int,
    scale: float = 2.0,
) -> HostAdapter:
    """One adapter on `modules` at `rank`: A ~ N(0, scale / sqrt(in)), B ~ N(0, scale), float32,
    never zero; large enough to change greedy outputs. `rng`: a generator, or a seed for a fresh one."""
    rng = np.random.default_rng(rng) if isinstance(rng, int) else rng
    weights = {}
    for m in modules:
        d_in, d_out = config.module_shape(m)
        a = rng.normal(0, scale / np.sqrt(d_in), (config.num_layers, d_in, rank)).astype(np.float32)
        b = rng.normal(0, scale, (config.num_layers, rank, d_out)).astype(np.float32)
        weights[m] = (a, b)
    return HostAdapter(
        name=name,
        rank=rank,
        target_modules=tuple(m for m in TARGET_MODULES if m in weights),
        weights=weights,
        source=f"random:{name}",
    )


def random_adapters(
    num: int,
    config: ModelConfig | None = None,
    lora: LoraConfig | None = None,
    *,
    seed: int = 0,
    prefix: str = "lora",
) -> list[HostAdapter]:
    """`num` adapters named `{prefix}-{i}` (default shapes: `tiny_config`, `tiny_lora`), each of a
    random rank 1..max_rank on a random non-empty subset of the LoRA config's modules.

    1,000 adapters on `tiny_config()` take well under a second.
    """
    config = config or tiny_config()
    lora = lora or tiny_lora()
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num):
        rank = int(rng.integers(1, lora.max_rank + 1))
        mask = rng.random(len(lora.target_modules)) < 0.6
        mask[rng.integers(len(mask))] = True
        modules = tuple(m for m, keep in zip(lora.target_modules, mask) if keep)
        out.append(random_adapter(f"{prefix}-{i}", config, rank=rank, modules=modules, rng=rng))
    return out


# Files.


def save_sharded(folder: Path, tensors: dict[str, np.ndarray], shard_names: tuple[str, str]) -> None:
    """`tensors` as two safetensors shards (alternate names, sorted) and the index that lists them,
    as a sharded Hugging Face folder holds its weights."""
    names = sorted(tensors)
    shards = dict(zip(shard_names, (names[::2], names[1::2])))
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(folder / fname))
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
