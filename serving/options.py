"""How the servers listen and what they allow: one options record shared by the gRPC server
(serving.server) and the HTTP API (serving.http_server), which both import it from here."""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerOptions:
    """How the server listens and what it allows.

    Attributes:
      host, port: where to listen for gRPC (port 0: any free port, reported by build_server; None: no
        gRPC, only HTTP).
      http_port: the OpenAI-compatible HTTP API's port on `host` (None: no HTTP, 0: any free port).
      api_key: if set, every RPC but health needs `authorization: Bearer <api_key>` (or the admin key).
      admin_key: if set, LoadAdapter/UnloadAdapter need it.
      allow_runtime_updates: without an admin key, LoadAdapter/UnloadAdapter are refused unless this
        is set; then every caller may use them (see serving.security).
      adapter_roots: folders LoadAdapter may read from; empty disables runtime loading.
      metrics_port: Prometheus /metrics HTTP port on `host` (None: no endpoint, 0: any free port); the
        HTTP API serves the same metrics at its own /metrics.
      max_concurrent_streams: Generate calls in flight (gRPC and HTTP together); beyond it
        RESOURCE_EXHAUSTED. A call is a coroutine on its server's event loop, not a thread.
      max_message_bytes: largest request or response message.
      http_keep_alive_seconds: an HTTP connection with no request in flight is closed after this long
        idle, counted from its opening as well as from each response.
      max_connections: open HTTP connections at most; a new one beyond is answered 503 and closed.
        Keep it under the process's file-descriptor limit (`ulimit -n`).
      max_header_bytes: largest HTTP request line plus headers (400 beyond).
      grace_seconds: on shutdown, how long in-flight streams may run before they are cancelled.
      unload_timeout_seconds: how long UnloadAdapter waits for requests using the adapter.
      model_name: the base model's name: what GetServerInfo reports, and the HTTP API's `model` that
        picks no adapter (default: the model config's name).
      tokenize_slots: generation calls, gRPC and HTTP together, that tokenize their prompt at once
        (on their own thread, outside the engine loop); the others wait, served round-robin by
        client (serving.tokenize_slots). A burst of long prompts then cannot take every core from
        the engine loop, which would stall every running stream, nor keep another client waiting
        behind all of it. Default: a quarter of the cores, at least one.
    """

    host: str = "127.0.0.1"
    port: int | None = 50051
    http_port: int | None = None
    api_key: str | None = None
    admin_key: str | None = None
    allow_runtime_updates: bool = False
    adapter_roots: tuple[str, ...] = ()
    metrics_port: int | None = None
    max_concurrent_streams: int = 256
    max_message_bytes: int = 4 * 2**20
    http_keep_alive_seconds: float = 5.0
    max_connections: int = 1024
    max_header_bytes: int = 16 * 2**10
    grace_seconds: float = 30.0
    unload_timeout_seconds: float = 30.0
    model_name: str = ""
    tokenize_slots: int = dataclasses.field(default_factory=lambda: max(1, (os.cpu_count() or 1) // 4))

    def __post_init__(self) -> None:
        object.__setattr__(self, "adapter_roots", tuple(str(r) for r in self.adapter_roots))
        for field in ("port", "http_port", "metrics_port"):
            value = getattr(self, field)
            if value is not None and not 0 <= value < 65536:
                raise ValueError(f"{field}={value} must be in [0, 65535]")
        if self.port is None and self.http_port is None:
            raise ValueError("give a gRPC port, an HTTP port, or both")
        for field in ("max_concurrent_streams", "max_message_bytes", "tokenize_slots", "max_connections"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field}={getattr(self, field)} must be >= 1")
        for field in ("grace_seconds", "unload_timeout_seconds"):
            if not getattr(self, field) >= 0:
                raise ValueError(f"{field}={getattr(self, field)} must be >= 0")
        if not self.http_keep_alive_seconds > 0:
            raise ValueError(f"http_keep_alive_seconds={self.http_keep_alive_seconds} must be > 0")
        if self.max_header_bytes < 1024:
            raise ValueError(f"max_header_bytes={self.max_header_bytes} must be >= 1024")
        for field in ("api_key", "admin_key"):
            if getattr(self, field) == "":
                raise ValueError(f"{field} must not be empty (leave it unset for no key)")
