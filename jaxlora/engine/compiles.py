"""Counts XLA backend compiles in this process, so that a timer or the engine can prove it ran none.

jit recompiles without retracing when only an argument's placement changes (an uncommitted array
on one device vs. a step's own output replicated over a mesh): a trace counter misses those, and a
timed loop that pays one averages a whole compile into its steps. jax reports every backend
compile to `jax.monitoring`, on the thread that compiles; the listener registered here counts them
per process and per thread (so the engine can count its own step's compiles while other threads,
or other engines, compile theirs).
"""

from __future__ import annotations

import collections
import threading

import jax

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_lock = threading.Lock()
_count = 0
_listening = False
_thread = threading.local()  # .count: compiles on this thread
_by_name: collections.Counter[str] = collections.Counter()  # compiles per jitted function's name


def _on_duration(event: str, duration_secs: float, **kwargs) -> None:
    global _count
    if event != _BACKEND_COMPILE_EVENT:
        return
    with _lock:
        _count += 1
        _by_name[str(kwargs.get("fun_name", ""))] += 1
    _thread.count = getattr(_thread, "count", 0) + 1


def start_counting() -> None:
    """Registers the listener (once per process); compiles before this call are not counted."""
    global _listening
    with _lock:
        if not _listening:
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            _listening = True


def backend_compiles() -> int:
    """Backend compiles in this process since counting started (the first call starts it)."""
    start_counting()
    return _count


def compiles_of(fun_name: str) -> int:
    """Backend compiles of the jitted Python function named `fun_name` (e.g. "packed_step"; jax
    reports it as "jit(packed_step)") since counting started (the first call starts it)."""
    start_counting()
    with _lock:
        return _by_name[f"jit({fun_name})"]


def thread_backend_compiles() -> int:
    """Backend compiles on the calling thread since counting started (the first call starts it)."""
    start_counting()
    return getattr(_thread, "count", 0)


def check_no_compiles(before: int, what: str) -> None:
    """Raises RuntimeError if a backend compile happened since `before` (a `backend_compiles()` value)."""
    compiled = backend_compiles() - before
    if compiled:
        raise RuntimeError(
            f"{what} compiled {compiled} program(s): its time would include XLA compiles; "
            "warm up with the arguments (and their placement) the timed calls use"
        )
