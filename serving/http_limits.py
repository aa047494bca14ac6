"""Connection limits of the HTTP server: uvicorn's h11 protocol with a connection cap, an idle timeout
from the moment a connection opens, and a bound on a request's head.

uvicorn times out an idle keep-alive connection only after a response; one that connects and never
sends a byte is held forever, so idle sockets could take every file descriptor. Here the keep-alive
timer also starts when the connection opens. Beyond `max_connections` open connections a new one is
answered 503 (with `Retry-After`) and closed at once. A request line plus headers larger than
`max_header_bytes` is answered 431 (`HeadLimit`); h11 bounds what it buffers of a head still
arriving to the same size (400 beyond), so a head that never ends cannot grow either. The protocol is
h11 whatever else is installed (uvicorn's `auto` picks httptools when present, which has no head
bound).
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)
_WARN_EVERY_SECONDS = 10.0

_REFUSED = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
)
_REFUSED_BODY = (
    b'{"error": {"message": "too many open connections; retry shortly", "type": "service_unavailable_error", '
    b'"param": null, "code": "unavailable"}}'
)


class HeadLimit:
    """ASGI middleware: 431 for a request whose target plus headers exceed `max_bytes`."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            size = len(scope.get("raw_path") or b"") + sum(len(k) + len(v) + 4 for k, v in scope["headers"])
            if size > self.max_bytes:
                body = (
                    b'{"error": {"message": "the request line and headers are larger than %d bytes", '
                    b'"type": "invalid_request_error", "param": null, "code": "invalid_argument"}}' % self.max_bytes
                )
                headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
                await send({"type": "http.response.start", "status": 431, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def limited_protocol(max_connections: int) -> type[H11Protocol]:
    """The protocol class to give uvicorn (`uvicorn.Config(http=...)`); the idle timeout and head
    bound come from the Config (`timeout_keep_alive`, `h11_max_incomplete_event_size`)."""

    warned_until = [0.0]

    class LimitedH11Protocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                now = self.loop.time()
                if now >= warned_until[0]:  # once per interval: a connection flood must not flood the log
                    log.warning("refusing new connections: %d open (--max-connections)", max_connections)
                    warned_until[0] = now + _WARN_EVERY_SECONDS
                transport.write(_REFUSED % (len(_REFUSED_BODY), _REFUSED_BODY))
                transport.close()
                return
            # Until its first request: a connection that never sends is closed like an idle one.
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )

    return LimitedH11Protocol
