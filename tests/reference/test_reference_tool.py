"""Smoke tests of the Hugging Face reference tool itself (tests/reference/): each job kind once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.reference import client

pytestmark = pytest.mark.reference

N_NEW = 5
TINY_PROMPTS = [[1, 17, 99, 3, 42], [1, 250, 7]]


def _ref(*keys) -> dict:
    return {"__result__": list(keys)}


ADAPTER_SPECS = {
    "attn": {"r": 4, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"], "seed": 1},
    "all": {"r": 8, "lora_alpha": 8, "target_modules": "all-linear", "use_rslora": True, "seed": 2,
            "save_dtype": "bfloat16"},
}  # fmt: skip

# One subprocess for every tiny-model check: later jobs use earlier artifacts through __result__.
TINY_BATCH = {
    "kind": "batch",
    "jobs": [
        # 0: untied embeddings and a sharded checkpoint, so the index-file path is exercised.
        {"kind": "make_tiny_model", "arch": "llama", "config": {"tie_word_embeddings": False},
         "seed": 3, "max_shard_size": "200KB"},
        # 1: Qwen2 has q/k/v bias.
        {"kind": "make_tiny_model", "arch": "qwen2", "seed": 4},
        # 2: mixed rows, adapters made inline.
        {"kind": "generate", "model": {"hf_dir": _ref(0, "path")}, "prompts": TINY_PROMPTS,
         "n_new": N_NEW, "logits": "sequence", "adapters": ADAPTER_SPECS,
         "rows": [{"prompt": 0, "adapter": "attn"}, {"prompt": 0, "adapter": None},
                  {"prompt": 1, "adapter": "all"}, {"prompt": 0, "adapter": "all"}]},
        # 3: the plain model, no PEFT.
        {"kind": "generate", "model": {"hf_dir": _ref(0, "path")}, "prompts": TINY_PROMPTS[:1],
         "n_new": N_NEW, "logits": "sequence"},
        # 4
        {"kind": "make_adapters", "model": {"hf_dir": _ref(0, "path")}, "adapters": [
            {"name": "pat", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "down_proj"],
             "rank_pattern": {"down_proj": 2}, "alpha_pattern": {"q_proj": 4},
             "layers_to_transform": [1], "seed": 5},
            {"name": "re", "r": 3, "target_modules": r".*\.(v_proj|up_proj)", "seed": 6,
             "save_dtype": "float16"},
        ]},
        # 5, 6: merge job 2's "attn" adapter, then run the merged folder.
        {"kind": "merge", "model": {"hf_dir": _ref(0, "path")}, "adapter": _ref(2, "adapters", "attn")},
        {"kind": "generate", "model": {"hf_dir": _ref(5, "path")}, "prompts": TINY_PROMPTS[:1],
         "n_new": N_NEW, "logits": "sequence"},
        # 7: an adapter on the biased Qwen2 model.
        {"kind": "generate", "model": {"hf_dir": _ref(1, "path")}, "prompts": TINY_PROMPTS,
         "n_new": N_NEW, "adapters": {"all": ADAPTER_SPECS["all"]},
         "rows": [{"prompt": 0, "adapter": "all"}, {"prompt": 1, "adapter": None}]},
    ],
}  # fmt: skip


@pytest.fixture(scope="module")
def tiny(reference) -> list[dict]:
    return reference(TINY_BATCH)["results"]


@pytest.fixture(scope="module")
def tiny_llama(tiny) -> dict:
    return tiny[0]


@pytest.fixture(scope="module")
def tiny_generate(tiny) -> dict:
    return tiny[2]


def test_tiny_model_is_sharded_untied_and_random(tiny_llama):
    files = set(tiny_llama["files"])
    assert {"config.json", "model.safetensors.index.json"} <= files
    index = json.loads((tiny_llama["path"] / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    tensors = {}
    for shard in shards:
        tensors.update(load_file(tiny_llama["path"] / shard))
    assert "lm_head.weight" in tensors  # Untied.
    assert not np.array_equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])
    norm = tensors["model.layers.0.input_layernorm.weight"]
    assert not np.allclose(norm, 1.0)  # Randomized around 1, not the default init.
    assert tensors["model.layers.1.mlp.down_proj.weight"].shape == (64, 160)


def test_tiny_qwen2_has_random_qkv_bias(tiny):
    made = tiny[1]
    tensors = load_file(made["path"] / "model.safetensors")
    for name in ("q_proj", "k_proj", "v_proj"):
        bias = tensors[f"model.layers.0.self_attn.{name}.bias"]
        assert np.abs(bias).min() > 0
    assert "model.layers.0.self_attn.o_proj.bias" not in tensors
    assert made["config"]["model_type"] == "qwen2"
    rows = tiny[7]["rows"]
    assert [len(r["tokens"]) for r in rows] == [N_NEW, N_NEW]
    assert rows[0]["logits"].shape == (len(TINY_PROMPTS[0]), 256)


def test_generate_greedy_tokens_match_forward_argmax(tiny_generate):
    for row in tiny_generate["rows"]:
        prompt = TINY_PROMPTS[row["prompt"]]
        assert len(row["tokens"]) == N_NEW
        logits = row["logits"]
        assert logits.shape == (len(prompt) + N_NEW, 256) and logits.dtype == np.float32
        # generate() with a KV cache picks what one uncached forward over the sequence picks.
        predicted = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
        assert predicted == row["tokens"]
        assert len(row["step_margins"]) == N_NEW


def test_generate_adapter_rows_differ_and_base_rows_are_base(tiny):
    rows, plain = tiny[2]["rows"], tiny[3]["rows"][0]
    # A base row of a PEFT model with adapters loaded is exactly the plain model.
    np.testing.assert_array_equal(rows[1]["logits"], plain["logits"])
    assert rows[1]["tokens"] == plain["tokens"]
    for adapted in (rows[0], rows[3]):
        assert np.abs(adapted["logits"] - plain["logits"]).max() > 0.1
    assert set(tiny[2]["adapters"]) == {"attn", "all"}
    assert (tiny[2]["adapters"]["attn"] / "adapter_model.safetensors").is_file()


def test_make_adapters_saves_peft_folders(tiny):
    made = tiny[4]
    pat = made["adapters"]["pat"]
    config = json.loads((pat / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["rank_pattern"] == {"down_proj": 2}
    assert config["alpha_pattern"] == {"q_proj": 4} and config["layers_to_transform"] == [1]
    tensors = load_file(pat / "adapter_model.safetensors")
    prefix = "base_model.model.model.layers.1"
    assert tensors[f"{prefix}.self_attn.q_proj.lora_A.weight"].shape == (8, 64)
    assert tensors[f"{prefix}.self_attn.q_proj.lora_B.weight"].shape == (64, 8)
    assert tensors[f"{prefix}.mlp.down_proj.lora_A.weight"].shape == (2, 160)
    assert not any(".layers.0." in key for key in tensors)
    assert all(np.count_nonzero(t) == t.size for t in tensors.values())  # Random, never zero.
    regex = load_file(made["adapters"]["re"] / "adapter_model.safetensors")
    assert {t.dtype for t in regex.values()} == {np.dtype(np.float16)}
    assert {k.split(".")[-3] for k in regex} == {"v_proj", "up_proj"}


def test_merge_equals_unmerged_adapter(tiny):
    merged, run = tiny[5], tiny[6]["rows"][0]
    assert "config.json" in merged["files"]
    unmerged = tiny[2]["rows"][0]
    assert run["tokens"] == unmerged["tokens"]
    np.testing.assert_allclose(run["logits"], unmerged["logits"], rtol=1e-4, atol=1e-4)


def test_smollm2_gguf_tokenize_and_generate(reference, smollm2_gguf_path):
    """One process, one GGUF load: a batch job of tokenize + generate with an adapter row."""
    gguf = {"gguf": smollm2_gguf_path}
    texts = ["Hello 2024 héllo 😀 <|im_end|>"]
    tok, gen = reference(
        {
            "kind": "batch",
            "jobs": [
                {
                    "kind": "tokenize",
                    "model": gguf,
                    "texts": texts,
                    "decode": [[19556, 216, 33]],
                    "chat": [[{"role": "user", "content": "What is 2+2?"}]],
                },
                {
                    "kind": "generate",
                    "model": gguf,
                    "prompts": [[1, 4093, 198, 19556], [33, 34, 35]],
                    "n_new": 3,
                    "save_step_logits": True,
                    "adapters": {"mlp": {"r": 4, "target_modules": ["gate_proj", "up_proj"]}},
                    "rows": [{"prompt": 0, "adapter": None}, {"prompt": 1, "adapter": "mlp"}],
                },
            ],
        }
    )["results"]
    encoded = tok["encode"][0]
    assert encoded["ids"] == encoded["ids_no_special"]  # SmolLM2 adds no BOS.
    assert encoded["ids"][-1] == tok["info"]["special_tokens"]["<|im_end|>"] == 2
    assert encoded["decoded"] == texts[0]
    assert tok["decode"][0]["text"] == "Hello 1"
    chat = tok["chat"][0]
    assert chat["text"].startswith("<|im_start|>system\n")
    assert chat["text"].endswith("<|im_start|>assistant\n")
    assert chat["ids"][-4:] == [1, 520, 9531, 198]
    rows = gen["rows"]
    assert [len(r["tokens"]) for r in rows] == [3, 3]
    assert rows[0]["logits"].shape == (4, 49152) and rows[1]["logits"].shape == (3, 49152)
    assert rows[0]["tokens"][0] == int(rows[0]["logits"][-1].argmax())
    for row in rows:
        assert row["step_logits"].shape == (3, 49152)
        assert row["step_logits"].argmax(-1).tolist() == row["tokens"]
    assert rows[1]["adapter"] == "mlp" and gen["adapters"]["mlp"].is_dir()


def test_cache_hit_is_instant_and_key_follows_inputs(reference, tiny, tmp_path):
    start = time.perf_counter()
    again = reference(TINY_BATCH)["results"]
    assert time.perf_counter() - start < 2.0
    assert again[2]["rows"][0]["tokens"] == tiny[2]["rows"][0]["tokens"]
    first, second = tmp_path / "a", tmp_path / "b"
    for folder in (first, second):
        folder.mkdir()
        (folder / "config.json").write_text("{}")
    job = {"kind": "generate", "model": {"hf_dir": str(first)}, "prompts": [[5]], "n_new": 2}
    key = client.job_key(job)
    assert key != client.job_key({**job, "n_new": 3})
    # Keyed by contents, not by name: a fresh tmp_path each run still hits the cache.
    assert key == client.job_key({**job, "model": {"hf_dir": second}})
    (first / "config.json").write_text("{ }")
    assert key != client.job_key(job)


def test_bad_job_raises_with_reason(reference, tiny_llama):
    with pytest.raises(client.ReferenceError, match="layers_to_transform"):
        reference(
            {
                "kind": "make_adapters",
                "model": {"hf_dir": tiny_llama["path"]},
                "adapters": [{"name": "x", "target_modules": ".*q_proj", "layers_to_transform": [0]}],
            }
        )


@pytest.mark.parametrize("ci, outcome", [("1", "1 error"), ("", "1 skipped")])
def test_missing_reference_env_fails_in_ci_and_skips_elsewhere(ci, outcome, tmp_path):
    env = {**os.environ, "JAXLORA_REF_PYTHON": str(tmp_path / "missing"), "CI": ci}
    if not ci:
        env.pop("CI")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfs",
         f"{__file__}::test_fixture_needs_reference_env"],
        capture_output=True, text=True, env=env, cwd=Path(__file__).parents[2], timeout=120,
    )  # fmt: skip
    assert outcome in proc.stdout, proc.stdout + proc.stderr
    assert "setup_ref_env.sh" in proc.stdout


def test_fixture_needs_reference_env(reference):
    assert callable(reference)


def test_bad_job_is_cached_too(reference, tiny_llama):
    job = {
        "kind": "make_adapters",
        "model": {"hf_dir": tiny_llama["path"]},
        "adapters": [{"name": "x", "target_modules": ["no_such_proj"]}],
    }
    with pytest.raises(client.ReferenceError, match="no_such_proj"):
        reference(job)
    start = time.perf_counter()
    with pytest.raises(client.ReferenceError, match="no_such_proj"):
        reference(job)
    assert time.perf_counter() - start < 1.0
