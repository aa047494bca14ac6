"""Serving benchmarks: an open-loop trace (S-LoRA's) replayed against the engine; req/s at an SLO,
TTFT and TPOT."""
