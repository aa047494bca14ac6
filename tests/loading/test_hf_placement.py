"""The one-pass Hugging Face loader (jaxlora.loading.hf_placement via `load_model`) against the
older host path (`load_hf_arrays` + `build_model`, which shares no placement code with it), and
the errors bad folders give before anything is placed."""

import struct

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxlora.errors import ModelLoadError
from jaxlora.loading import load_model
from jaxlora.loading.hf_folder import load_hf_arrays
from jaxlora.loading.hf_writer import save_hf_folder
from jaxlora.loading.names import flat_to_hf
from jaxlora.model.params import build_model, random_model
from jaxlora.safetensors_map import map_file
from tests.factories import save_sharded, tiny_config, word_tokenizer


@pytest.fixture(
    scope="module", params=[{}, {"tie_word_embeddings": False, "attention_bias": True}], ids=["tied", "untied-qkv-bias"]
)
def tiny(request):
    return random_model(tiny_config(num_layers=3, **request.param), seed=11)


def _hf_tensors(model, dtype=np.float32) -> dict[str, np.ndarray]:
    flat = {k: np.asarray(v).astype(dtype) for k, v in model.flat_params().items()}
    return {k: np.ascontiguousarray(v) for k, v in flat_to_hf(flat, model.config).items()}


def _folder(tmp_path, model, tensors=None):
    save_hf_folder(model, word_tokenizer(), tmp_path)
    if tensors is not None:
        save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path


def _same(a, b) -> None:
    fa, fb = a.flat_params(), b.flat_params()
    assert fa.keys() == fb.keys()
    for k in fa:
        assert fa[k].dtype == fb[k].dtype, k
        np.testing.assert_array_equal(np.asarray(fa[k]), np.asarray(fb[k]), err_msg=k)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "separate"])
@pytest.mark.parametrize(
    "file_dtype,dtype",
    [
        (np.float32, jnp.float32),
        (ml_dtypes.bfloat16, jnp.bfloat16),
        (np.float32, jnp.bfloat16),
        (np.float16, jnp.float32),
    ],
    ids=["f32", "bf16", "f32-to-bf16", "f16-to-f32"],
)
def test_matches_the_host_path(tiny, tmp_path, fused, file_dtype, dtype):
    folder = _folder(tmp_path, tiny, _hf_tensors(tiny, file_dtype))
    model, _ = load_model(folder, dtype=dtype, fused=fused)
    config, arrays = load_hf_arrays(folder)
    reference = build_model(config, arrays, dtype=dtype, fused=fused)
    assert model.fused == fused and model.dtype == jnp.dtype(dtype)
    _same(model, reference)


def test_sharded_folder_and_unused_buffers(tiny, tmp_path):
    save_hf_folder(tiny, word_tokenizer(), tmp_path)
    (tmp_path / "model.safetensors").unlink()
    tensors = _hf_tensors(tiny)
    # Rotary buffers (old checkpoints) are skipped; a tied model's lm_head.weight is the embedding.
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
    if tiny.config.tie_word_embeddings:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + 1
    save_sharded(tmp_path, tensors, ("a.safetensors", "b.safetensors"))
    _same(load_model(tmp_path, fused=True)[0], tiny)


def test_missing_layer_is_named(tiny, tmp_path):
    tensors = _hf_tensors(tiny)
    del tensors["model.layers.2.mlp.up_proj.weight"]
    with pytest.raises(ModelLoadError, match=r"missing tensor for layer\(s\) \[2\] of layers\.mlp\.up_proj\.kernel"):
        load_model(_folder(tmp_path, tiny, tensors), fused=True)


def test_missing_global_tensor_is_named(tiny, tmp_path):
    tensors = _hf_tensors(tiny)
    del tensors["model.norm.weight"]
    with pytest.raises(ModelLoadError, match=r"missing tensor\(s\) \['model\.norm\.weight'\]"):
        load_model(_folder(tmp_path, tiny, tensors))


def test_unexpected_tensor_is_named(tiny, tmp_path):
    tensors = _hf_tensors(tiny)
    tensors["model.layers.3.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"]  # a 4th layer
    with pytest.raises(ModelLoadError, match=r"unexpected tensor model\.layers\.3\.mlp\.up_proj\.weight"):
        load_model(_folder(tmp_path, tiny, tensors), fused=True)


