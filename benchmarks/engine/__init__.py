"""Engine benchmarks: the real `Engine` in-process, closed loop (`jaxlora bench`), its host loop, adapter
paging, a GPU correctness check before timing, and the Hugging Face peer (its own process, no JAX)."""
