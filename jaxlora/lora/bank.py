"""The device adapter bank: every slot's LoRA weights, stacked, one array per layer group.

Layout (a plain nested dict, so it is a pytree that jit can donate and lax.scan can slice by layer):

    bank[group]["a"]          [num_layers, max_slots, in_features, len(modules) * max_rank]
    bank[group]["b"][module]  [num_layers, max_slots, max_rank, out_features]

Modules that read the same input share one group and one shrink: q/k/v read the attention input,
gate/up read the MLP input. Their A matrices are stacked along the rank axis, so one shrink launch
serves the whole group; module i of a group uses rank columns [i*R, (i+1)*R). Ranks below R are
zero-padded (padding adds exact zeros) and the PEFT scale is folded into B. Slot 0 stays all-zero:
it is the base model.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxlora.config import LoraConfig, ModelConfig

Bank = dict[str, dict]

# (group name, modules in the group). Modules of one group share their input activation.
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("qkv", ("q_proj", "k_proj", "v_proj")),
    ("o", ("o_proj",)),
    ("gate_up", ("gate_proj", "up_proj")),
    ("down", ("down_proj",)),
)


def bank_groups(lora: LoraConfig) -> list[tuple[str, tuple[str, ...]]]:
    """The groups that hold at least one targeted module, with only the targeted modules."""
    out = []
    for group, modules in GROUPS:
        targeted = tuple(m for m in modules if m in lora.target_modules)
        if targeted:
            out.append((group, targeted))
    return out


def init_bank(model: ModelConfig, lora: LoraConfig, dtype: jnp.dtype = jnp.float32) -> Bank:
    """An all-zero bank: every slot serves the base model until an adapter is written into it."""
    bank: Bank = {}
    L, S, R = model.num_layers, lora.max_slots, lora.max_rank
    for group, modules in bank_groups(lora):
        d_in = model.module_shape(modules[0])[0]
        bank[group] = {
            "a": jnp.zeros((L, S, d_in, len(modules) * R), dtype),
            "b": {m: jnp.zeros((L, S, R, model.module_shape(m)[1]), dtype) for m in modules},
        }
    return bank


def slot_arrays(weights: Mapping[str, tuple[np.ndarray, np.ndarray]], model: ModelConfig, lora: LoraConfig) -> Bank:
    """One slot's worth of bank entries (no slot axis) from per-module (A [L,in,r], B [L,r,out]).

    Modules the adapter does not target get zeros; ranks are zero-padded to R.
    Raises ValueError if the adapter targets a module the bank does not hold or its rank exceeds R.
    """
    L, R = model.num_layers, lora.max_rank
    extra = set(weights) - set(lora.target_modules)
    if extra:
        raise ValueError(
            f"adapter targets {sorted(extra)}, which this bank does not hold "
            f"(bank target_modules={list(lora.target_modules)})"
        )
    out: Bank = {}
    for group, modules in bank_groups(lora):
        d_in = model.module_shape(modules[0])[0]
        a = np.zeros((L, d_in, len(modules) * R), np.float32)
        bs = {}
        for i, m in enumerate(modules):
            b = np.zeros((L, R, model.module_shape(m)[1]), np.float32)
            if m in weights:
                wa, wb = weights[m]
                r = wa.shape[-1]
                if r > R:
                    raise ValueError(f"{m}: rank {r} exceeds the bank's max_rank={R}")
                a[:, :, i * R : i * R + r] = wa
                b[:, :r, :] = wb
            bs[m] = b
        out[group] = {"a": a, "b": bs}
    return out


def widen_slot_entries(entries: Bank, rank: int, max_rank: int, *, xp=jnp) -> Bank:
    """One slot's entries padded to rank `rank` -> the same entries at the bank's rank `max_rank`.

    A group's stacked A [L, in, G*rank] holds module i in columns [i*rank, (i+1)*rank); at
    max_rank module i moves to [i*max_rank, i*max_rank + rank) with zeros after it, and each B
    [L, rank, out] gains zero rows. `xp` is numpy (host) or jax.numpy (traceable, on the device).
    """
    if rank == max_rank:
        return entries
    if not 1 <= rank < max_rank:
        raise ValueError(f"{rank=} must be in [1, {max_rank=}]")
    pad = max_rank - rank
    out: Bank = {}
    for group, entry in entries.items():
        a = entry["a"]
        L, d_in, stacked = a.shape
        if stacked % rank:
            raise ValueError(f"{group}: stacked rank {stacked} is not a multiple of {rank=}")
        g = stacked // rank
        a = xp.pad(a.reshape(L, d_in, g, rank), ((0, 0), (0, 0), (0, 0), (0, pad))).reshape(L, d_in, g * max_rank)
        bs = {m: xp.pad(b, ((0, 0), (0, pad), (0, 0))) for m, b in entry["b"].items()}
        out[group] = {"a": a, "b": bs}
    return out


def _write(bank: Bank, slot: jax.Array, entries: Bank) -> Bank:
    return jax.tree_util.tree_map(lambda full, one: full.at[:, slot].set(one.astype(full.dtype)), bank, entries)


# The bank is donated: the write happens in place, no second copy of the bank ever exists.
write_slot = jax.jit(_write, donate_argnums=0)


def set_slot(bank: Bank, slot: int, entries: Bank) -> Bank:
    """Writes one adapter's entries (from `slot_arrays`) into `slot`; returns the new bank."""
    if slot == 0:
        raise ValueError("slot 0 is the reserved base-model slot and cannot hold an adapter")
    return write_slot(bank, jnp.asarray(slot, jnp.int32), entries)


