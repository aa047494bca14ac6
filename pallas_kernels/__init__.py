"""Pallas kernels for multi-adapter serving, one folder per op (as jax's `pallas/ops`):

- `lora/`: shrink h = x @ A[slot] and expand y += h @ B[slot]. `lora.api` writes the contract once
  and picks a backend from a table: the Triton kernels (`shrink`, `expand`, `group`, `fused`, their
  shared row grouping in `common`), the TPU scalar-prefetch variants (`tpu`), the XLA backends
  (`xla`), and the naive `reference` tests check everything against; tuned block sizes in `tuning`.
  `paged`: shrink and expand reading adapters at true rank through page tables (`paged_reference`);
  not yet wired into the engine.
- `attention/`: the ragged paged-attention kernel of the flat-token-batch step (`ragged`), its
  plain-XLA twin (`ragged_xla`) and the reference (`reference`).
- `quant/`: the 8-bit weight GEMMs, Triton (`triton`) and Mosaic GPU (`mgpu`), and their `tuning`.

Imports only jax and numpy; usable on its own. `lora_shrink`, `lora_expand`, `lora_expand_multi` and
`lora_group` (with `lora_plan`, built once per step) are the interface the model calls.
"""

from pallas_kernels.attention.ragged import ragged_paged_attention
from pallas_kernels.attention.ragged_xla import ragged_paged_attention_xla
from pallas_kernels.attention.reference import ragged_paged_attention_reference
from pallas_kernels.lora import reference, tuning, xla
from pallas_kernels.lora.api import BACKENDS, Backend, lora_expand, lora_expand_multi, lora_group, lora_shrink
from pallas_kernels.lora.expand import bgmv_expand, sgmv_expand
from pallas_kernels.lora.plan import LoraPlan, lora_plan
from pallas_kernels.lora.shrink import bgmv_shrink, sgmv_shrink
from pallas_kernels.lora.tpu import bgmv_expand as tpu_bgmv_expand
from pallas_kernels.lora.tpu import bgmv_shrink as tpu_bgmv_shrink
from pallas_kernels.lora.tpu import sgmv_expand as tpu_sgmv_expand
from pallas_kernels.lora.tpu import sgmv_shrink as tpu_sgmv_shrink

__all__ = [
    "BACKENDS",
    "Backend",
    "LoraPlan",
    "bgmv_expand",
    "bgmv_shrink",
    "lora_expand",
    "lora_expand_multi",
    "lora_group",
    "lora_plan",
    "lora_shrink",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "ragged_paged_attention_xla",
    "reference",
    "sgmv_expand",
    "sgmv_shrink",
    "tpu_bgmv_expand",
    "tpu_bgmv_shrink",
    "tpu_sgmv_expand",
    "tpu_sgmv_shrink",
    "tuning",
    "xla",
]
