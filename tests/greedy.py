"""Greedy decoding with the jitted whole-model forward (`jaxlora.model.forward.forward_logits`), one
row or a batch: the reference the engine and the adapters are checked against."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxlora.kernels import StepKernels
from jaxlora.model import init_kv_cache
from jaxlora.model.forward import forward_logits


def greedy(model, prompt: list[int], n_new: int, *, bank=None, slot: int = 0, backend="xla"):
    """(prompt logits [len, vocab], n_new greedy ids) for one row, with the jitted whole-model forward."""
    kernels = StepKernels.for_platform(backend)
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
        kernels=kernels,
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
            kernels=kernels,
        )
        out.append(int(np.asarray(logits)[0, -1].argmax()))
    return prompt_logits, out


def batched_greedy(
    model, prompts: list[list[int]], slots: list[int], n_new: int, *, bank=None, backend="xla", kernels=None
) -> list[list[int]]:
    """Greedy ids for rows of different lengths decoded together in one batch.

    Each row is prefilled on its own into its cache row (segmented LoRA path), then every decode
    step runs all rows at once, each at its own position, with its own slot (per-row LoRA path).
    """
    kernels = kernels or StepKernels.for_platform(backend)
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
            kernels=kernels,
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
            kernels=kernels,
        )
        for r, t in enumerate(np.asarray(logits)[:, -1].argmax(-1)):
            out[r].append(int(t))
    return out
