"""`jaxlora.engine.load.load_engine`: the model loads on a thread while the adapters register."""

import threading
from pathlib import Path

import numpy as np
import pytest

import jaxlora.adapters.register_many
import jaxlora.loading
from jaxlora.cli.startup import StartupClock
from jaxlora.engine.config import EngineConfig
from jaxlora.engine.load import EngineSpec, load_engine
from jaxlora.errors import AdapterError, ModelLoadError
from jaxlora.loading import read_model_config
from jaxlora.loading.hf_writer import save_hf_folder
from jaxlora.lora.peft_format import save_peft_adapter
from tests.factories import random_adapter, tiny_lora, tiny_model, word_tokenizer

MODULES = ("q_proj", "v_proj")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("load")
    model = tiny_model(seed=3)
    save_hf_folder(model, word_tokenizer(), root / "model")
    for i in range(3):
        adapter = random_adapter(f"a{i}", model.config, modules=MODULES, rng=i)
        save_peft_adapter(root / f"a{i}", weights=adapter.weights, rank=4, alpha=8.0, target_modules=MODULES)
    return root


def _spec(files: Path, **adapters: str) -> EngineSpec:
    config = EngineConfig(max_batch=2, max_seq_len=32, token_budgets=(8,), lora=tiny_lora(max_slots=4))
    return EngineSpec(model=str(files / "model"), config=config, adapters=adapters)


def test_adapters_register_while_the_model_loads(files, monkeypatch):
    # The model's load waits until every adapter is registered: done one after the other (load
    # first), this would time out instead.
    registered = threading.Event()
    real_load = jaxlora.loading.load_model
    real_register = jaxlora.adapters.register_many.register_many

    def load_after_adapters(*args, **kwargs):
        if not registered.wait(timeout=60):
            raise TimeoutError("the adapters were not registered while the model loaded")
        return real_load(*args, **kwargs)

    def register_then_signal(pager, adapters, **kwargs):
        infos = real_register(pager, adapters, **kwargs)
        registered.set()
        return infos

    monkeypatch.setattr(jaxlora.loading, "load_model", load_after_adapters)
    monkeypatch.setattr(jaxlora.adapters.register_many, "register_many", register_then_signal)
    clock = StartupClock()
    engine = load_engine(_spec(files, **{f"a{i}": str(files / f"a{i}") for i in range(3)}), clock=clock)
    assert sorted(a.name for a in engine.pager.list()) == ["a0", "a1", "a2"]
    assert engine.model.config == read_model_config(files / "model")
    assert set(clock.seconds) == {"load", "register"} and min(clock.seconds.values()) >= 0.0


def test_a_bad_adapter_fails_the_load_by_name(files):
    with pytest.raises(AdapterError, match="nowhere"):
        load_engine(_spec(files, a0=str(files / "a0"), bad=str(files / "nowhere")))


def test_the_model_error_comes_first_when_both_fail(files, tmp_path):
    broken = tmp_path / "model"
    broken.mkdir()
    for f in (files / "model").iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    spec = _spec(files, bad=str(files / "nowhere"))
    with pytest.raises(ModelLoadError, match="cannot read safetensors file"):
        load_engine(EngineSpec(model=str(broken), config=spec.config, adapters=spec.adapters))


def test_read_model_config_reads_no_weights(files, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_bytes((files / "model" / "config.json").read_bytes())
    config = read_model_config(folder)  # no safetensors file at all: only config.json is read
    assert config.num_layers == tiny_model(seed=3).config.num_layers
    with pytest.raises(ModelLoadError, match="no such model file or folder"):
        read_model_config(tmp_path / "absent")
    assert np.isfinite(config.rms_norm_eps)
