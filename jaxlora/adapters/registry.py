"""Adapters known to the server: name -> validated, slot-ready weights in host memory.

Each adapter is kept as one device slot wants it, at its rank class: the entries of
`bank.slot_arrays` (modules the adapter leaves alone zero, scale folded into B) in the bank's dtype,
with the rank zero-padded to the smallest class that holds it (R, R/2, R/4, ... down to
`MIN_RANK_CLASS`; `rank_classes`), packed into ONE contiguous 1-D buffer. Where each entry lies in
that buffer (`FlatLayout`: an offset and a shape per leaf of the bank) depends only on the bank's
shapes and the class, so all adapters of one class share it. A page-in is then one host->device copy
of one buffer and one jitted slot write that widens it to rank R on the device when its class is
below R (`slot_writer`, `bank.widen_slot_entries`) and unpacks it with static slices
(`bank.write_slot_flat`), with no host work on the serving path: many small copies (one per group A
and per module B) run at a fraction of the bandwidth of one large one. On GPUs the buffer lives in
`pinned_host` memory, which copies several times faster than ordinary (pageable) numpy
(benchmarks/DECISIONS.md#adapter-page-in).

Why classes: host bytes and host->device bytes follow the adapter's own rank (as S-LoRA stores
adapters), within 2x, instead of R: a rank-8 adapter in a rank-64 bank takes an eighth of a slot,
and S-LoRA's mixed-rank S2 setting (ranks 8-64) fits about twice as many adapters in the same host
memory. A class, not the exact rank, so that the widening writes compile once per class (and write
size) at warm-up, a few shapes, never while serving. Capacity accounting charges the class's bytes.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxlora.config import LoraConfig, ModelConfig
from jaxlora.errors import AdapterError, AdapterExistsError, CapacityError
from jaxlora.lora.bank import (
    Bank,
    bank_groups,
    check_slot_writes,
    flat_slot_layout,
    init_bank,
    widen_slot_entries,
    write_many_flat,
    write_slots_flat,
)
from jaxlora.lora.host_adapter import HostAdapter
from jaxlora.lora.validate import RANK_HINT, check_adapter_name, check_weight_magnitude

# The smallest rank class: below it a class saves less than the extra compiled shape costs.
MIN_RANK_CLASS = 4


def rank_classes(max_rank: int) -> tuple[int, ...]:
    """The ranks host copies are padded to, ascending: R, then R/2, R/4, ... while the halving is
    exact and at least MIN_RANK_CLASS (R=64: 4, 8, 16, 32, 64; R=12: 6, 12; R=3: 3)."""
    classes = [max_rank]
    while classes[-1] % 2 == 0 and classes[-1] // 2 >= MIN_RANK_CLASS:
        classes.append(classes[-1] // 2)
    return tuple(reversed(classes))


def rank_class(rank: int, classes: Iterable[int]) -> int:
    """The smallest of `classes` that holds `rank`."""
    classes = tuple(classes)
    holding = [c for c in classes if rank <= c]
    if not holding:
        raise ValueError(f"rank {rank} exceeds every rank class ({sorted(classes)})")
    return min(holding)


class HostMemory(enum.StrEnum):
    """Where registered adapters are kept on the host."""

    AUTO = "auto"  # pinned_host where the device has it and is an accelerator, else numpy
    PINNED = "pinned"  # JAX arrays in pinned_host memory (page-locked: fast DMA to the device)
    PAGEABLE = "pageable"  # plain numpy arrays


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """Where one slot's entries lie in a flat host buffer (shared by every adapter of one bank).

    Attributes:
      treedef: the structure of one slot's entries (the bank's, without the slot axis).
      leaves: (offset, shape) per leaf, in `tree_leaves` order (see `bank.flat_slot_layout`).
      paths: the key path of each leaf, e.g. ("qkv", "a") or ("qkv", "b", "q_proj").
      size: elements of the buffer; dtype: its dtype (the bank's).
      rank: the rank class the entries are padded to (the bank's R for a full slot).
    """

    treedef: jax.tree_util.PyTreeDef
    leaves: tuple[tuple[int, tuple[int, ...]], ...]
    paths: tuple[tuple[str, ...], ...]
    size: int
    dtype: np.dtype
    rank: int

    @classmethod
    def for_bank(cls, model: ModelConfig, lora: LoraConfig, dtype: jnp.dtype, *, rank: int | None = None) -> FlatLayout:
        """The layout of one slot of the bank, or of its entries padded to rank class `rank` only."""
        rank = lora.max_rank if rank is None else rank
        if not 1 <= rank <= lora.max_rank:
            raise ValueError(f"{rank=} must be in [1, max_rank={lora.max_rank}]")
        narrow = dataclasses.replace(lora, max_rank=rank)
        shapes = jax.eval_shape(lambda: init_bank(model, narrow, dtype))  # no allocation
        with_paths, treedef = jax.tree_util.tree_flatten_with_path(shapes)
        leaves = flat_slot_layout(shapes)
        paths = tuple(tuple(str(k.key) for k in path) for path, _ in with_paths)
        size = leaves[-1][0] + int(np.prod(leaves[-1][1])) if leaves else 0
        return cls(treedef=treedef, leaves=leaves, paths=paths, size=size, dtype=np.dtype(dtype), rank=rank)

    @classmethod
    def classes_for_bank(cls, model: ModelConfig, lora: LoraConfig, dtype: jnp.dtype) -> dict[int, FlatLayout]:
        """rank class -> its layout, for every class of the bank (`rank_classes`)."""
        return {r: cls.for_bank(model, lora, dtype, rank=r) for r in rank_classes(lora.max_rank)}

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def view(self, flat: np.ndarray, path: tuple[str, ...]) -> np.ndarray:
        offset, shape = self.leaves[self.paths.index(path)]
        return flat[offset : offset + int(np.prod(shape))].reshape(shape)

    def unpack(self, flat: np.ndarray) -> Bank:
        """The entries as a pytree of numpy views into `flat` (a 1-D numpy array)."""
        return jax.tree_util.tree_unflatten(
            self.treedef, [flat[o : o + int(np.prod(shape))].reshape(shape) for o, shape in self.leaves]
        )

    def zeros(self) -> np.ndarray:
        return np.zeros(self.size, self.dtype)

    def pack(
        self, weights: Mapping[str, tuple[np.ndarray, np.ndarray]], model: ModelConfig, lora: LoraConfig
    ) -> np.ndarray:
        """Per-module (A [L,in,r], B [L,r,out]) -> one flat buffer holding `slot_arrays(weights)` with
        the rank padded to this layout's class (not to the bank's R), in the layout's dtype, written
        in place (no float32 intermediate of the padded entries).

        Raises ValueError if the adapter targets a module the bank does not hold or its rank exceeds
        the class.
        """
        R = self.rank
        extra = set(weights) - set(lora.target_modules)
        if extra:
            raise ValueError(
                f"adapter targets {sorted(extra)}, which this bank does not hold "
                f"(bank target_modules={list(lora.target_modules)})"
            )
        flat = self.zeros()
        for group, modules in bank_groups(lora):
            a_all = self.view(flat, (group, "a"))
            for i, m in enumerate(modules):
                if m not in weights:
                    continue
                wa, wb = weights[m]
                r = wa.shape[-1]
                if r > R:
                    raise ValueError(f"{m}: rank {r} exceeds the layout's rank class {R}")
                a_all[:, :, i * R : i * R + r] = wa
                self.view(flat, (group, "b", m))[:, :r, :] = wb
        return flat


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class RegisteredAdapter:
    """One adapter as the pager keeps it.

    Attributes:
      flat: one slot's bank entries, rank padded to the adapter's class, packed per `layout` into one
        1-D buffer of the bank dtype: a numpy array, or a JAX array in pinned_host memory.
      layout: where each entry lies in `flat` (shared by all adapters of its rank class).
      max_rank: the bank's R (what `entries` pads to).
      nbytes: host bytes of `flat` (what capacity accounting charges).
      identity: a digest of the weights (`adapter_identity`), the
        adapter's part of its prefix-cache keys: other weights under the same name share nothing.
    """

    name: str
    rank: int
    target_modules: tuple[str, ...]
    source: str
    flat: np.ndarray | jax.Array
    layout: FlatLayout
    max_rank: int
    nbytes: int
    identity: bytes

    @property
    def entries(self) -> Bank:
        """One slot's entries at the bank's rank R, as a pytree of numpy arrays (what the slot holds
        once the adapter is paged in; copied off pinned_host memory if need be)."""
        return widen_slot_entries(self.layout.unpack(np.asarray(self.flat)), self.layout.rank, self.max_rank, xp=np)


def adapter_identity(flat: np.ndarray) -> bytes:
    """The identity of an adapter's weights (its part of prefix-cache keys,
    `jaxlora.engine.prefix_hash`): a digest of its packed bank entries (`flat`, every weight with
    its scale folded in, as one buffer), their dtype and length."""
    h = hashlib.sha256(f"adapter {flat.dtype.str} {flat.size}:".encode())
    h.update(np.ascontiguousarray(flat).view(np.uint8).data)
    return h.digest()


def widen_flat(flat: jax.Array, *, small: FlatLayout, full: FlatLayout) -> jax.Array:
    """A flat buffer of rank class `small.rank` -> the same adapter's flat buffer at `full.rank`
    (traceable, for the device)."""
    if small.treedef != full.treedef:
        raise ValueError("the layouts are of different banks")
    wide = widen_slot_entries(small.unpack(flat), small.rank, full.rank, xp=jnp)
    return jnp.concatenate([leaf.reshape(-1) for leaf in jax.tree_util.tree_leaves(wide)])


def slot_writer(small: FlatLayout, full: FlatLayout) -> Callable[[Bank, np.ndarray, tuple[jax.Array, ...]], Bank]:
    """`bank.write_slots_flat` for flat buffers of rank class `small.rank`: ONE jitted call (the
    bank donated) that widens each buffer to `full.rank` and writes it into its slot, in order.

    The widening is part of the write, not a call of its own after each copy: a call whose input is
    a host->device copy still in flight holds the host for about that copy's time (the reason the
    pager writes all of a commit's page-ins in one call, `bank.write_slots_flat`).
    """
    if small.rank == full.rank:
        return write_slots_flat

    def write(bank: Bank, slots: np.ndarray, flats: tuple[jax.Array, ...]) -> Bank:
        return _widen_and_write(bank, check_slot_writes(slots, len(flats)), tuple(flats), small=small, full=full)

    return write


@functools.partial(jax.jit, static_argnames=("small", "full"), donate_argnums=0)
def _widen_and_write(
    bank: Bank, slots: jax.Array, flats: tuple[jax.Array, ...], *, small: FlatLayout, full: FlatLayout
) -> Bank:
    # Layouts compare by value: pagers of one bank shape share these compiled programs.
    return write_many_flat(bank, slots, tuple(widen_flat(f, small=small, full=full) for f in flats))


def slot_nbytes(model: ModelConfig, lora: LoraConfig, dtype: jnp.dtype, *, rank: int | None = None) -> int:
    """Bytes of one slot's entries at rank class `rank` (default R: a whole slot, the most host
    memory one registered adapter takes)."""
    L, R, itemsize = model.num_layers, lora.max_rank if rank is None else rank, np.dtype(dtype).itemsize
    total = 0
    for _, modules in bank_groups(lora):
        d_in = model.module_shape(modules[0])[0]
        total += L * d_in * len(modules) * R
        total += sum(L * R * model.module_shape(m)[1] for m in modules)
    return total * itemsize


def host_sharding(device: jax.Device, memory: HostMemory) -> jax.sharding.Sharding | None:
    """The sharding registered adapters are put on, or None to keep them as numpy arrays."""
    memory = HostMemory(memory)
    has_pinned = "pinned_host" in {m.kind for m in device.addressable_memories()}
    if memory is HostMemory.PAGEABLE or (memory is HostMemory.AUTO and (device.platform == "cpu" or not has_pinned)):
        return None
    if not has_pinned:
        raise ValueError(f"device {device} has no pinned_host memory")
    return jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")


def load_host_adapter(name: str, source: str | Path | HostAdapter, model: ModelConfig, lora: LoraConfig) -> HostAdapter:
    """`source` itself if it is a HostAdapter, else the PEFT folder it names, read and validated."""
    if isinstance(source, HostAdapter):
        return source
    if not isinstance(source, (str, Path)):
        raise AdapterError(
            f"adapter {name!r}: source must be a PEFT folder path or a HostAdapter, got {type(source).__name__}"
        )
    from jaxlora.lora.peft_format import load_peft_adapter  # reads files; only needed for paths

    try:
        return load_peft_adapter(source, name=name, model_config=model, max_rank=lora.max_rank)
    except AdapterError:
        raise
    except (OSError, ValueError) as e:
        raise AdapterError(f"adapter {name!r} ({source}): {e}") from e


def check_host_adapter(
    name: str, adapter: HostAdapter, model: ModelConfig, lora: LoraConfig, *, weights: bool = True
) -> None:
    """Raises AdapterError unless `adapter` fits the model and the bank and (with `weights`) its
    weights are finite and within MAX_ADAPTER_WEIGHT (jaxlora.lora.validate). `weights=False` for
    an adapter read from a PEFT folder: the reader checked them as it stacked them."""
    where = f"adapter {name!r}"
    extra = sorted(set(adapter.target_modules) - set(lora.target_modules))
    if extra:
        raise AdapterError(
            f"{where}: targets {extra}, which the bank does not hold (target_modules={list(lora.target_modules)})"
        )
    if adapter.rank > lora.max_rank:
        raise AdapterError(f"{where}: rank={adapter.rank} must be <= max_rank={lora.max_rank} ({RANK_HINT})")
    for module, (a, b) in adapter.weights.items():
        d_in, d_out = model.module_shape(module)
        r = a.shape[-1]
        if a.shape != (model.num_layers, d_in, r) or b.shape != (model.num_layers, r, d_out):
            raise AdapterError(
                f"{where}: {module} has a {a.shape}, b {b.shape}; the model wants "
                f"a [{model.num_layers}, {d_in}, r], b [{model.num_layers}, r, {d_out}]"
            )
        for which, x in (("a", a), ("b", b)) if weights else ():
            check_weight_magnitude(f"{where}: {module}.{which}", x)


def load_checked_adapter(
    name: str, source: str | Path | HostAdapter, model: ModelConfig, lora: LoraConfig
) -> HostAdapter:
    """The adapter `source` gives (`load_host_adapter`), its name and its fit to the model and the
    bank checked; AdapterError otherwise."""
    check_adapter_name(name)
    adapter = load_host_adapter(name, source, model, lora)
    # A PEFT folder's weights were bound-checked as the reader stacked them; a HostAdapter's were not.
    check_host_adapter(name, adapter, model, lora, weights=isinstance(source, HostAdapter))
    return adapter


def prepare_adapter(
    name: str,
    source: str | Path | HostAdapter,
    *,
    model: ModelConfig,
    lora: LoraConfig,
    dtype: jnp.dtype,
    sharding: jax.sharding.Sharding | None,
    layouts: Mapping[int, FlatLayout] | None = None,
) -> RegisteredAdapter:
    """Loads, validates and pads one adapter to its rank class into host memory (slow: call it
    without locks held). `layouts`: `FlatLayout.classes_for_bank(model, lora, dtype)`, made once
    by the caller.

    Raises:
      AdapterError: the name is invalid or the adapter does not fit the model or the bank.
    """
    adapter = load_checked_adapter(name, source, model, lora)
    layouts = layouts or FlatLayout.classes_for_bank(model, lora, dtype)
    layout = layouts[rank_class(adapter.rank, layouts)]
    flat = layout.pack(adapter.weights, model, lora)
    identity = adapter_identity(flat)
    if sharding is not None:
        flat = jax.block_until_ready(jax.device_put(flat, sharding))
    source_text = adapter.source if isinstance(source, HostAdapter) else str(source)
    return RegisteredAdapter(
        name=name,
        rank=adapter.rank,
        target_modules=adapter.target_modules,
        source=source_text or "<memory>",
        flat=flat,
        layout=layout,
        max_rank=lora.max_rank,
        nbytes=flat.nbytes,
        identity=identity,
    )


class Registry:
    """name -> RegisteredAdapter with a byte budget. Not thread-safe: the pager holds its lock.

    Registration is two-phase so that the slow load runs unlocked: `reserve` claims the name and
    the bytes, then `add` fills them in (or `cancel` gives them back when the load fails), so a
    failed load never appears in the registry and two loads cannot overrun the budget.
    """

    def __init__(self, capacity_bytes: int | None = None) -> None:
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError(f"{capacity_bytes=} must be >= 0")
        self.capacity_bytes = capacity_bytes
        self._adapters: dict[str, RegisteredAdapter] = {}
        self._reserved: dict[str, int] = {}

    @property
    def used_bytes(self) -> int:
        return sum(a.nbytes for a in self._adapters.values()) + sum(self._reserved.values())

    def __contains__(self, name: str) -> bool:
        return name in self._adapters

    def __len__(self) -> int:
        return len(self._adapters)

    def get(self, name: str) -> RegisteredAdapter | None:
        return self._adapters.get(name)

    def names(self) -> list[str]:
        return list(self._adapters)

    def reserve(self, name: str, nbytes: int) -> None:
        """Claims `name` and `nbytes` for a load about to start.

        Raises:
          AdapterExistsError: the name is registered or being registered.
          CapacityError: the bytes do not fit in what is left of the budget.
        """
        if name in self._adapters or name in self._reserved:
            raise AdapterExistsError(f"adapter name {name!r} is already registered")
        if self.capacity_bytes is not None and self.used_bytes + nbytes > self.capacity_bytes:
            raise CapacityError(
                f"host adapter memory is full: adapter {name!r} needs {nbytes / 2**20:.1f} MiB, "
                f"{(self.capacity_bytes - self.used_bytes) / 2**20:.1f} MiB of "
                f"{self.capacity_bytes / 2**20:.1f} MiB left ({len(self)} adapters registered); "
                "unregister some or raise the host capacity"
            )
        self._reserved[name] = nbytes

    def cancel(self, name: str) -> None:
        self._reserved.pop(name, None)

    def add(self, adapter: RegisteredAdapter) -> None:
        """Completes a reservation (the adapter's bytes replace the reserved estimate)."""
        if self._reserved.pop(adapter.name, None) is None:
            raise ValueError(f"adapter {adapter.name!r} was not reserved")
        self._adapters[adapter.name] = adapter

    def remove(self, name: str) -> RegisteredAdapter:
        return self._adapters.pop(name)
