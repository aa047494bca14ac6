"""The engine's adapter contract: both sources implement all of `AdapterSource`, and an engine over
the all-resident `ResidentBank` gives the same greedy tokens as one over the paging `Pager`."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from jaxlora.adapters import AdapterSource, Pager, ResidentBank
from jaxlora.engine.engine import Engine
from jaxlora.errors import AdapterError, UnknownAdapterError
from jaxlora.lora.bank import init_bank, set_slot, slot_arrays
from tests.engine.conftest import ADAPTERS, engine_config, make_engine
from tests.engine.test_engine import traffic

# Every member the engine and the scheduler call (engine.py, scheduler.py, adapter_admission.py); the
# protocol holds them all.
USED = {
    "acquire",
    "release",
    "is_ready",
    "slot_at_commit",
    "slot_of",
    "can_place",
    "identity",
    "prefetch",
    "stage",
    "commit",
    "warmup",
    "bank",
    "mesh",
    "max_slots",
    "metrics",
    "register",
    "unregister",
    "has",
    "list",
}
ENGINE_DIR = Path(__file__).resolve().parents[2] / "jaxlora" / "engine"
RESIDENT = ADAPTERS[:3]  # the engine config's 4 slots: the base and three adapters


def protocol_members() -> set[str]:
    return {n for n in vars(AdapterSource) if not n.startswith("_")}


def resident_bank(parts) -> ResidentBank:
    """RESIDENT[i] in slot i + 1, written with the bank's own slot writer (not the pager's)."""
    model, _, adapters = parts
    lora = engine_config().lora
    bank = init_bank(model.config, lora, model.dtype)
    for slot, name in enumerate(RESIDENT, start=1):
        bank = set_slot(bank, slot, slot_arrays(adapters[name].weights, model.config, lora))
    return ResidentBank(bank, RESIDENT)


def test_the_protocol_holds_every_member_the_engine_uses():
    assert protocol_members() == USED


def members_read_in_source() -> set[str]:
    """Attributes read off the adapter source in engine.py (`pager.X`, `self.pager.X`), scheduler.py
    and adapter_admission.py (`self.slots.X`), found with ast: a member used there must be in the
    protocol."""
    found = set()
    for module, names in (("engine", {"pager"}), ("scheduler", {"slots"}), ("adapter_admission", {"slots"})):
        tree = ast.parse((ENGINE_DIR / f"{module}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                owner = node.value
                name = (
                    owner.attr
                    if isinstance(owner, ast.Attribute)
                    else owner.id
                    if isinstance(owner, ast.Name)
                    else None
                )
                if name in names:
                    found.add(node.attr)
    return found


def test_every_member_read_in_the_engine_and_the_scheduler_is_in_the_protocol():
    read = members_read_in_source()
    assert {"acquire", "identity", "commit", "bank", "mesh"} <= read  # the scan sees every file
    assert read <= protocol_members(), read - protocol_members()


@pytest.mark.parametrize("kind", ["pager", "resident"])
def test_both_sources_implement_the_whole_protocol(parts, kind):
    model, _, _ = parts
    source = Pager(model.config, engine_config().lora, dtype=model.dtype) if kind == "pager" else resident_bank(parts)
    for name in protocol_members():
        assert hasattr(source, name), name
        declared = getattr(AdapterSource, name)
        if inspect.isfunction(declared):
            assert list(inspect.signature(declared).parameters)[1:] == list(
                inspect.signature(getattr(source, name)).parameters
            ), name
    assert source.max_slots == engine_config().lora.max_slots and source.mesh is None


def test_resident_bank_serves_a_fixed_set(parts):
    source = resident_bank(parts)
    assert [(i.name, i.resident, i.in_flight) for i in source.list()] == [(n, s, 0) for s, n in enumerate(RESIDENT, 1)]
    assert source.acquire(RESIDENT[1]) == 2 and source.is_ready(RESIDENT[1]) == 2
    assert source.slot_at_commit(RESIDENT[1]) == source.slot_of(RESIDENT[1]) == 2
    assert [i.in_flight for i in source.list()] == [0, 1, 0] and source.metrics.hits == 1
    source.release(RESIDENT[1])
    with pytest.raises(ValueError, match="without a matching acquire"):
        source.release(RESIDENT[1])
    assert not source.has(ADAPTERS[4]) and not source.can_place(ADAPTERS[4]) and source.slot_of(ADAPTERS[4]) is None
    with pytest.raises(UnknownAdapterError):
        source.acquire(ADAPTERS[4])
    with pytest.raises(AdapterError, match="fixed set"):
        source.register("new", parts[2][ADAPTERS[4]])
    with pytest.raises(AdapterError, match="fixed set"):
        source.unregister(RESIDENT[0])
    with pytest.raises(ValueError, match="do not fit"):
        ResidentBank(source.bank, ADAPTERS)


def test_resident_engine_matches_the_paging_engine(parts):
    requests = [r for r in traffic(12, seed=3) if r.adapter in (None, *RESIDENT)]
    assert {r.adapter for r in requests} == {None, *RESIDENT}
    paged = make_engine(parts).generate(requests)
    model, tok, _ = parts
    engine = Engine(model, tok, engine_config(), resident_bank(parts))
    engine.warmup()
    resident = engine.generate(requests)
    assert [o.error for o in resident] == [None] * len(requests)
    assert [o.token_ids for o in resident] == [o.token_ids for o in paged]
    assert engine.compiles_after_warmup == 0
    stats = engine.stats()["pager"]
    assert stats["hits"] == sum(r.adapter is not None for r in requests) and stats["page_ins"] == 0
