"""8-bit weight GEMMs: the Triton kernel (`triton`, any shape, either layout), the Mosaic GPU kernel
(`mgpu`, Hopper, K-major), and their tuned knobs (`tuning`)."""
