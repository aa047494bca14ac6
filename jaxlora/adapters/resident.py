"""`ResidentBank`: the adapter source whose adapters are all in the device bank for good.

For benchmarks and tests that measure decoding, not paging: the bank is built up front (drawn on the
device, or written slot by slot), adapter `names[i]` lives in slot i + 1, and nothing is ever paged
in or evicted. It implements the whole `AdapterSource` contract; the paging members have nothing to
do, and adapters cannot be added or removed at run time (use `Pager` for that).
"""

from __future__ import annotations

import collections
import hashlib
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import jax

from jaxlora.adapters.metrics import PagerMetrics
from jaxlora.adapters.pager import AdapterInfo
from jaxlora.config import TARGET_MODULES
from jaxlora.errors import AdapterError, UnknownAdapterError
from jaxlora.lora.bank import Bank
from jaxlora.lora.host_adapter import HostAdapter

_SOURCE = "<resident bank>"


class ResidentBank:
    """A fixed set of adapters, every one resident in the device bank.

    Args:
      bank: the device bank (`jaxlora.lora.bank` layout); slot i + 1 holds `names[i]`, and slot 0
        must stay all zero (the base model).
      names: adapter names, in slot order from slot 1.
    """

    def __init__(self, bank: Bank, names: Sequence[str]) -> None:
        self.bank = bank
        self.max_slots = _num_slots(bank)
        if len(names) > self.max_slots - 1:
            raise ValueError(f"{len(names)} adapters do not fit a bank of {self.max_slots} slots (slot 0 is the base)")
        if len(set(names)) != len(names):
            raise ValueError(f"adapter names must be distinct, got {list(names)}")
        self.mesh: jax.sharding.Mesh | None = None
        self.metrics = PagerMetrics()
        self._slots = {name: slot for slot, name in enumerate(names, start=1)}
        self._pins: collections.Counter[str] = collections.Counter()
        self._rank, self._modules = _rank_and_modules(bank)
        self._slot_nbytes = sum(leaf.nbytes // self.max_slots for leaf in jax.tree.leaves(bank))
        # The weights never change while this bank lives, so (this bank, slot) names them: no need to
        # read gigabytes of device weights back to digest them.
        self._nonce = os.urandom(16)

    # Slots: every adapter is written, so every query answers its slot at once.
    def acquire(self, name: str) -> int:
        slot = self._slot(name)
        self._pins[name] += 1
        self.metrics.hits += 1
        return slot

    def release(self, name: str) -> None:
        if not self._pins[name]:
            raise ValueError(f"release({name!r}) without a matching acquire")
        self._pins[name] -= 1

    def is_ready(self, name: str) -> int | None:
        return self._slots.get(name)

    def slot_at_commit(self, name: str) -> int | None:
        return self._slots.get(name)

    def slot_of(self, name: str) -> int | None:
        return self._slots.get(name)

    def can_place(self, name: str) -> bool:
        return name in self._slots

    def identity(self, name: str) -> bytes:
        return hashlib.sha256(self._nonce + self._slot(name).to_bytes(4, "little")).digest()

    # Device work: nothing is ever paged in, so there is nothing to copy, write or compile.
    def prefetch(self, names: Iterable[str]) -> None:
        pass

    def stage(self) -> None:
        pass

    def commit(self) -> None:
        pass

    def warmup(self) -> None:
        pass

    def place_on(self, mesh: jax.sharding.Mesh) -> None:
        """Splits the bank over a tensor-parallel mesh: the one the engine will be given."""
        from jaxlora.parallel.sharding import shard_bank

        self.bank = shard_bank(self.bank, mesh)
        self.mesh = mesh

    # Registry: fixed at construction.
    def register(self, name: str, source: str | Path | HostAdapter) -> AdapterInfo:
        raise AdapterError(
            f"cannot register adapter {name!r}: a ResidentBank holds a fixed set of adapters "
            "(use jaxlora.adapters.Pager to add adapters at run time)"
        )

    def unregister(self, name: str, *, wait: bool = True, timeout: float | None = None) -> None:
        raise AdapterError(
            f"cannot unregister adapter {name!r}: a ResidentBank holds a fixed set of adapters "
            "(use jaxlora.adapters.Pager to remove adapters at run time)"
        )

    def has(self, name: str) -> bool:
        return name in self._slots

    def list(self) -> list[AdapterInfo]:
        return [
            AdapterInfo(
                name=name,
                rank=self._rank,
                target_modules=self._modules,
                nbytes=self._slot_nbytes,
                resident=slot,
                in_flight=self._pins[name],
                source=_SOURCE,
            )
            for name, slot in self._slots.items()
        ]

    def _slot(self, name: str) -> int:
        slot = self._slots.get(name)
        if slot is None:
            raise UnknownAdapterError(f"adapter {name!r} is not in the resident bank")
        return slot


def _num_slots(bank: Bank) -> int:
    """S of a bank whose leaves are [L, S, ...]."""
    sizes = {leaf.shape[1] for leaf in jax.tree.leaves(bank)}
    if len(sizes) != 1:
        raise ValueError(f"bank leaves disagree on the slot count: {sorted(sizes)}")
    return sizes.pop()


def _rank_and_modules(bank: Bank) -> tuple[int, tuple[str, ...]]:
    """The bank's max rank R and its target modules (each slot is padded to them)."""
    b = {m: leaf for group in bank.values() for m, leaf in group["b"].items()}  # [L, S, R, out]
    return next(iter(b.values())).shape[2], tuple(m for m in TARGET_MODULES if m in b)
