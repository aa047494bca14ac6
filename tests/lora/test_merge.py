"""`jaxlora merge`: the merged HF folder gives the same greedy tokens as serving the adapter unmerged."""

import numpy as np

from jaxlora.cli.main import main
from jaxlora.config import LoraConfig
from jaxlora.loading import load_model
from jaxlora.loading.hf_writer import save_hf_folder
from jaxlora.lora.bank import init_bank, set_slot, slot_arrays
from jaxlora.lora.peft_format import load_peft_adapter, save_peft_adapter
from jaxlora.model.params import random_model
from tests.factories import tiny_config, word_tokenizer
from tests.greedy import greedy
from tests.tolerances import assert_close


def test_merged_model_equals_unmerged_adapter(tmp_path):
    cfg = tiny_config()
    base = random_model(cfg, seed=21, std=0.2)
    save_hf_folder(base, word_tokenizer(), tmp_path / "base")
    rng = np.random.default_rng(0)
    weights = {
        m: (
            rng.standard_normal((cfg.num_layers, cfg.module_shape(m)[0], 4), np.float32) * 0.5,
            rng.standard_normal((cfg.num_layers, 4, cfg.module_shape(m)[1]), np.float32) * 0.5,
        )
        for m in ("q_proj", "v_proj", "down_proj")
    }
    save_peft_adapter(tmp_path / "adapter", weights=weights, rank=4, alpha=8)

    assert (
        main(
            [
                "merge",
                "--model",
                str(tmp_path / "base"),
                "--adapter",
                str(tmp_path / "adapter"),
                "--out",
                str(tmp_path / "merged"),
            ]
        )
        == 0
    )
    merged, tok = load_model(tmp_path / "merged")
    assert tok.encode("w3 w4") == [3, 4]

    lora = LoraConfig(max_slots=2, max_rank=4)
    adapter = load_peft_adapter(tmp_path / "adapter", name="a", model_config=cfg, max_rank=4)
    bank = set_slot(init_bank(cfg, lora), 1, slot_arrays(adapter.weights, cfg, lora))
    prompt = [5, 17, 40, 8, 63]
    merged_logits, merged_tokens = greedy(merged, prompt, 16)
    lora_logits, lora_tokens = greedy(base, prompt, 16, bank=bank, slot=1)
    _, base_tokens = greedy(base, prompt, 16)
    assert merged_tokens == lora_tokens
    assert base_tokens != lora_tokens, "the adapter must change the output for this test to mean anything"
    assert_close(merged_logits, lora_logits, "float32")


def test_merge_reports_bad_adapter(tmp_path, capsys):
    base = random_model(tiny_config(), seed=1)
    save_hf_folder(base, word_tokenizer(), tmp_path / "base")
    (tmp_path / "adapter").mkdir()
    assert (
        main(
            [
                "merge",
                "--model",
                str(tmp_path / "base"),
                "--adapter",
                str(tmp_path / "adapter"),
                "--out",
                str(tmp_path / "merged"),
            ]
        )
        == 2
    )
    assert "adapter_config.json" in capsys.readouterr().err
