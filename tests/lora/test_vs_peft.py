"""Mixed-adapter batches on SmolLM2 against Hugging Face PEFT, token for token.

PEFT itself makes the adapters (random, non-zero A and B), covering mixed ranks, attention-only,
MLP-only and all-linear targets, rsLoRA, rank/alpha patterns and layers_to_transform. One batch holds
every adapter plus base rows in shuffled order; each row must equal PEFT running it alone.
"""

import dataclasses

import pytest

from jaxlora.config import LoraBackend, LoraBank, LoraConfig
from jaxlora.kernels import StepKernels
from jaxlora.loading import load_model
from jaxlora.lora.bank import init_bank, set_slot, slot_arrays
from jaxlora.lora.paged_bank import build_paged_bank, model_view
from jaxlora.lora.peft_format import load_peft_adapter
from tests.greedy import batched_greedy

pytestmark = pytest.mark.reference

ADAPTERS = {
    "attn4": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"], "seed": 1},
    "mlp8-rslora": {
        "r": 8,
        "lora_alpha": 16,
        "use_rslora": True,
        "target_modules": ["gate_proj", "up_proj", "down_proj"],
        "seed": 2,
    },
    "all16-patterns": {
        "r": 16,
        "lora_alpha": 32,
        "target_modules": "all-linear",
        "rank_pattern": {"q_proj": 8},
        "alpha_pattern": {"down_proj": 4},
        "seed": 3,
    },
    "qv64-layers": {
        "r": 64,
        "lora_alpha": 64,
        "target_modules": ["q_proj", "v_proj"],
        "layers_to_transform": list(range(0, 30, 2)),
        "seed": 4,
    },
}
PROMPTS = ["Name a fruit.", "What is 7 times 8?", "Tell me about the moon in one sentence."]
# (prompt, adapter or None) per batch row, shuffled; base rows in between.
ROWS = [
    (1, "all16-patterns"),
    (0, None),
    (2, "attn4"),
    (0, "qv64-layers"),
    (1, "mlp8-rslora"),
    (2, None),
    (0, "attn4"),
    (2, "all16-patterns"),
    (1, "qv64-layers"),
    (0, "mlp8-rslora"),
]
N_NEW = 24


@pytest.fixture(scope="module")
def setup(smollm2_gguf_path, reference):
    model, tok = load_model(smollm2_gguf_path)
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    ref = reference(
        {
            "kind": "generate",
            "model": {"gguf": str(smollm2_gguf_path)},
            "prompts": prompts,
            "n_new": N_NEW,
            "adapters": ADAPTERS,
            "logits": "none",
            "rows": [{"prompt": p, "adapter": a} for p, a in ROWS],
        }
    )
    lora = LoraConfig(max_slots=len(ADAPTERS) + 1, max_rank=64)
    bank = init_bank(model.config, lora)
    slot_of = {None: 0}
    weights = []
    for slot, name in enumerate(ADAPTERS, start=1):
        adapter = load_peft_adapter(ref["adapters"][name], name=name, model_config=model.config, max_rank=64)
        bank = set_slot(bank, slot, slot_arrays(adapter.weights, model.config, lora))
        slot_of[name] = slot
        weights.append(adapter.weights)
    paged = dataclasses.replace(lora, bank=LoraBank.PAGED)
    # Free pages NaN: a read of a page no adapter owns would show in the tokens.
    paged_bank = model_view(build_paged_bank(model.config, paged, weights, fill=float("nan")), paged)
    rows = [slot_of[a] for _, a in ROWS]
    return model, prompts, bank, rows, paged_bank, [row["tokens"] for row in ref["rows"]], ref["adapters"]


def test_peft_adapters_change_the_output(setup):
    *_, expected, _ = setup
    base = {p: expected[i] for i, (p, a) in enumerate(ROWS) if a is None}
    changed = [expected[i] != base[p] for i, (p, a) in enumerate(ROWS) if a is not None and p in base]
    assert all(changed), "an adapter did not change PEFT's output; the comparison would prove little"


@pytest.mark.parametrize("backend", list(LoraBackend))
def test_mixed_batch_matches_peft_token_for_token(setup, backend):
    model, prompts, bank, slots, _, expected, _ = setup
    got = batched_greedy(model, [prompts[p] for p, _ in ROWS], slots, N_NEW, bank=bank, backend=backend)
    for i, (p, a) in enumerate(ROWS):
        assert got[i] == expected[i], f"row {i} (prompt {p}, adapter {a}, backend {backend})"


def test_paged_bank_mixed_batch_matches_peft_token_for_token(setup):
    """The same batch read from a paged bank: every adapter at its true rank (4, 8, 16 with a rank
    pattern, 64 on some layers), through the paged kernels (interpreted on CPU)."""
    model, prompts, _, slots, paged_bank, expected, _ = setup
    kernels = StepKernels.for_platform(LoraBackend.XLA, lora_bank=LoraBank.PAGED)
    got = batched_greedy(model, [prompts[p] for p, _ in ROWS], slots, N_NEW, bank=paged_bank, kernels=kernels)
    for i, (p, a) in enumerate(ROWS):
        assert got[i] == expected[i], f"row {i} (prompt {p}, adapter {a}, paged bank)"


def test_unified_bank_engine_matches_peft_token_for_token(setup, smollm2_gguf_path):
    """The same batch through the engine on a unified bank: the PEFT folders registered as they come,
    every adapter at its true rank in the KV pool's pages (a GQA model: 3 KV heads of 64), the XLA
    gather path; the pool starts NaN outside what is written."""
    import jax
    import jax.numpy as jnp

    from jaxlora.engine import EngineConfig, GenerationRequest, SamplingParams
    from jaxlora.engine.build import build_engine

    model, prompts, _, _, _, expected, folders = setup
    _, tok = load_model(smollm2_gguf_path)
    lora = LoraConfig(max_slots=len(ADAPTERS) + 1, max_rank=64, bank=LoraBank.UNIFIED)
    # One step shape (16 tokens, always with the bank): one compile of the 30-layer step.
    config = EngineConfig(
        max_batch=len(ROWS), max_seq_len=128, token_budgets=(16,), page_size=16, lora=lora, bank_free_steps=False
    )
    engine = build_engine(config, model, tok, dict(folders), compile_ahead=False)
    engine.runner.kv = jax.tree.map(lambda x: x + jnp.nan, engine.runner.kv)
    requests = [
        GenerationRequest(
            request_id=f"row{i}",
            prompt_ids=prompts[p],
            adapter=a,
            sampling=SamplingParams(max_tokens=N_NEW, ignore_eos=True),
        )
        for i, (p, a) in enumerate(ROWS)
    ]
    got = [list(out.token_ids) for out in engine.generate(requests)]
    for i, (p, a) in enumerate(ROWS):
        assert got[i] == expected[i], f"row {i} (prompt {p}, adapter {a}, unified bank)"
    engine.pager.check()
