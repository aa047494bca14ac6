"""LoRA kernels for multi-adapter serving: shrink h = x @ A[slot], expand y += h @ B[slot]; and the
decode-attention kernel the model's decode step uses on GPU (`decode_attention`); and the ragged
paged-attention kernel of the flat-token-batch step (`ragged_paged_attention`, its plain-JAX twin in
`ragged_attention_reference`).

Imports only jax and numpy; usable on its own. `lora_shrink`, `lora_expand` and
`lora_expand_multi` (with `lora_plan`, built once per step) are the interface the model calls (see `api` for the contract); the segmented
(SGMV) and per-row (BGMV) Triton kernels are public too (their TPU scalar-prefetch variants as `tpu_*`), `xla_backends` holds the XLA backends (`xla`,
`ragged`), and `reference` the naive versions tests check everything against.
"""

from pallas_kernels import reference, tuning, xla_backends
from pallas_kernels.api import BACKENDS, Backend, lora_expand, lora_expand_multi, lora_group, lora_shrink
from pallas_kernels.decode_attention import decode_attention
from pallas_kernels.lora_tpu import bgmv_expand as tpu_bgmv_expand
from pallas_kernels.lora_tpu import bgmv_shrink as tpu_bgmv_shrink
from pallas_kernels.lora_tpu import sgmv_expand as tpu_sgmv_expand
from pallas_kernels.lora_tpu import sgmv_shrink as tpu_sgmv_shrink
from pallas_kernels.lora_triton import bgmv_expand, bgmv_shrink, sgmv_expand, sgmv_shrink
from pallas_kernels.plan import LoraPlan, lora_plan
from pallas_kernels.ragged_attention import ragged_paged_attention
from pallas_kernels.ragged_attention_reference import ragged_paged_attention_reference
from pallas_kernels.ragged_attention_xla import ragged_paged_attention_xla

__all__ = [
    "BACKENDS",
    "Backend",
    "LoraPlan",
    "bgmv_expand",
    "decode_attention",
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
    "xla_backends",
]
