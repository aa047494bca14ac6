"""API and admin keys: wrong and missing keys are refused on every RPC; admin calls need the admin key."""

from __future__ import annotations

import grpc
import openai
import pytest

from serving.security import AuthInterceptor
from tests.serving.support import connect, rpc_error, running_server, status_of, write_adapter

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
            lambda: client.generate("hi", temperature=0, max_tokens=2),
            client.list_adapters,
            client.server_info,
            lambda: client.load_adapter("spare-2", "spare-2"),
            lambda: client.unload_adapter("alpha"),
        ):
            assert status_of(call) is Code.UNAUTHENTICATED


def test_user_key_serves_but_cannot_administer(keyed):
    with connect(keyed, api_key="user-key") as client:
        assert client.generate("hi", temperature=0, max_tokens=3).completion_tokens == 3
        assert client.list_adapters()
        assert status_of(lambda: client.load_adapter("spare-2", "spare-2")) is Code.PERMISSION_DENIED
        assert status_of(lambda: client.unload_adapter("alpha")) is Code.PERMISSION_DENIED


def test_admin_key_does_everything(keyed):
    with connect(keyed, api_key="admin-key") as admin:
        admin.load_adapter("spare-2", "spare-2")
        assert admin.generate("hi", adapter="spare-2", temperature=0, max_tokens=3).completion_tokens == 3
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


LOAD, UNLOAD, GENERATE = (
    "/jaxlora.v1.Inference/LoadAdapter",
    "/jaxlora.v1.Inference/UnloadAdapter",
    "/jaxlora.v1.Inference/Generate",
)


def _bearer(key: str | None) -> tuple:
    return () if key is None else (("authorization", f"Bearer {key}"),)


@pytest.mark.parametrize(
    "keys, allow, caller, admin_call",
    [
        # No keys: refused unless the flag lets everyone.
        ({}, False, None, Code.PERMISSION_DENIED),
        ({}, True, None, None),
        # Only an API key: refused unless the flag lets every key holder (and only them).
        ({"api_key": "u"}, False, "u", Code.PERMISSION_DENIED),
        ({"api_key": "u"}, True, "u", None),
        ({"api_key": "u"}, True, None, Code.UNAUTHENTICATED),
        # Both keys: the admin alone, flag or not.
        ({"api_key": "u", "admin_key": "a"}, False, "a", None),
        ({"api_key": "u", "admin_key": "a"}, True, "u", Code.PERMISSION_DENIED),
        ({"api_key": "u", "admin_key": "a"}, False, "u", Code.PERMISSION_DENIED),
    ],
)
def test_who_may_change_adapters_at_run_time(keys, allow, caller, admin_call):
    auth = AuthInterceptor(**{"api_key": None, "admin_key": None, **keys}, allow_runtime_updates=allow)
    for method in (LOAD, UNLOAD):
        denied = auth.check(method, _bearer(caller))
        assert (denied and denied.code) == admin_call, (method, denied)
    if admin_call is Code.PERMISSION_DENIED and "admin_key" not in keys:
        assert "--admin-key" in denied.message and "--allow-runtime-lora-updating" in denied.message
    if caller is not None:
        assert auth.check(GENERATE, _bearer(caller)) is None  # generation is never affected


def test_without_an_admin_key_runtime_changes_are_refused_on_both_apis(engine, adapter_root):
    with running_server(engine, http_port=0, adapter_roots=(str(adapter_root),), allow_runtime_updates=False) as srv:
        with connect(srv) as client:
            for call in (lambda: client.load_adapter("spare-2", "spare-2"), lambda: client.unload_adapter("alpha")):
                e = rpc_error(call)
                assert e.code() is Code.PERMISSION_DENIED and "--admin-key" in e.details()
        http = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.http_port}/v1", api_key="x", max_retries=0)
        for path, body in (
            ("/unload_lora_adapter", {"lora_name": "alpha"}),
            ("/load_lora_adapter", {"lora_name": "x", "lora_path": "spare-2"}),
        ):
            with pytest.raises(openai.PermissionDeniedError, match="--admin-key"):
                http.post(path, body=body, cast_to=str)
        assert "alpha" in {a.name for a in engine.list_adapters()}


def test_an_admin_reloads_a_start_up_adapter_from_its_folder_without_a_root(engine, adapter_root, tmp_path):
    stranger = write_adapter(tmp_path / "stranger", engine.model.config, seed=7)
    with running_server(engine, admin_key="admin-key") as srv, connect(srv, api_key="admin-key") as admin:
        admin.unload_adapter("alpha")
        try:
            assert "alpha" not in {a.name for a in admin.list_adapters()}
            e = rpc_error(lambda: admin.load_adapter("stranger", str(stranger)))
            assert e.code() is Code.PERMISSION_DENIED  # not a start-up folder, and no root
        finally:
            admin.load_adapter("alpha", str(adapter_root / "alpha"))
        assert admin.generate("hi", adapter="alpha", temperature=0, max_tokens=2).completion_tokens == 2
