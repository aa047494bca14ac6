"""Runtime adapter management over gRPC: load, list, unload under load, and path confinement."""

from __future__ import annotations

import os
import shutil
import threading
import time

import grpc
import pytest

from tests.factories import tiny_model
from tests.serving.support import (
    BackgroundStream,
    assert_capacity_whole,
    connect,
    rpc_error,
    running_server,
    wait_until,
    write_adapter,
)

Code = grpc.StatusCode


def test_load_list_generate_unload(client, adapter_root):
    info = client.load_adapter("spare-1", "spare-1")
    assert info.name == "spare-1" and info.rank == 4 and info.host_bytes > 0
    listed = {a.name: a for a in client.list_adapters()}
    assert {"alpha", "beta", "gamma", "delta", "spare-1"} <= set(listed)
    base = client.generate("load me", temperature=0, max_tokens=12)
    tuned = client.generate("load me", adapter="spare-1", temperature=0, max_tokens=12)
    assert tuned.token_ids != base.token_ids
    resident = {a.name: a for a in client.list_adapters()}["spare-1"]
    assert resident.resident and resident.slot > 0 and resident.in_flight == 0
    client.unload_adapter("spare-1")
    assert "spare-1" not in [a.name for a in client.list_adapters()]
    assert (
        rpc_error(lambda: client.generate("x", adapter="spare-1", temperature=0, max_tokens=2)).code() is Code.NOT_FOUND
    )
    # The same name may be loaded again from an absolute path inside the root.
    client.load_adapter("spare-1", str(adapter_root / "spare-1"))
    client.unload_adapter("spare-1")


def test_unload_while_a_stream_uses_the_adapter(engine, client, server):
    client.load_adapter("spare-4", "spare-4")
    alone = client.generate("unload me", adapter="spare-4", temperature=0, max_tokens=120)
    stream = BackgroundStream(client, "unload me", adapter="spare-4", max_tokens=120)
    assert stream.first_chunk.wait(30)
    unloaded = threading.Event()
    unloader = threading.Thread(target=lambda: (client.unload_adapter("spare-4"), unloaded.set()))
    unloader.start()
    # While the unload waits for the running stream, the name is already gone for new requests.
    wait_until(lambda: not engine.pager.has("spare-4"))
    assert (
        rpc_error(lambda: client.generate("x", adapter="spare-4", temperature=0, max_tokens=2)).code() is Code.NOT_FOUND
    )
    stream.join()
    unloader.join(30)
    assert unloaded.is_set()
    assert stream.error is None and tuple(stream.token_ids) == alone.token_ids  # finished, undisturbed
    assert "spare-4" not in [a.name for a in client.list_adapters()]
    assert_capacity_whole(engine, server)


@pytest.fixture
def outside(tmp_path):
    """A valid adapter folder outside every adapter root (what an attacker would point at)."""
    return write_adapter(tmp_path / "outside", tiny_model().config, seed=7)


def test_path_traversal_is_refused(client, adapter_root, outside):
    traversal = os.path.relpath(outside, adapter_root)  # ../../.../outside
    assert traversal.startswith("..")
    link = adapter_root / "link-out"
    link.unlink(missing_ok=True)
    link.symlink_to(outside, target_is_directory=True)
    mixed = adapter_root / "file-link-out"
    shutil.rmtree(mixed, ignore_errors=True)
    mixed.mkdir()
    shutil.copy(outside / "adapter_config.json", mixed)
    (mixed / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    for path, reason in [
        (traversal, "'..'"),
        ("spare-5/../../outside", "'..'"),
        (str(outside), "outside every adapter root"),
        ("link-out", "outside every adapter root"),  # a symlinked folder leading out
        ("file-link-out", "links outside"),  # a symlinked weights file leading out
    ]:
        e = rpc_error(lambda: client.load_adapter("evil", path))
        assert e.code() is Code.PERMISSION_DENIED and reason in e.details(), (path, e.details())
    assert "evil" not in [a.name for a in client.list_adapters()]


def test_only_safetensors_and_existing_folders(client, adapter_root):
    pickled = adapter_root / "pickled"
    pickled.mkdir(exist_ok=True)
    shutil.copy(adapter_root / "spare-5" / "adapter_config.json", pickled)
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04 pickle would run code")
    e = rpc_error(lambda: client.load_adapter("pickled", "pickled"))
    assert e.code() is Code.NOT_FOUND and "safetensors" in e.details()
    assert rpc_error(lambda: client.load_adapter("nope", "no-such-folder")).code() is Code.NOT_FOUND


def test_a_symlink_inside_the_root_is_fine(client, adapter_root):
    link = adapter_root / "link-in"
    link.unlink(missing_ok=True)
    link.symlink_to(adapter_root / "spare-5", target_is_directory=True)
    assert client.load_adapter("linked", "link-in").name == "linked"
    client.unload_adapter("linked")


def test_no_adapter_root_means_no_runtime_loading(engine):
    with running_server(engine) as server, connect(server) as client:
        e = rpc_error(lambda: client.load_adapter("spare-5", "spare-5"))
        assert e.code() is Code.PERMISSION_DENIED and "--adapter-root" in e.details()


def test_concurrent_loads_of_one_name_give_one_ok_and_already_exists(client, monkeypatch):
    import jaxlora.adapters.pager as pager_module

    real_prepare = pager_module.prepare_adapter

    def slow_prepare(*args, **kwargs):  # keeps every load inside the first one's window
        time.sleep(0.5)
        return real_prepare(*args, **kwargs)

    monkeypatch.setattr(pager_module, "prepare_adapter", slow_prepare)
    barrier = threading.Barrier(4)
    codes: list[Code] = []

    def load() -> None:
        barrier.wait()
        try:
            client.load_adapter("racer", "spare-5")
            codes.append(Code.OK)
        except grpc.RpcError as e:
            codes.append(e.code())

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(codes, key=str) == sorted([Code.OK] + [Code.ALREADY_EXISTS] * 3, key=str), codes
    client.unload_adapter("racer")


def test_host_memory_full_is_resource_exhausted():
    from jaxlora.errors import CapacityError
    from serving.server import _status_of

    assert _status_of(CapacityError("host adapter memory is full"))[0] is Code.RESOURCE_EXHAUSTED
