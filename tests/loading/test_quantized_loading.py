"""Loading a quantized base: GGUF Q8_0 straight into int8 + scales, any source quantized at load, and
quantized orbax checkpoints (what `jaxlora convert --quantize` writes)."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

import jaxlora.loading.gguf_file as gguf_file
from jaxlora.errors import ModelLoadError
from jaxlora.loading import load_model
from jaxlora.loading.hf_writer import save_hf_folder
from jaxlora.loading.orbax_ckpt import MARKER, save_converted
from jaxlora.model.params import quantized_model, random_model
from jaxlora.model.quant import PROJECTION_PREFIXES
from tests.factories import tiny_config, word_tokenizer
from tests.loading.test_loaders import _write_gguf

# Every projection's input width (32 hidden, 32 = 4 heads x 8, 64 intermediate) is a multiple of
# Q8_0's 32-value block.
CFG = tiny_config(intermediate_size=64)
Q8_0 = gguf.GGMLQuantizationType.Q8_0


def _bits(a) -> np.ndarray:
    """Raw bytes of an array, so that fp8 and int8 compare exactly (NaN-safe, no float casts)."""
    a = np.ascontiguousarray(np.asarray(a))
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a


def _assert_same_params(got, expected) -> None:
    assert got.quantization == expected.quantization
    g, e = got.flat_params(), expected.flat_params()
    assert sorted(g) == sorted(e)
    for name in e:
        assert g[name].dtype == e[name].dtype, name
        np.testing.assert_array_equal(_bits(g[name]), _bits(e[name]), err_msg=name)


@pytest.fixture(scope="module")
def q8_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("q8") / "tiny-q8_0.gguf"
    _write_gguf(path, random_model(CFG, seed=4, std=0.2), projection_type=Q8_0)
    return path


def test_q8_0_loads_into_int8_without_dequantizing_projections(q8_gguf, monkeypatch):
    dense, _ = load_model(q8_gguf)  # Q8_0 dequantized to float32, as without --quantize
    dequantized = []
    real = gguf_file.dequantize
    monkeypatch.setattr(gguf_file, "dequantize", lambda t, **kw: dequantized.append(t.name) or real(t, **kw))
    loaded, _ = load_model(q8_gguf, quantization="int8")
    assert not [n for n in dequantized if n.startswith("blk.") and "norm" not in n], dequantized
    # Bit for bit what int8-quantizing the dequantized file gives (q/k rows un-permuted with their scales).
    _assert_same_params(loaded, quantized_model(dense, "int8"))


def test_q8_0_block_scales_become_the_row_maximum():
    # One row of two Q8_0 blocks: d = 0.5 on the first, 0.25 on the second. The row's scale is
    # max|w| / 127 = 0.5 * 127 / 127 = 0.5: the first block's integers stay, the second's halve
    # (rounded half to even: 127 * 0.25 / 0.5 = 63.5 -> 64, -3 * 0.5 = -1.5 -> -2).
    row = np.zeros(64, np.float32)
    row[0], row[1], row[32], row[33] = 0.5 * 127, -0.5 * 5, 0.25 * 127, -0.25 * 3
    blocks = gguf.quants.quantize(row[None], Q8_0)

    class Tensor:
        data = blocks

    q, scale = gguf_file.q8_0_to_int8(Tensor)
    assert scale.tolist() == [0.5]
    assert q[0, [0, 1, 32, 33]].tolist() == [127, -5, 64, -2]


def test_q8_0_as_fp8_equals_quantizing_the_dequantized_file(q8_gguf):
    dense, _ = load_model(q8_gguf)
    loaded, _ = load_model(q8_gguf, quantization="fp8")
    _assert_same_params(loaded, quantized_model(dense, "fp8"))


def test_hf_folder_quantized_at_load(tmp_path):
    model = random_model(tiny_config(attention_bias=True, tie_word_embeddings=False), seed=5)
    save_hf_folder(model, word_tokenizer(), tmp_path / "hf")
    loaded, _ = load_model(tmp_path / "hf", quantization="int8")
    _assert_same_params(loaded, quantized_model(model, "int8"))


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_quantized_checkpoint_round_trip(tmp_path, quantization):
    model = quantized_model(random_model(CFG, seed=6), quantization)
    save_converted(model, word_tokenizer(), tmp_path / "ckpt")
    assert json.loads((tmp_path / "ckpt" / MARKER).read_text())["quantization"] == quantization
    loaded, _ = load_model(tmp_path / "ckpt")  # the checkpoint's own format, nothing re-quantized
    _assert_same_params(loaded, model)
    same, _ = load_model(tmp_path / "ckpt", quantization=quantization)
    _assert_same_params(same, model)
    other = "fp8" if quantization == "int8" else "int8"
    with pytest.raises(ModelLoadError, match=f"holds {quantization} weights; it cannot be loaded as {other}"):
        load_model(tmp_path / "ckpt", quantization=other)


def test_dense_checkpoint_quantized_at_load(tmp_path):
    model = random_model(CFG, seed=7)
    save_converted(model, word_tokenizer(), tmp_path / "ckpt")
    loaded, _ = load_model(tmp_path / "ckpt", quantization="int8")
    _assert_same_params(loaded, quantized_model(model, "int8"))
    assert all(f"{p}.qkernel" in loaded.flat_params() for p in PROJECTION_PREFIXES.values())
