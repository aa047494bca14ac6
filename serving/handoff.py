"""Handing the engine thread's streamed updates to the frontends at a cost per step, not per token.

The engine calls each request's callback on its loop thread, once per generated token: at 256 rows
that is 256 calls between two steps, and whatever they cost delays the next dispatch. Two pieces
keep that cost low and let the frontends catch up in batches:

`LoopHandoff` (a frontend's asyncio loop, HTTP's or gRPC's): a callback appends (queue, update) to one deque and
wakes the event loop only if no wake-up is pending: one `call_soon_threadsafe` (a self-pipe write)
per engine step instead of one per token, and no lock (deque appends and pops are atomic). The
loop's drain moves every pending update into its request's queue, in order.

`coalesce`: a frontend that finds several updates of one request waiting sends them as one
message: the text and token ids joined, the last update's other fields (a finished update stays
last, so its finish reason and usage go out with the joined text). A client that reads slower than
the engine writes then costs one frame per read, not one per token.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Callable

from jaxlora.engine.request import RequestOutput


class LoopHandoff:
    """Updates from the engine thread to per-request `asyncio.Queue`s on one event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._pending: collections.deque[tuple[asyncio.Queue, RequestOutput]] = collections.deque()
        self._wake_pending = False

    def callback(self, updates: asyncio.Queue) -> Callable[[RequestOutput], None]:
        """The engine callback of one request whose updates go to `updates`."""
        append = self._pending.append

        def deliver(out: RequestOutput) -> None:  # on the engine thread
            append((updates, out))
            if not self._wake_pending:
                self._wake_pending = True
                try:
                    self.loop.call_soon_threadsafe(self._drain)
                except RuntimeError:  # the event loop is closed: the server stopped, nobody waits
                    pass

        return deliver

    def _drain(self) -> None:  # on the event loop
        # Cleared before draining: an update appended from here on schedules its own drain, so none
        # is left behind (at worst a drain finds nothing).
        self._wake_pending = False
        pending = self._pending
        while pending:
            updates, out = pending.popleft()
            updates.put_nowait(out)


class LoopHandoffs:
    """The LoopHandoff of the running event loop, made on first use and again if a server's loop is
    replaced (a restarted loop thread): one per frontend."""

    def __init__(self) -> None:
        self._handoff: LoopHandoff | None = None

    def current(self) -> LoopHandoff:
        loop = asyncio.get_running_loop()
        if self._handoff is None or self._handoff.loop is not loop:
            self._handoff = LoopHandoff(loop)
        return self._handoff


POLL_SECONDS = 0.5  # how often a request waiting for updates checks that the engine runs


class EngineStopped(Exception):
    """The engine stopped while a request waited for its updates, with none left to read."""


async def request_updates(updates: asyncio.Queue, is_running: Callable[[], bool]) -> AsyncIterator[RequestOutput]:
    """One request's updates from its queue, up to and including the final one; several waiting
    ones as one (`coalesce`: a frontend behind the engine sends one message for all). Raises
    EngineStopped when the engine is no longer running and nothing is waiting."""
    while True:
        if updates.empty():
            try:
                out = await asyncio.wait_for(updates.get(), POLL_SECONDS)
            except TimeoutError:
                if not is_running() and updates.empty():
                    raise EngineStopped from None
                continue
        else:
            out = updates.get_nowait()
        if not out.finished and not updates.empty():
            waiting = [out]
            while not out.finished and not updates.empty():
                out = updates.get_nowait()
                waiting.append(out)
            out = coalesce(waiting)
        yield out
        if out.finished:
            return


def coalesce(outs: list[RequestOutput]) -> RequestOutput:
    """One update standing for `outs` (consecutive updates of one request, oldest first): the texts
    and token ids joined (and logprobs), every other field from the last."""
    if len(outs) == 1:
        return outs[0]
    last = outs[-1]
    logprobs = None if last.logprobs is None else tuple(e for o in outs for e in (o.logprobs or ()))
    return last._replace(
        text="".join(o.text for o in outs), token_ids=tuple(t for o in outs for t in o.token_ids), logprobs=logprobs
    )
