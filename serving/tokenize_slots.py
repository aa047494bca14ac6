"""The slots in which generation calls tokenize their prompts, shared by gRPC and HTTP, handed out
fairly between clients.

Tokenizing runs on a worker thread, outside the engine loop and the servers' event loops; a few
slots at once keep a burst of long prompts from taking every core from the engine loop. Waiting calls
are served round-robin by client (a gRPC peer, an HTTP connection): a client that sends a hundred
prompts waits behind its own requests, and another client's one request gets the next free slot.

    async with slots.hold_async(peer):   # the gRPC or HTTP event loop; the wait is cancellable
        await loop.run_in_executor(pool, engine.submit, ...)
    with slots.hold(peer):               # a plain thread
        engine.submit(...)
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import threading
from collections.abc import AsyncIterator, Callable, Iterator


@dataclasses.dataclass(eq=False)
class _Ticket:
    grant: Callable[[], None]  # called (under the lock) when the slot is handed over
    granted: bool = False
    abandoned: bool = False


class TokenizeSlots:
    """`size` slots; thread-safe. Callers wait round-robin by client key (see the module docstring)."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"size={size} must be >= 1")
        self.size = size
        self._free = size
        self._waiting: dict[str, collections.deque[_Ticket]] = {}  # in serving order: the next key first
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def hold(self, client: str) -> Iterator[None]:
        """Holds a slot for the block (blocking until one is free for `client`)."""
        granted = threading.Event()
        if self._enqueue(client, granted.set) is not None:
            granted.wait()
        try:
            yield
        finally:
            self._release()

    @contextlib.asynccontextmanager
    async def hold_async(self, client: str) -> AsyncIterator[None]:
        """`hold` for a coroutine: waits without blocking the event loop; cancelling the wait gives
        up the place in the queue."""
        loop = asyncio.get_running_loop()
        granted = loop.create_future()
        ticket = self._enqueue(client, lambda: loop.call_soon_threadsafe(_resolve, granted))
        if ticket is not None:
            try:
                await granted
            except asyncio.CancelledError:
                if not self._abandon(ticket):  # handed over meanwhile: give it back
                    self._release()
                raise
        try:
            yield
        finally:
            self._release()

    @property
    def num_waiting(self) -> int:
        with self._lock:
            return sum(not t.abandoned for q in self._waiting.values() for t in q)

    def _enqueue(self, client: str, grant: Callable[[], None]) -> _Ticket | None:
        """None if a slot was free (taken now), else the ticket `grant` will be called for."""
        with self._lock:
            if self._free and not self._waiting:
                self._free -= 1
                return None
            ticket = _Ticket(grant)
            self._waiting.setdefault(client, collections.deque()).append(ticket)
            return ticket

    def _release(self) -> None:
        """Hands the slot to the next client in turn, or frees it."""
        with self._lock:
            while self._waiting:
                client = next(iter(self._waiting))
                queue = self._waiting.pop(client)
                ticket = queue.popleft()
                if queue:
                    self._waiting[client] = queue  # to the back of the round
                if not ticket.abandoned:
                    ticket.granted = True
                    ticket.grant()
                    return
            self._free += 1

    def _abandon(self, ticket: _Ticket) -> bool:
        """Marks a waiting ticket abandoned; False if it was granted already."""
        with self._lock:
            if ticket.granted:
                return False
            ticket.abandoned = True
            return True


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
