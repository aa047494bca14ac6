"""The default bound on host memory for registered adapters: a share of this machine's memory.

Without a bound every LoadAdapter is accepted until the process runs out of memory (60 loads of a
SmolLM2 adapter took 1.3 GB). The command line applies this default when neither the engine config
(`host_capacity_bytes`) nor `--max-cpu-loras` sets one; loads beyond it are refused with
CapacityError (gRPC RESOURCE_EXHAUSTED). A quarter leaves the rest to the model, the KV cache (on
CPU), the runtime and the other processes of the machine.
"""

from __future__ import annotations

import os
from pathlib import Path

HOST_SHARE = 0.25  # of the machine's memory
_CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


def machine_memory_bytes() -> int:
    """Physical memory, or the container's cgroup limit where that is smaller."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in _CGROUP_LIMITS:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # "max" (cgroup v2) means no limit
            physical = min(physical, int(text))
    return physical


def default_host_capacity_bytes(memory_bytes: int | None = None) -> int:
    """HOST_SHARE of `memory_bytes` (default: this machine's, see `machine_memory_bytes`)."""
    memory = machine_memory_bytes() if memory_bytes is None else memory_bytes
    return max(1, int(memory * HOST_SHARE))
