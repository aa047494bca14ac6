"""GGUF files (llama.cpp): metadata -> ModelConfig, dequantized tensors -> flat parameters.

GGUF stores the q/k projection rows permuted for llama.cpp's interleaved RoPE. Adapters are trained
against Hugging Face's row order (rotate-half RoPE), so q/k rows are un-permuted here.

With a quantization the seven projections are quantized layer by layer as they are read, so a
quantized model never exists in float on the device. A Q8_0 tensor loads into int8 without a float
detour: Q8_0 stores each row ([out, in]) as blocks of 32 int8 values q_b with one float16 scale d_b
(w = d_b * q_b). A per-output-channel int8 layout has one scale per row, so the row's scale becomes

    scale = max_b |d_b| * max |q_b| / 127        (the row's largest |w|, over 127)

and each block's integers are rescaled to it, q = round(q_b * d_b / scale). The block holding the
row's largest weight keeps its integers exactly; a block with a smaller d_b loses resolution (at most
scale / 2 per weight, the int8 bound). The result equals int8-quantizing the dequantized row, bit for
bit, without building that float row first.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from jaxlora.config import ModelConfig, RopeScaling
from jaxlora.errors import ModelLoadError
from jaxlora.loading.gguf_reader import GGUFFile, read_gguf
from jaxlora.loading.names import stack_layers
from jaxlora.model.quant import Quantization, quantize

SUPPORTED_ARCHITECTURES = ("llama",)
Q = gguf.GGMLQuantizationType
SUPPORTED_TYPES = frozenset(
    {
        Q.F32,
        Q.F16,
        Q.BF16,
        Q.Q4_0,
        Q.Q4_1,
        Q.Q5_0,
        Q.Q5_1,
        Q.Q8_0,
        Q.Q2_K,
        Q.Q3_K,
        Q.Q4_K,
        Q.Q5_K,
        Q.Q6_K,
    }
)

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
_Q8_0_BLOCK_BYTES = 2 + 32  # float16 scale, then 32 int8 values


def open_gguf(path: Path) -> GGUFFile:
    """The parsed file (`jaxlora.loading.gguf_reader`); ModelLoadError if it is missing or unreadable."""
    return read_gguf(path)


def metadata(reader: GGUFFile) -> dict[str, Any]:
    """All key/value metadata except the big tokenizer arrays (read those with `field_array`)."""
    skip = {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"}
    return {k: v for k, v in reader.fields.items() if k not in skip}


def field_array(reader: GGUFFile, key: str) -> list | None:
    return reader.fields.get(key)


def config_from_gguf(meta: dict[str, Any], has_output: bool, *, source: str) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{source}: unsupported GGUF architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
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


def q8_0_to_int8(tensor: Any) -> tuple[np.ndarray, np.ndarray]:
    """A Q8_0 matrix as per-row int8 (q [out, in], scale [out] float32); see the module doc."""
    rows = tensor.data.shape[0]
    blocks = np.ascontiguousarray(tensor.data).reshape(rows, -1, _Q8_0_BLOCK_BYTES)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)  # [out, blocks]
    qs = blocks[..., 2:].copy().view(np.int8)  # [out, blocks, 32]
    amax = (np.abs(d) * np.abs(qs.astype(np.float32)).max(axis=-1)).max(axis=-1)  # [out]
    scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    # The same float32 operations, in the same order, as quantize() on the dequantized row.
    w = d[..., None] * qs.astype(np.float32)
    q = np.clip(np.round(w / scale[:, None, None]), -127, 127).astype(np.int8)
    return q.reshape(rows, -1), scale


def _quantized_rows(tensor: Any, quantization: Quantization, *, source: str) -> tuple[np.ndarray, np.ndarray]:
    """A projection tensor as (q [out, in], scale [out]) of the given format."""
    if quantization is Quantization.INT8 and Q(tensor.tensor_type) == Q.Q8_0:
        return q8_0_to_int8(tensor)
    q, scale = quantize(dequantize(tensor, source=source).T, quantization)  # [in, out] in, [out] scales
    return np.asarray(q).T, np.asarray(scale)


def read_gguf_config(path: Path) -> ModelConfig:
    """The file's ModelConfig, from its metadata and tensor names (no tensor data read)."""
    reader = open_gguf(path)
    return config_from_gguf(metadata(reader), any(t.name == "output.weight" for t in reader.tensors), source=str(path))


def load_gguf_arrays(
    path: Path, *, quantization: Quantization | None = None
) -> tuple[ModelConfig, dict[str, np.ndarray], GGUFFile]:
    """(config, flat parameter arrays, the open reader for the tokenizer).

    Arrays are float32, except the projections' `qkernel` / `qscale` with a quantization.
    """
    reader = open_gguf(path)
    names = {t.name for t in reader.tensors}
    config = config_from_gguf(metadata(reader), "output.weight" in names, source=str(path))
    per_layer: dict[str, list[np.ndarray | None]] = {}
    flat: dict[str, np.ndarray] = {}
    heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}
    for t in reader.tensors:
        m = _BLOCK_RE.match(t.name)
        if m and m.group(2) in _BLOCK_TENSORS and int(m.group(1)) < config.num_layers:
            kind, layer = m.group(2), int(m.group(1))
            name, transpose = _BLOCK_TENSORS[kind]
            if transpose and quantization is not None:
                # Rows are output channels: the permutation moves each row's scale with it.
                q, scale = (
                    unpermute_rope_rows(a, heads[kind]) if kind in heads else a
                    for a in _quantized_rows(t, quantization, source=str(path))
                )
                prefix = name.removesuffix(".kernel")
                per_layer.setdefault(f"{prefix}.qkernel", [None] * config.num_layers)[layer] = q.T
                per_layer.setdefault(f"{prefix}.qscale", [None] * config.num_layers)[layer] = scale
                continue
            w = dequantize(t, source=str(path))
            if kind in heads:
                w = unpermute_rope_rows(w, heads[kind])
            per_layer.setdefault(name, [None] * config.num_layers)[layer] = w.T if transpose else w
            continue
        w = dequantize(t, source=str(path))
        if t.name == "token_embd.weight":
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
