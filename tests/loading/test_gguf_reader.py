"""jaxlora's GGUF reader against the `gguf` package's (its peer): the same metadata values and
tensor views, on the embedded model and on a file written with `gguf.GGUFWriter`; bad files fail
with ModelLoadError."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from jaxlora.errors import ModelLoadError
from jaxlora.loading.gguf_reader import read_gguf


def _assert_same(path) -> None:
    ours, peer = read_gguf(path), gguf.GGUFReader(str(path))
    # The peer adds its header ("GGUF.version", ...) as fields; the file's metadata is the rest.
    expected = {k: f.contents() for k, f in peer.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields == expected
    assert [t.name for t in ours.tensors] == [t.name for t in peer.tensors]
    for a, b in zip(ours.tensors, peer.tensors):
        assert a.tensor_type == b.tensor_type
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        np.testing.assert_array_equal(a.data, b.data, err_msg=a.name)


def test_embedded_model_reads_as_the_gguf_package_reads_it(smollm2_gguf_path):
    _assert_same(smollm2_gguf_path)


def _write(path, rng) -> None:
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_uint32("t.u32", 7)
    w.add_int64("t.i64", -3)
    w.add_float32("t.f32", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo wörld")
    w.add_array("t.strings", ["a", "", "Ġthe", "é ü"])
    w.add_array("t.ints", [3, 1, 4, 1, 5])
    w.add_array("t.floats", [0.5, -2.25])
    w.add_custom_alignment(64)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 7)).astype(np.float16))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_written_file_reads_as_the_gguf_package_reads_it(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "t.gguf"
    _write(path, rng)
    _assert_same(path)
    fields = read_gguf(path).fields
    assert fields["t.strings"] == ["a", "", "Ġthe", "é ü"] and fields["t.i64"] == -3 and fields["t.bool"] is True


def test_bad_files_are_refused(tmp_path):
    rng = np.random.default_rng(1)
    path = tmp_path / "t.gguf"
    _write(path, rng)
    whole = path.read_bytes()
    with pytest.raises(ModelLoadError, match="no such GGUF file"):
        read_gguf(tmp_path / "missing.gguf")
    (tmp_path / "magic.gguf").write_bytes(b"GGUX" + whole[4:])
    with pytest.raises(ModelLoadError, match="no GGUF magic"):
        read_gguf(tmp_path / "magic.gguf")
    # Cut in the metadata, further on, and inside the last tensor (272 bytes of Q8_0, then < 64 of padding).
    for cut in (20, 100, 300, len(whole) - 100):
        (tmp_path / "cut.gguf").write_bytes(whole[:cut])
        with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
            read_gguf(tmp_path / "cut.gguf")
