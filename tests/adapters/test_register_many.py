"""register_many: start-up's registrations from threads give what one-by-one registration gives, and
the first failure in the flags' order is the one raised."""

from __future__ import annotations

import numpy as np
import pytest

from jaxlora.adapters import PagedPager, Pager
from jaxlora.adapters.register_many import register_many
from jaxlora.config import LoraBank
from jaxlora.errors import AdapterError, CapacityError
from jaxlora.lora.peft_format import save_peft_adapter
from tests.factories import random_adapters, tiny_config, tiny_lora

MODEL = tiny_config()


def _folders(tmp_path, adapters) -> dict:
    return {
        a.name: save_peft_adapter(tmp_path / a.name, weights=dict(a.weights), rank=a.rank, alpha=2 * a.rank)
        for a in adapters
    }


@pytest.mark.parametrize("bank", [LoraBank.PADDED, LoraBank.PAGED])
def test_threads_register_what_a_loop_registers(tmp_path, bank):
    lora = tiny_lora(bank=bank)
    make = PagedPager if bank is LoraBank.PAGED else Pager
    folders = _folders(tmp_path, random_adapters(12, MODEL, lora, seed=3))
    one_by_one, threaded = make(MODEL, lora), make(MODEL, lora)
    for name, folder in folders.items():
        one_by_one.register(name, folder)
    infos = register_many(threaded, folders, threads=4)
    assert list(infos) == list(folders)  # the mapping's order
    assert [(i.name, i.rank) for i in infos.values()] == [(i.name, i.rank) for i in one_by_one.list()]
    for name in folders:
        assert threaded.identity(name) == one_by_one.identity(name)
        np.testing.assert_array_equal(
            np.asarray(threaded.host_adapter(name).flat), np.asarray(one_by_one.host_adapter(name).flat)
        )


def test_the_first_failure_in_order_is_raised_after_the_others_ran(tmp_path):
    lora = tiny_lora()
    ads = random_adapters(6, MODEL, lora, seed=4)
    folders = _folders(tmp_path, ads)
    (folders[ads[4].name] / "adapter_model.safetensors").write_bytes(b"\x00" * 40)  # corrupt, later
    folders = {**folders, "missing": tmp_path / "nowhere"}  # also bad, last
    bad_first = {ads[0].name: folders[ads[0].name], "bad/name": folders[ads[1].name], **folders}
    pager = Pager(MODEL, lora)
    with pytest.raises(AdapterError, match="bad/name"):
        register_many(pager, bad_first, threads=3)
    registered = {i.name for i in pager.list()}
    assert registered == {a.name for a in ads} - {ads[4].name}  # every good one ran to its end


def test_a_full_host_budget_is_raised_as_itself(tmp_path):
    lora = tiny_lora()
    probe = Pager(MODEL, lora)
    ads = random_adapters(5, MODEL, lora, seed=6)
    pager = Pager(MODEL, lora, host_capacity_bytes=3 * probe.slot_nbytes + 1)
    with pytest.raises(CapacityError, match="host adapter memory is full"):
        register_many(pager, {a.name: a for a in ads}, threads=4)
    assert len(pager.list()) == 3


def test_one_info_line_for_all_adapters(tmp_path, caplog):
    """Thousands of start-up adapters log one INFO line, not one each (each source at DEBUG)."""
    lora = tiny_lora()
    folders = _folders(tmp_path, random_adapters(5, MODEL, lora, seed=6))
    with caplog.at_level("DEBUG", logger="jaxlora.adapters.register_many"):
        register_many(Pager(MODEL, lora), folders, threads=2)
    info = [r.getMessage() for r in caplog.records if r.levelname == "INFO"]
    assert len(info) == 1 and info[0].startswith("registered 5 adapter(s) in ") and info[0].endswith("on 2 thread(s)")
    assert sum(r.levelname == "DEBUG" for r in caplog.records) == 5
