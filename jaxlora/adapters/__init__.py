"""Adapters while serving: which exist, which device slot each sits in, and when they move.

    source.py       AdapterSource, the contract the engine and the scheduler rely on
    pager.py        Pager: thousands of adapters in host memory, a few device slots, page-ins
                    overlapped with the engine's steps
    paged_pager.py  PagedPager: the same protocol over a paged bank (adapters at true rank in pages)
    unified_pager.py  UnifiedPager: adapters at true rank in the KV cache's own pages, one allocator
    page_allocator.py  which pages of the paged bank's pool are free (plain Python)
    register_many.py  many registrations at once (start-up), from a few threads
    resident.py     ResidentBank: a fixed set of adapters resident in the bank for good (benchmarks, tests)
    registry.py     name -> validated adapter in host memory, packed as one slot wants it at its
                    rank class (widened to the bank's rank on the device at page-in)
    slot_table.py   slot <-> name, LRU order and pins (plain Python)
    metrics.py      hit, miss, page-in and eviction counters

What an adapter *is* (its math in the model, the device bank's layout and slot writes, PEFT folders,
validation, merging) lives in `jaxlora.lora`, which knows nothing of slots over time; this package
builds on it.
"""

from jaxlora.adapters.metrics import PagerMetrics
from jaxlora.adapters.paged_pager import PagedPager
from jaxlora.adapters.pager import AdapterInfo, Pager
from jaxlora.adapters.registry import HostMemory, RegisteredAdapter, Registry
from jaxlora.adapters.resident import ResidentBank
from jaxlora.adapters.slot_table import SlotTable
from jaxlora.adapters.source import AdapterSource
from jaxlora.adapters.unified_pager import UnifiedPager

__all__ = [
    "AdapterInfo",
    "AdapterSource",
    "HostMemory",
    "PagedPager",
    "Pager",
    "PagerMetrics",
    "RegisteredAdapter",
    "Registry",
    "ResidentBank",
    "SlotTable",
    "UnifiedPager",
]
