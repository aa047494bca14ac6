"""The committed stubs in serving/gen/ are what `python -m serving.gen_proto` makes of the .proto."""

from __future__ import annotations

import importlib.metadata

import pytest

from serving import gen_proto


def test_committed_stubs_match_the_proto(tmp_path):
    pytest.importorskip("grpc_tools")
    gen_proto.generate(tmp_path)
    for name in gen_proto.STUBS:
        fresh = (tmp_path / name).read_text()
        committed = (gen_proto.OUT / name).read_text()
        assert fresh == committed, (
            f"serving/gen/{name} is stale: run `python -m serving.gen_proto` (grpcio-tools "
            f"{importlib.metadata.version('grpcio-tools')} here)"
        )


def test_stubs_import_as_a_package():
    from serving.gen import inference_pb2, inference_pb2_grpc

    assert inference_pb2.DESCRIPTOR.package == "jaxlora.v1"
    assert "Inference" in inference_pb2.DESCRIPTOR.services_by_name
    assert hasattr(inference_pb2_grpc, "InferenceStub")
