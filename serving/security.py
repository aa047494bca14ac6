"""What a client may do: bearer-key checks on every call, and which folders LoadAdapter may read.
The rules are the same for gRPC and HTTP (the HTTP server calls `AuthInterceptor.check_token`).

Keys: with an API key set, every RPC but the health check needs `authorization: Bearer <key>` (the
admin key works too). With an admin key set, LoadAdapter and UnloadAdapter need it: another valid
key gets PERMISSION_DENIED, a missing or unknown one UNAUTHENTICATED. Keys are compared in constant
time. Health stays open so load balancers can probe without credentials.

Runtime adapter changes: without an admin key, LoadAdapter and UnloadAdapter are refused
(PERMISSION_DENIED naming `--admin-key`), as vLLM refuses them unless runtime LoRA updating is
switched on: anyone who can reach the port could otherwise unload the adapters others use.
`allow_runtime_updates` (`--allow-runtime-lora-updating`) switches them on for every caller that
passes the API key check (everyone, without an API key); with an admin key it changes nothing.

Paths: LoadAdapter reads only PEFT folders inside an `--adapter-root`. A path is relative to a root
(or absolute inside one), has no `..` part, and after resolving symlinks the folder and both of
its files must still lie inside that root. Only safetensors weights are read.
"""

from __future__ import annotations

import dataclasses
import hmac
from collections.abc import Sequence
from pathlib import Path

import grpc

HEALTH_PREFIX = "/grpc.health.v1.Health/"
ADMIN_METHODS = frozenset({"/jaxlora.v1.Inference/LoadAdapter", "/jaxlora.v1.Inference/UnloadAdapter"})
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


RUNTIME_UPDATES_OFF = (
    "loading and unloading adapters at run time is off: start the server with --admin-key "
    "(admins only) or --allow-runtime-lora-updating (every caller)"
)


class PathRefused(Exception):
    """LoadAdapter named a path the server will not read (the message says why)."""


@dataclasses.dataclass(frozen=True)
class _Denied:
    code: grpc.StatusCode
    message: str


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks the bearer key of each call before its handler runs (an interceptor of the gRPC
    server's event loop: the check is a few comparisons, it never blocks)."""

    def __init__(self, *, api_key: str | None, admin_key: str | None, allow_runtime_updates: bool = False) -> None:
        self._api_key = api_key.encode() if api_key else None
        self._admin_key = admin_key.encode() if admin_key else None
        self._allow_runtime_updates = allow_runtime_updates

    async def intercept_service(self, continuation, handler_call_details):
        denied = self.check(handler_call_details.method, handler_call_details.invocation_metadata or ())
        handler = await continuation(handler_call_details)
        if denied is None or handler is None:
            return handler
        return _refusing_handler(handler, denied)

    def check(self, method: str, metadata: Sequence[tuple[str, str | bytes]]) -> _Denied | None:
        """None if the call may go on, else the status to answer with."""
        if method.startswith(HEALTH_PREFIX):
            return None
        return self.check_token(bearer_token(metadata), needs_admin=method in ADMIN_METHODS)

    def check_token(self, token: bytes | None, *, needs_admin: bool) -> _Denied | None:
        """None if a call with this bearer token may go on (`needs_admin`: it loads or unloads an
        adapter), else the status to answer with."""
        is_admin = self._admin_key is not None and token is not None and hmac.compare_digest(token, self._admin_key)
        is_user = self._api_key is not None and token is not None and hmac.compare_digest(token, self._api_key)
        if needs_admin and self._admin_key is not None:
            if is_admin:
                return None
            if is_user or (self._api_key is None and token is None):
                return _Denied(grpc.StatusCode.PERMISSION_DENIED, "this call needs the admin key")
            return _Denied(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid admin key")
        if needs_admin and not self._allow_runtime_updates:
            return _Denied(grpc.StatusCode.PERMISSION_DENIED, RUNTIME_UPDATES_OFF)
        if self._api_key is None or is_user or is_admin:
            return None
        return _Denied(
            grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key (send 'authorization: Bearer <key>')"
        )


def bearer_token(metadata: Sequence[tuple[str, str | bytes]]) -> bytes | None:
    """The token of an `authorization: Bearer <token>` entry (gRPC metadata or HTTP headers)."""
    for key, value in metadata:
        if key.lower() != "authorization":
            continue
        value = value.decode("latin-1") if isinstance(value, bytes) else value
        scheme, _, token = value.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip().encode()
    return None


def _refusing_handler(handler: grpc.RpcMethodHandler, denied: _Denied) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that only aborts with `denied`."""

    async def abort(request, context):
        await context.abort(denied.code, denied.message)

    async def abort_stream(request, context):
        await context.abort(denied.code, denied.message)
        yield  # makes this an async generator, as a streaming handler may be

    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort_stream, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort_stream, **kw)
    return grpc.unary_unary_rpc_method_handler(abort, **kw)


class AdapterRoots:
    """The folders LoadAdapter may read from (resolved once at start-up)."""

    def __init__(self, roots: Sequence[str | Path]) -> None:
        self.roots = tuple(Path(r).resolve(strict=True) for r in roots)
        for root in self.roots:
            if not root.is_dir():
                raise NotADirectoryError(f"adapter root {root} is not a folder")

    def resolve(self, path: str) -> Path:
        """The real folder `path` names inside a root.

        Raises:
          PathRefused: no roots, a `..` part, or the path (or one of its files) resolves outside
            every root.
          FileNotFoundError: no root holds such a folder.
        """
        if not self.roots:
            raise PathRefused("this server loads no adapters at run time (start it with --adapter-root DIR)")
        if not path or "\x00" in path:
            raise PathRefused("the adapter path is empty or holds a NUL character")
        given = Path(path)
        if ".." in given.parts:
            raise PathRefused(f"adapter path {path!r} must not contain '..'")
        candidates = [given] if given.is_absolute() else [root / given for root in self.roots]
        for candidate in candidates:
            real = candidate.resolve()  # follows every symlink on the way
            root = next((r for r in self.roots if real.is_relative_to(r)), None)
            if root is None:
                raise PathRefused(f"adapter path {path!r} resolves outside every adapter root")
            if real.is_dir():
                self._check_files(real, root, path)
                return real
        raise FileNotFoundError(f"adapter folder {path!r} not found in any adapter root")

    @staticmethod
    def _check_files(folder: Path, root: Path, path: str) -> None:
        for name in ADAPTER_FILES:
            file = folder / name
            if not file.is_file():
                raise FileNotFoundError(
                    f"adapter folder {path!r} has no {name} (only PEFT adapters with safetensors weights load)"
                )
            if not file.resolve().is_relative_to(root):
                raise PathRefused(f"{name} of adapter folder {path!r} links outside its adapter root")
