"""The serving process's phase, its count of generation calls in flight and the slots they tokenize
in, shared by the gRPC and HTTP front doors: one limit on concurrent streams, one set of tokenize
slots, one warm-up, one drain for both."""

from __future__ import annotations

import contextlib
import enum
import threading
from collections.abc import Iterator

from serving.api import ApiError, Status
from serving.tokenize_slots import TokenizeSlots


class Phase(enum.Enum):
    WARMING = "warming"  # listening, compiling: generation calls are UNAVAILABLE
    SERVING = "serving"
    DRAINING = "draining"  # new generation calls are UNAVAILABLE; running ones finish or are cancelled
    STOPPED = "stopped"
    FAILED = "failed"  # the engine's loop died: generation calls are UNAVAILABLE until a restart


class Admission:
    """Phase of the server and the count of generation calls in flight (thread-safe); `tokenize`: the
    slots calls tokenize their prompts in (serving.tokenize_slots)."""

    def __init__(self, max_streams: int, *, tokenize_slots: int = 1) -> None:
        self.max_streams = max_streams
        self.tokenize = TokenizeSlots(tokenize_slots)
        self.phase = Phase.WARMING
        self.failure: str | None = None  # why the engine failed (Phase.FAILED)
        self.num_streams = 0
        self._lock = threading.Condition()

    @contextlib.contextmanager
    def stream(self) -> Iterator[None]:
        """Holds one place among `max_streams` for the duration of a call.

        Raises:
          ApiError: UNAVAILABLE while warming up or shutting down, RESOURCE_EXHAUSTED when full.
        """
        with self._lock:
            if self.phase is Phase.WARMING:
                raise ApiError(Status.UNAVAILABLE, "the server is warming up; retry shortly")
            if self.phase is Phase.FAILED:
                raise ApiError(Status.UNAVAILABLE, f"the engine failed ({self.failure}); the server must be restarted")
            if self.phase is not Phase.SERVING:
                raise ApiError(Status.UNAVAILABLE, "the server is shutting down")
            if self.num_streams >= self.max_streams:
                raise ApiError(
                    Status.RESOURCE_EXHAUSTED, f"too many streams in flight ({self.max_streams}); retry later"
                )
            self.num_streams += 1
        try:
            yield
        finally:
            with self._lock:
                self.num_streams -= 1
                self._lock.notify_all()

    def set_phase(self, phase: Phase) -> Phase:
        """Sets the phase (Phase.FAILED stays); returns the previous one."""
        with self._lock:
            previous = self.phase
            if previous is not Phase.FAILED:
                self.phase = phase
            return previous

    def fail(self, reason: str) -> None:
        """The engine's loop died: Phase.FAILED for good (a drain or stop no longer changes it)."""
        with self._lock:
            self.failure, self.phase = reason, Phase.FAILED

    def wait_for_streams(self, timeout: float) -> bool:
        """Waits until no stream is in flight; False if some still are after `timeout` seconds."""
        with self._lock:
            return self._lock.wait_for(lambda: self.num_streams == 0, timeout)
