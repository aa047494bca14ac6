"""Ragged paged attention: the Triton kernel (`ragged`), its plain-XLA twin (`ragged_xla`) and the
reference both are tested against (`reference`)."""
