"""Exceptions with a specific meaning for callers (CLI exit codes, gRPC status codes)."""


class JaxloraError(Exception):
    """Base class of every error jaxlora raises on purpose."""


class ModelLoadError(JaxloraError, ValueError):
    """A base-model file or folder cannot be used; the message names the file and the problem."""


class AdapterError(JaxloraError, ValueError):
    """An adapter cannot be loaded; the message names the adapter, the tensor and the reason."""


class AdapterExistsError(AdapterError):
    """An adapter name is already registered, or being registered by a concurrent load (gRPC ALREADY_EXISTS)."""


class UnknownAdapterError(JaxloraError, KeyError):
    """A request or call named an adapter that is not registered."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else "unknown adapter"


class RequestError(JaxloraError, ValueError):
    """A generation request is invalid (prompt too long, bad sampling values, ...)."""


class CapacityError(JaxloraError, RuntimeError):
    """A bounded resource is full (admission queue, host adapter memory)."""


class AdapterInUseError(JaxloraError, RuntimeError):
    """An adapter cannot be unregistered now: running requests still use it (gRPC FAILED_PRECONDITION)."""


class EngineFailedError(JaxloraError, RuntimeError):
    """The engine's background loop died (a device failure it could not recover from): it takes no
    more requests, and the process must be restarted (gRPC / HTTP UNAVAILABLE)."""
