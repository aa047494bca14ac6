"""LoRA shrink / expand: the contract and backend table (`api`), the Triton kernels (`shrink`,
`expand`, `group`, `fused`, sharing `common`), TPU variants (`tpu`), XLA backends (`xla`), the naive
`reference`, and tuned block sizes (`tuning`)."""
