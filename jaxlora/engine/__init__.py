"""Serving engine: request state, scheduler (plain Python), runner (jitted steps), engine (the loop),
and `build_engine`, the one place an engine is put together.

Names are imported lazily so that `jaxlora.engine.scheduler` and `jaxlora.engine.request` stay
importable (and testable) without JAX.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "build_engine": "jaxlora.engine.build",
    "Engine": "jaxlora.engine.engine",
    "RequestHandle": "jaxlora.engine.engine",
    "EngineConfig": "jaxlora.engine.config",
    "GenerationRequest": "jaxlora.engine.request",
    "SamplingParams": "jaxlora.engine.request",
    "RequestOutput": "jaxlora.engine.request",
    "FinalOutput": "jaxlora.engine.request",
    "FinishReason": "jaxlora.engine.request",
    "Scheduler": "jaxlora.engine.scheduler",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
