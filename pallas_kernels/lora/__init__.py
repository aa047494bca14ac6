"""LoRA shrink / expand: the contract and backend table (`api`), the Triton kernels (`shrink`,
`expand`, `group`, `fused`, sharing `common`), TPU variants (`tpu`), XLA backends (`xla`), the naive
`reference`, and tuned block sizes (`tuning`); true-rank kernels that read adapters through page
tables, from pools of their own (`paged`) or from the KV cache's pages (`unified`), each with its
reference."""
