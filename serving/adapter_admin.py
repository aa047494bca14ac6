"""Loading and unloading adapters at run time, for both front doors (gRPC LoadAdapter/UnloadAdapter,
HTTP /v1/load_lora_adapter and /v1/unload_lora_adapter): one set of rules, one registry (the engine's
pager), so an adapter loaded through one protocol is served and unloaded through the other."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxlora.lora.validate import check_adapter_name
from serving.api import ApiError, Status
from serving.security import AdapterRoots

if TYPE_CHECKING:
    from jaxlora.engine.engine import Engine


class AdapterAdmin:
    """The checks around `engine.register_adapter` / `unregister_adapter`.

    Args:
      engine: the serving engine (its pager is the one registry).
      roots: the folders adapters may be read from (`--adapter-root`). The folders of the adapters
        registered at start-up may be read too: an adapter unloaded by mistake can be loaded again
        from where it came, with or without a root.
      base_model: the served base model's name; no adapter may take it, since requests that name it
        get no adapter.
      unload_timeout_seconds: how long an unload waits for requests still using the adapter.
    """

    def __init__(self, engine: Engine, roots: AdapterRoots, *, base_model: str, unload_timeout_seconds: float) -> None:
        self.engine = engine
        self.roots = roots
        self.base_model = base_model
        self.unload_timeout_seconds = unload_timeout_seconds
        self.startup_folders = frozenset(_folder(a.source) for a in engine.list_adapters() if _folder(a.source))

    def load(self, name: str, path: str) -> Any:
        """Registers the PEFT folder `path` (inside a root) as `name`; returns the pager's AdapterInfo.

        Raises:
          ApiError: ALREADY_EXISTS for a taken name (or the base model's).
          AdapterError: invalid name or adapter files. PathRefused, FileNotFoundError: see AdapterRoots.
          CapacityError: host adapter memory is full.
        """
        name = check_adapter_name(name)
        if name == self.base_model:
            raise ApiError(Status.ALREADY_EXISTS, f"{name!r} is the base model's name")
        if self.has(name):
            raise ApiError(Status.ALREADY_EXISTS, f"adapter {name!r} is already loaded")
        return self.engine.register_adapter(name, self._folder(path))

    def _folder(self, path: str) -> Path:
        """The folder to read: a start-up adapter's own, or one inside a root (AdapterRoots.resolve)."""
        given = _folder(path)
        if given is not None and given in self.startup_folders:
            return given
        return self.roots.resolve(path)

    def unload(self, name: str) -> None:
        """Unregisters `name` once no running request uses it.

        Raises:
          UnknownAdapterError: not loaded. AdapterInUseError: still in use after the timeout.
        """
        self.engine.unregister_adapter(name, wait=True, timeout=self.unload_timeout_seconds)

    def has(self, name: str) -> bool:
        pager = self.engine.pager
        return pager is not None and pager.has(name)


def _folder(path: str) -> Path | None:
    """The real folder an absolute `path` names, or None (relative paths name folders in a root)."""
    if not path or "\x00" in path or not Path(path).is_absolute():
        return None
    real = Path(path).resolve()
    return real if real.is_dir() else None