def reset_slot(bank: Bank, slot: int) -> Bank:
    """Zeroes `slot` so that it reproduces the base model exactly."""
    zeros = jax.tree_util.tree_map(lambda full: jnp.zeros(full.shape[:1] + full.shape[2:], full.dtype), bank)
    return write_slot(bank, jnp.asarray(slot, jnp.int32), zeros)


def flat_slot_layout(bank: Bank) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """Where each entry of one slot lies in a flat (1-D) host buffer: (offset, shape) per leaf.

    Leaves are in `jax.tree_util.tree_leaves` order of the bank; shapes drop the slot axis, as in
    `slot_arrays`. Works on arrays and on `jax.ShapeDtypeStruct`s (only shapes are read), so a layout
    depends on the bank's shapes alone: every adapter of one bank shares it.
    """
    out, offset = [], 0
    for full in jax.tree_util.tree_leaves(bank):
        shape = tuple(full.shape[:1]) + tuple(full.shape[2:])
        out.append((offset, shape))
        offset += int(np.prod(shape))
    return tuple(out)


def _write_flat(bank: Bank, slot: jax.Array, flat: jax.Array) -> Bank:
    leaves, treedef = jax.tree_util.tree_flatten(bank)
    written = []
    for full, (offset, shape) in zip(leaves, flat_slot_layout(bank)):
        one = flat[offset : offset + int(np.prod(shape))].reshape(shape)  # static slice: layout is static
        written.append(full.at[:, slot].set(one.astype(full.dtype)))
    return jax.tree_util.tree_unflatten(treedef, written)


def write_slot_flat(bank: Bank, slot: int, flat: jax.Array) -> Bank:
    """Writes one adapter's entries, packed into one 1-D buffer per `flat_slot_layout`, into `slot`.

    Produces exactly what `set_slot` does with the unpacked entries; one copy to the device instead
    of one per leaf. Returns the new bank (the old one is donated).
    """
    return write_slots_flat(bank, np.array([slot], np.int32), (flat,))


def write_many_flat(bank: Bank, slots: jax.Array, flats: tuple[jax.Array, ...]) -> Bank:
    """The traceable body of `write_slots_flat`, without its checks: for callers that compose the
    writes into a jitted program of their own (benchmarks/probes/pagein.py)."""
    for i, flat in enumerate(flats):  # in order: a later write to the same slot wins
        bank = _write_flat(bank, slots[i], flat)
    return bank


# One program for k slot writes; k (len(flats)) is part of the compiled shape.
write_slots_flat_jit = jax.jit(write_many_flat, donate_argnums=0)


def write_slots_flat(bank: Bank, slots: np.ndarray, flats: tuple[jax.Array, ...]) -> Bank:
    """Writes k adapters' flat buffers into `slots` [k] in ONE jitted call, in order.

    One call instead of k: on the H200 each call whose input is a host->device copy still in
    flight held the host for about that copy's time (benchmarks/results/probes/pagein/pagein_probe.json), so k
    separate writes serialized the host on the copies. Returns the new bank (the old one is donated).
    """
    return write_slots_flat_jit(bank, check_slot_writes(slots, len(flats)), tuple(flats))


def check_slot_writes(slots: np.ndarray, num_flats: int) -> np.ndarray:
    """`slots` as int32 [num_flats], one adapter slot per flat buffer; ValueError otherwise."""
    slots = np.asarray(slots, np.int32)
    if slots.shape != (num_flats,):
        raise ValueError(f"{slots.shape=} must be ({num_flats},), one slot per flat buffer")
    if (slots <= 0).any():
        raise ValueError("slot 0 is the reserved base-model slot and cannot hold an adapter")
    return slots
