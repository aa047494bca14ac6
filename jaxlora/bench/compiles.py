"""Counts XLA backend compiles in this process, so that a timer can prove it timed none.

jit recompiles without retracing when only an argument's placement changes (an uncommitted array
on one device vs. a step's own output replicated over a mesh): a trace counter misses those, and a
timed loop that pays one averages a whole compile into its steps. jax reports every backend
compile to `jax.monitoring`; the listener registered here counts them.
"""

from __future__ import annotations

import jax

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_count = 0
_listening = False


def _on_duration(event: str, duration_secs: float, **kwargs) -> None:
    global _count
    if event == _BACKEND_COMPILE_EVENT:
        _count += 1


def backend_compiles() -> int:
    """Backend compiles since the first call of this function (which starts the count)."""
    global _listening
    if not _listening:
        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        _listening = True
    return _count


def check_no_compiles(before: int, what: str) -> None:
    """Raises RuntimeError if a backend compile happened since `before` (a `backend_compiles()` value)."""
    compiled = backend_compiles() - before
    if compiled:
        raise RuntimeError(f"{what} compiled {compiled} program(s): its time would include XLA compiles; "
                           "warm up with the arguments (and their placement) the timed calls use")
