"""Loaders: HF folders (single and sharded), GGUF (q/k un-permutation, tied embeddings), orbax,
and the errors bad files give."""

import json
from pathlib import Path

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxlora.errors import ModelLoadError
from jaxlora.loading import load_model
from jaxlora.loading.gguf_file import load_gguf_arrays
from jaxlora.loading.hf_folder import load_hf_arrays
from jaxlora.loading.hf_writer import save_hf_folder
from jaxlora.loading.names import flat_to_hf
from jaxlora.loading.orbax_ckpt import save_converted
from jaxlora.model import init_kv_cache
from jaxlora.model.forward import forward_logits
from jaxlora.model.params import build_model, random_model
from tests.factories import save_sharded, tiny_config, word_tokenizer

TOKENS = jnp.array([[3, 17, 42, 5, 88, 9, 1]])


def _logits(model) -> np.ndarray:
    kv = init_kv_cache(model.config, 1, 16)
    pos = jnp.arange(TOKENS.shape[1])[None]
    return np.asarray(forward_logits(model.graphdef, model.params, TOKENS, pos, kv)[0])


@pytest.fixture(
    scope="module", params=[{}, {"tie_word_embeddings": False, "attention_bias": True}], ids=["tied", "untied-qkv-bias"]
)
def tiny(request):
    return random_model(tiny_config(**request.param), seed=7)


def test_hf_folder_round_trip(tiny, tmp_path):
    save_hf_folder(tiny, word_tokenizer(), tmp_path)
    loaded, tok = load_model(tmp_path)
    assert loaded.config == tiny.config
    np.testing.assert_array_equal(_logits(loaded), _logits(tiny))
    assert tok.encode("w5 w7") == [5, 7]


def test_sharded_hf_folder(tiny, tmp_path):
    save_hf_folder(tiny, None, tmp_path)
    tensors = flat_to_hf({k: np.asarray(v) for k, v in tiny.flat_params().items()}, tiny.config)
    (tmp_path / "model.safetensors").unlink()
    save_sharded(tmp_path, tensors, ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"))
    config, arrays = load_hf_arrays(tmp_path)
    np.testing.assert_array_equal(_logits(build_model(config, arrays)), _logits(tiny))


def test_truncated_safetensors_names_the_file(tiny, tmp_path):
    save_hf_folder(tiny, None, tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: cannot read safetensors file"):
        load_hf_arrays(tmp_path)


def test_missing_tensor_is_named(tiny, tmp_path):
    save_hf_folder(tiny, None, tmp_path)
    tensors = flat_to_hf({k: np.asarray(v) for k, v in tiny.flat_params().items()}, tiny.config)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing tensor for layer\(s\) \[1\] of layers\.mlp\.down_proj"):
        load_hf_arrays(tmp_path)


def test_unsupported_hf_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(ModelLoadError, match=r"config\.json: unsupported architecture model_type='gpt2'"):
        load_model(tmp_path)


def test_pickle_only_folder_is_refused(tiny, tmp_path):
    save_hf_folder(tiny, None, tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="only pickle weights"):
        load_hf_arrays(tmp_path)


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    # llama.cpp's convert-time permutation (HF row order -> interleaved RoPE order), written
    # independently of the loader's inverse.
    out = np.empty_like(w)
    head_dim = w.shape[0] // n_heads
    for h in range(n_heads):
        rows = w[h * head_dim : (h + 1) * head_dim]
        half = head_dim // 2
        for i in range(half):
            out[h * head_dim + 2 * i] = rows[i]
            out[h * head_dim + 2 * i + 1] = rows[half + i]
    return out


def _write_gguf(
    path: Path, model, arch: str = "llama", projection_type: gguf.GGMLQuantizationType | None = None
) -> None:
    """`model` as a GGUF file; projection_type stores the seven projections in that quantized type."""
    cfg = model.config
    hf = flat_to_hf({k: np.asarray(v) for k, v in model.flat_params().items()}, cfg)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_vocab_size(cfg.vocab_size)
    tokens = ["<unk>", "<s>", "</s>"] + [chr(ord("a") + i % 26) * (1 + i // 26) for i in range(cfg.vocab_size - 3)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (cfg.vocab_size - 3))
    w.add_token_merges([])
    w.add_eos_token_id(2)
    names = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    w.add_tensor("token_embd.weight", hf["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", hf["model.norm.weight"])
    for i in range(cfg.num_layers):
        for hf_name, g_name in names.items():
            t = hf[f"model.layers.{i}.{hf_name}.weight"]
            if g_name == "attn_q":
                t = _permute(t, cfg.num_heads)
            elif g_name == "attn_k":
                t = _permute(t, cfg.num_kv_heads)
            t = np.ascontiguousarray(t)
            if projection_type is not None and "norm" not in g_name:
                w.add_tensor(
                    f"blk.{i}.{g_name}.weight", gguf.quants.quantize(t, projection_type), raw_dtype=projection_type
                )
            else:
                w.add_tensor(f"blk.{i}.{g_name}.weight", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_unpermutes_qk_and_ties_embeddings(tmp_path):
    model = random_model(tiny_config(), seed=11)
    _write_gguf(tmp_path / "tiny.gguf", model)
    loaded, tok = load_model(tmp_path / "tiny.gguf")
    assert loaded.config.tie_word_embeddings
    np.testing.assert_allclose(_logits(loaded), _logits(model), atol=1e-5, rtol=1e-5)
    assert tok.eos_token_ids == (2,)


def test_gguf_unsupported_architecture(tmp_path):
    model = random_model(tiny_config(), seed=11)
    _write_gguf(tmp_path / "other.gguf", model, arch="gpt2")
    with pytest.raises(ModelLoadError, match=r"other\.gguf: unsupported GGUF architecture 'gpt2'"):
        load_gguf_arrays(tmp_path / "other.gguf")


def test_not_a_gguf(tmp_path):
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match=r"bad\.gguf: not a readable GGUF file"):
        load_model(tmp_path / "bad.gguf")


def test_orbax_round_trip(tiny, tmp_path):
    save_converted(tiny, word_tokenizer(), tmp_path / "ckpt")
    loaded, tok = load_model(tmp_path / "ckpt")
    assert loaded.config == tiny.config
    np.testing.assert_array_equal(_logits(loaded), _logits(tiny))
    assert tok.chat_template is not None
    with pytest.raises(FileExistsError):
        save_converted(tiny, word_tokenizer(), tmp_path / "ckpt")
