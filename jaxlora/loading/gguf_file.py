"""GGUF files (llama.cpp): metadata -> ModelConfig, dequantized tensors -> flat parameters.

GGUF stores the q/k projection rows permuted for llama.cpp's interleaved RoPE. Adapters are trained
against Hugging Face's row order (rotate-half RoPE), so q/k rows are un-permuted here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from jaxlora.config import ModelConfig, RopeScaling
from jaxlora.errors import ModelLoadError
from jaxlora.loading.names import stack_layers

SUPPORTED_ARCHITECTURES = ("llama",)
Q = gguf.GGMLQuantizationType
SUPPORTED_TYPES = frozenset({
    Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
    Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
})

_BLOCK_TENSORS = {
    "attn_norm": ("layers.input_layernorm.scale", False),
    "ffn_norm": ("layers.post_attention_layernorm.scale", False),
    "attn_q": ("layers.self_attn.q_proj.kernel", True),
    "attn_k": ("layers.self_attn.k_proj.kernel", True),
    "attn_v": ("layers.self_attn.v_proj.kernel", True),
    "attn_output": ("layers.self_attn.o_proj.kernel", True),
    "ffn_gate": ("layers.mlp.gate_proj.kernel", True),
    "ffn_up": ("layers.mlp.up_proj.kernel", True),
    "ffn_down": ("layers.mlp.down_proj.kernel", True),
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")


def open_gguf(path: Path) -> gguf.GGUFReader:
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such GGUF file")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError/struct errors on bad files
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """All key/value metadata except the big tokenizer arrays (read those with `field_array`)."""
    skip = {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"}
    return {k: f.contents() for k, f in reader.fields.items() if k not in skip}


def field_array(reader: gguf.GGUFReader, key: str) -> list | None:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def config_from_gguf(meta: dict[str, Any], has_output: bool, *, source: str) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"{source}: unsupported GGUF architecture {arch!r} "
                             f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    try:
        hidden = int(meta[f"{arch}.embedding_length"])
        heads = int(meta[f"{arch}.attention.head_count"])
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return ModelConfig(
            vocab_size=int(meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))),
            hidden_size=hidden,
            intermediate_size=int(meta[f"{arch}.feed_forward_length"]),
            num_layers=int(meta[f"{arch}.block_count"]),
            num_heads=heads,
            num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
            head_dim=int(meta.get(f"{arch}.attention.key_length") or hidden // heads),
            rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=_rope_scaling(meta, arch),
            max_position_embeddings=int(meta.get(f"{arch}.context_length", 4096)),
            tie_word_embeddings=not has_output,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
            name=str(meta.get("general.name", arch)),
        )
    except KeyError as e:
        raise ModelLoadError(f"{source}: GGUF metadata lacks {e.args[0]!r}") from None


def _rope_scaling(meta: dict[str, Any], arch: str) -> RopeScaling | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    raise ModelLoadError(f"unsupported GGUF rope scaling type {kind!r}")


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's convert-time permutation of q/k rows. w: [out, in] -> [out, in]."""
    out_dim = w.shape[0]
    return w.reshape(n_heads, out_dim // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize(tensor: Any, *, source: str) -> np.ndarray:
    """A GGUF tensor as float32 in numpy layout ([out, in] for matrices)."""
    ttype = Q(tensor.tensor_type)
    if ttype not in SUPPORTED_TYPES:
        raise ModelLoadError(f"{source}: tensor {tensor.name} has unsupported type {ttype.name}")
    return np.asarray(gguf.quants.dequantize(tensor.data, ttype), dtype=np.float32)


def load_gguf_arrays(path: Path) -> tuple[ModelConfig, dict[str, np.ndarray], gguf.GGUFReader]:
    """(config, flat float32 parameter arrays, the open reader for the tokenizer)."""
    reader = open_gguf(path)
    names = {t.name for t in reader.tensors}
    config = config_from_gguf(metadata(reader), "output.weight" in names, source=str(path))
    per_layer: dict[str, list[np.ndarray | None]] = {}
    flat: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        w = dequantize(t, source=str(path))
        m = _BLOCK_RE.match(t.name)
        if m and m.group(2) in _BLOCK_TENSORS and int(m.group(1)) < config.num_layers:
            kind = m.group(2)
            if kind == "attn_q":
                w = unpermute_rope_rows(w, config.num_heads)
            elif kind == "attn_k":
                w = unpermute_rope_rows(w, config.num_kv_heads)
            name, transpose = _BLOCK_TENSORS[kind]
            per_layer.setdefault(name, [None] * config.num_layers)[int(m.group(1))] = w.T if transpose else w
        elif t.name == "token_embd.weight":
            flat["embed_tokens.embedding"] = w
        elif t.name == "output_norm.weight":
            flat["norm.scale"] = w
        elif t.name == "output.weight":
            flat["lm_head.kernel"] = w.T
        elif t.name == "rope_freqs.weight":
            raise ModelLoadError(f"{path}: per-dimension rope_freqs are not supported")
        else:
            raise ModelLoadError(f"{path}: unexpected tensor {t.name}")
    flat.update(stack_layers(per_layer, source=str(path)))
    return config, flat, reader
