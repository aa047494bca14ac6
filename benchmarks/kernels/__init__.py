"""Kernel benchmarks: one op (LoRA shrink/expand, LoRA module groups, 8-bit GEMMs, ragged attention)
timed over several layers in one jitted call, checked against a reference, against its bytes floor."""
