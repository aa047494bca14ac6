"""API and admin keys: wrong and missing keys are refused on every RPC; admin calls need the admin key."""

from __future__ import annotations

import grpc
import pytest

from serving.security import AuthInterceptor
from tests.serving.support import connect, running_server, status_of

Code = grpc.StatusCode


@pytest.fixture(scope="module")
def keyed(engine, adapter_root):
    with running_server(
        engine, api_key="user-key", admin_key="admin-key", adapter_roots=(str(adapter_root),)
    ) as server:
        yield server


@pytest.mark.parametrize("key", [None, "wrong-key", "user-key "[:-2], ""])
def test_missing_or_wrong_api_key(keyed, key):
    with connect(keyed, api_key=key) as client:
        for call in (
            lambda: client.generate("hi", max_tokens=2),
            client.list_adapters,
            client.server_info,
            lambda: client.load_adapter("spare-2", "spare-2"),
            lambda: client.unload_adapter("alpha"),
        ):
            assert status_of(call) is Code.UNAUTHENTICATED


def test_user_key_serves_but_cannot_administer(keyed):
    with connect(keyed, api_key="user-key") as client:
        assert client.generate("hi", max_tokens=3).completion_tokens == 3
        assert client.list_adapters()
        assert status_of(lambda: client.load_adapter("spare-2", "spare-2")) is Code.PERMISSION_DENIED
        assert status_of(lambda: client.unload_adapter("alpha")) is Code.PERMISSION_DENIED


def test_admin_key_does_everything(keyed):
    with connect(keyed, api_key="admin-key") as admin:
        admin.load_adapter("spare-2", "spare-2")
        assert admin.generate("hi", adapter="spare-2", max_tokens=3).completion_tokens == 3
        admin.unload_adapter("spare-2")


def test_raw_metadata_variants(keyed):
    from serving.gen import inference_pb2 as pb
    from serving.gen import inference_pb2_grpc as pb_grpc

    with grpc.insecure_channel(f"127.0.0.1:{keyed.port}") as channel:
        stub = pb_grpc.InferenceStub(channel)
        call = lambda md: stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=md, timeout=10)  # noqa: E731
        assert call((("authorization", "Bearer user-key"),)).max_batch == 16
        assert call((("authorization", "bearer user-key"),)).max_batch == 16  # the scheme is case-insensitive
        for md in [
            (("authorization", "user-key"),),
            (("authorization", "Basic user-key"),),
            (("x-api-key", "user-key"),),
            (("authorization", "Bearer"),),
        ]:
            assert status_of(lambda: call(md)) is Code.UNAUTHENTICATED, md


def test_admin_key_alone_leaves_generation_open():
    auth = AuthInterceptor(api_key=None, admin_key="admin-key")
    assert auth.check("/jaxlora.v1.Inference/Generate", ()) is None
    assert auth.check("/jaxlora.v1.Inference/LoadAdapter", ()).code is Code.PERMISSION_DENIED
    assert (
        auth.check("/jaxlora.v1.Inference/LoadAdapter", (("authorization", "Bearer nope"),)).code
        is Code.UNAUTHENTICATED
    )
    assert auth.check("/jaxlora.v1.Inference/LoadAdapter", (("authorization", "Bearer admin-key"),)) is None
    assert auth.check("/grpc.health.v1.Health/Check", ()) is None
