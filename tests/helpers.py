"""Small shared builders for tests (tiny configs, random models)."""

from __future__ import annotations

from jaxlora.config import ModelConfig


def tiny_config(**overrides) -> ModelConfig:
    base = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        eos_token_ids=(2,),
        bos_token_id=1,
    )
    base.update(overrides)
    return ModelConfig(**base)


def greedy(model, prompt: list[int], n_new: int, *, bank=None, slot: int = 0, backend="xla"):
    """(prompt logits [len, vocab], n_new greedy ids) for one row, with the jitted whole-model forward."""
    import jax.numpy as jnp
    import numpy as np

    from jaxlora.lora.apply import LoraRuntime
    from jaxlora.model import init_kv_cache
    from jaxlora.model.forward import forward_logits

    runtime = LoraRuntime.for_platform(backend)
    slots = None if bank is None else jnp.asarray([slot], jnp.int32)
    kv = init_kv_cache(model.config, 1, len(prompt) + n_new)
    logits, kv = forward_logits(
        model.graphdef,
        model.params,
        jnp.asarray([prompt]),
        jnp.arange(len(prompt))[None],
        kv,
        bank,
        slots,
        runtime=runtime,
    )
    prompt_logits = np.asarray(logits[0])
    out = [int(prompt_logits[-1].argmax())]
    for i in range(n_new - 1):
        logits, kv = forward_logits(
            model.graphdef,
            model.params,
            jnp.asarray([[out[-1]]]),
            jnp.asarray([[len(prompt) + i]]),
            kv,
            bank,
            slots,
            runtime=runtime,
        )
        out.append(int(np.asarray(logits)[0, -1].argmax()))
    return prompt_logits, out


def batched_greedy(
    model, prompts: list[list[int]], slots: list[int], n_new: int, *, bank=None, backend="xla", runtime=None
) -> list[list[int]]:
    """Greedy ids for rows of different lengths decoded together in one batch.

    Each row is prefilled on its own into its cache row (segmented LoRA path), then every decode
    step runs all rows at once, each at its own position, with its own slot (per-row LoRA path).
    """
    import jax.numpy as jnp
    import numpy as np

    from jaxlora.lora.apply import LoraRuntime
    from jaxlora.model import init_kv_cache
    from jaxlora.model.forward import forward_logits

    runtime = runtime or LoraRuntime.for_platform(backend)
    rows = len(prompts)
    kv = init_kv_cache(model.config, rows, max(map(len, prompts)) + n_new)
    slot_ids = jnp.asarray(slots, jnp.int32)
    nxt = []
    # Prompts are padded to one length so that a single prefill shape is compiled; the padding's
    # cache entries sit past the prompt and are overwritten by decode before they are ever read.
    bucket = max(map(len, prompts))
    for r, prompt in enumerate(prompts):
        padded = jnp.asarray([list(prompt) + [0] * (bucket - len(prompt))])
        logits, kv = forward_logits(
            model.graphdef,
            model.params,
            padded,
            jnp.arange(bucket)[None],
            kv,
            bank,
            None if bank is None else slot_ids[r : r + 1],
            jnp.asarray([r], jnp.int32),
            runtime=runtime,
        )
        nxt.append(int(np.asarray(logits)[0, len(prompt) - 1].argmax()))
    out = [[t] for t in nxt]
    for step in range(n_new - 1):
        pos = jnp.asarray([[len(p) + step] for p in prompts], jnp.int32)
        logits, kv = forward_logits(
            model.graphdef,
            model.params,
            jnp.asarray([[o[-1]] for o in out]),
            pos,
            kv,
            bank,
            None if bank is None else slot_ids,
            runtime=runtime,
        )
        for r, t in enumerate(np.asarray(logits)[:, -1].argmax(-1)):
            out[r].append(int(t))
    return out


def tiny_tokenizer(vocab_size: int = 96):
    """A word-level tokenizer over `w0 .. w{n-1}` (ids = numbers) with a trivial chat template."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    from jaxlora.tokenizer import Tokenizer

    vocab = {f"w{i}": i for i in range(vocab_size)}
    hf = HFTokenizer(models.WordLevel(vocab, unk_token="w0"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    return Tokenizer(
        hf=hf, chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}", eos_token_ids=(2,), bos_token_id=1
    )
