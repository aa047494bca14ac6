"""The serving layout of the projections: q|k|v as one matrix, gate|up as another.

    layers.self_attn.qkv_proj.kernel  [L, D, q + 2 kv] = q_proj | k_proj | v_proj  (output axis)
    layers.mlp.gate_up_proj.kernel    [L, D, 2 I]      = gate_proj | up_proj

and likewise their biases, or a quantized projection's `qkernel` and `qscale` (the scales are per
output column, so they go along with their columns). Each layer then runs one GEMM per shared input,
five in all instead of seven. Why: a decode step reads every weight once, and at a few hundred rows
a GEMM is bound by how fast it streams its weight. The H200 streams a wide matrix better than three
narrow ones, it needs no split-K reduction kernels, and the step has fewer launches. Eight layers of
the Llama-2-7B projections, `benchmarks/results/archive/floor_probe_s8/quant_gemm_flags.json`, in ms:

    batch   separate (XLA Triton GEMMs)   fused (XLA Triton)   fused (cuBLAS)     floor
    64      1.226                         1.035                0.965              0.79
    256     2.139                         1.923                1.366              0.79

The canonical layout (Hugging Face's, one matrix per module) stays the interface. Loaders produce
it and `LoadedModel.flat_params()` returns it, so savers, `merge` and the tools never see a fused
name; `fuse_arrays` / `split_arrays` convert between the two. Tensor parallelism keeps the separate
layout: a column split of q|k|v would cut across the three matrices (`jaxlora.parallel.sharding`).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxlora.config import ModelConfig
from jaxlora.errors import ModelLoadError
from jaxlora.lora.bank import GROUPS

# (parent, fused module, the modules it concatenates in column order). The order is the LoRA bank's
# group order, in which the fused output's columns receive their LoRA terms (jaxlora.lora.apply).
FUSED_GROUPS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("layers.self_attn", "qkv_proj", dict(GROUPS)["qkv"]),
    ("layers.mlp", "gate_up_proj", dict(GROUPS)["gate_up"]),
)
# The parameters a projection may hold; each is concatenated along its last (output) axis.
LEAVES = ("kernel", "bias", "qkernel", "qscale")


def module_columns(config: ModelConfig, modules: tuple[str, ...]) -> tuple[int, ...]:
    """Column offset of each module in its fused matrix, e.g. (0, q, q + kv) for q|k|v."""
    widths = [config.module_shape(m)[1] for m in modules]
    return tuple(int(sum(widths[:i])) for i in range(len(widths)))


def _concat(pieces: list) -> np.ndarray | jax.Array:
    if all(isinstance(p, np.ndarray) for p in pieces):
        return np.concatenate(pieces, axis=-1)
    return jnp.concatenate([jnp.asarray(p) for p in pieces], axis=-1)


def fuse_arrays(arrays: Mapping[str, np.ndarray | jax.Array]) -> dict[str, np.ndarray | jax.Array]:
    """Flat parameters in the canonical layout -> the serving layout (other names pass through).

    Raises ModelLoadError when only some of a fused group's matrices are there (a model missing
    k_proj is reported as such, not as a shape error of the fused matrix).
    """
    out = dict(arrays)
    for parent, fused, parts in FUSED_GROUPS:
        for leaf in LEAVES:
            names = [f"{parent}.{p}.{leaf}" for p in parts]
            present = [n in out for n in names]
            if not any(present):
                continue
            if not all(present):
                missing = [n for n, ok in zip(names, present) if not ok]
                raise ModelLoadError(f"missing tensor(s) {missing}: {fused} needs all of {list(parts)}")
            out[f"{parent}.{fused}.{leaf}"] = _concat([out.pop(n) for n in names])
    return out


def split_arrays(arrays: Mapping[str, np.ndarray | jax.Array], config: ModelConfig) -> dict:
    """The inverse of `fuse_arrays`: every fused matrix cut back into its modules' columns."""
    out = dict(arrays)
    for parent, fused, parts in FUSED_GROUPS:
        starts = module_columns(config, parts)
        ends = starts[1:] + (starts[-1] + config.module_shape(parts[-1])[1],)
        for leaf in LEAVES:
            whole = out.pop(f"{parent}.{fused}.{leaf}", None)
            if whole is None:
                continue
            for part, lo, hi in zip(parts, starts, ends):
                out[f"{parent}.{part}.{leaf}"] = whole[..., lo:hi]
    return out


def is_fused_name(name: str) -> bool:
    return any(f"{parent}.{fused}." in name for parent, fused, _ in FUSED_GROUPS)
