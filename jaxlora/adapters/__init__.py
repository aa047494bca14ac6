"""Host-side adapter management: registry (host memory), slot table (bookkeeping), pager (device slots)."""

from jaxlora.adapters.metrics import PagerMetrics
from jaxlora.adapters.pager import AdapterInfo, Pager
from jaxlora.adapters.registry import HostMemory, Registry, RegisteredAdapter
from jaxlora.adapters.slot_table import SlotTable

__all__ = ["AdapterInfo", "HostMemory", "Pager", "PagerMetrics", "RegisteredAdapter", "Registry", "SlotTable"]
