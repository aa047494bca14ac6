"""End-to-end benchmark: the same as `jaxlora bench`, runnable from a checkout.

    python benchmarks/e2e.py --tiny --out /tmp/bench     # CPU smoke run
    python benchmarks/e2e.py --out benchmarks/results --hf-peer hf_peer.json --budget-s 240   # H200

See jaxlora/bench/e2e.py for what is measured and benchmarks/hf_peer.py for the Hugging Face peer.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jaxlora.bench.e2e import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