def test_misplaced_fused_rows_are_refused(tmp_path):
    """Rows moved from q to k: the fused q|k|v width still adds up, the pieces do not."""
    model = random_model(tiny_config(num_layers=2, num_heads=4, num_kv_heads=1), seed=3)
    tensors = _hf_tensors(model)
    q, k = "model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"
    tensors[q], tensors[k] = tensors[q][:16], np.concatenate([tensors[k], tensors[q][16:]])
    with pytest.raises(
        ModelLoadError, match=r"tensor model\.layers\.1\.self_attn\.q_proj\.weight has shape \(16, 32\)"
    ):
        load_model(_folder(tmp_path, model, tensors), fused=True)


def test_integer_weights_are_refused(tiny, tmp_path):
    tensors = _hf_tensors(tiny)
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name].astype(np.int8)
    with pytest.raises(ModelLoadError, match=rf"{name} has dtype int8; a dense base loads from bf16, f16, f32 or f64"):
        load_model(_folder(tmp_path, tiny, tensors))


def test_tensor_in_two_shards_is_refused(tiny, tmp_path):
    save_hf_folder(tiny, word_tokenizer(), tmp_path)
    tensors = _hf_tensors(tiny)
    save_file({"model.norm.weight": tensors["model.norm.weight"]}, str(tmp_path / "extra.safetensors"))
    with pytest.raises(ModelLoadError, match=r"tensor model\.norm\.weight is also in"):
        load_model(tmp_path)


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda b: b[: len(b) // 2], r"do not hold"),
        (lambda b: b[:5], r"shorter than its header length"),
        (lambda b: struct.pack("<Q", 1 << 40) + b[8:], r"header length"),
        (
            lambda b: b[:8] + b"{" * (struct.unpack("<Q", b[:8])[0]) + b[8 + struct.unpack("<Q", b[:8])[0] :],
            "invalid header",
        ),
    ],
    ids=["truncated", "no-header", "huge-header", "bad-json"],
)
def test_damaged_file_names_the_file(tiny, tmp_path, damage, message):
    save_hf_folder(tiny, word_tokenizer(), tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(damage(f.read_bytes()))
    with pytest.raises(ModelLoadError, match=rf"model\.safetensors: cannot read safetensors file \(.*{message}"):
        load_model(tmp_path)


def _raw_file(path, header: bytes, data: bytes = b"\0" * 16) -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


@pytest.mark.parametrize(
    "header,message",
    [
        (b"[" * 200_000, "invalid header: RecursionError"),
        (b'{"t": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 4]}}', "invalid header"),
        (b'{"t": {"dtype": "F32", "shape": [Infinity], "data_offsets": [0, 4]}}', "malformed shape"),
        (b'{"t": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}}', "malformed shape"),
        (b'{"t": {"dtype": "F32", "shape": [1], "data_offsets": [false, true]}}', "malformed shape"),
        (b'{"t": {"dtype": "F32", "shape": [4611686018427387904, 4], "data_offsets": [0, 0]}}', "malformed shape"),
        (b'{"t": {"dtype": "F32", "shape": [1099511627776, 1099511627776], "data_offsets": [0, 0]}}', "do not hold"),
        (b'{"t": {"dtype": "X9", "shape": [1], "data_offsets": [0, 4]}}', "dtype X9 is not supported"),
        (b'{"t": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}', "malformed dtype"),
        (b'{"t": "F32"}', "not an entry with dtype, shape and data_offsets"),
        (b'["t"]', "not a JSON object"),
    ],
    ids=[
        "deep",
        "huge-int",
        "infinity",
        "float",
        "bools",
        "too-large",
        "overflowing-product",
        "dtype",
        "dtype-list",
        "entry",
        "list",
    ],
)
def test_damaged_header_is_a_load_error(tmp_path, header, message):
    path = tmp_path / "t.safetensors"
    _raw_file(path, header)
    with pytest.raises(ModelLoadError, match=rf"t\.safetensors: cannot read safetensors file \(.*{message}"):
        map_file(path)


def test_mapped_views_equal_the_library_reads(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "bf16": rng.standard_normal((5, 7)).astype(ml_dtypes.bfloat16),
        "f16": rng.standard_normal((3,)).astype(np.float16),
        "f32": rng.standard_normal((2, 3, 4)).astype(np.float32),
        "i8": rng.integers(-100, 100, (9,)).astype(np.int8),
        "scalar": np.array(3.5, np.float32),
    }
    path = tmp_path / "t.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    mapped = map_file(path)
    with safe_open(str(path), framework="numpy") as st:
        assert sorted(mapped) == sorted(st.keys())
        for name in st.keys():
            view = mapped[name].array()
            assert not view.flags.writeable
            np.testing.assert_array_equal(view, st.get_tensor(name))
            assert view.dtype == st.get_tensor(name).dtype
