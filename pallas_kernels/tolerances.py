"""How close a kernel must come to its reference (`reference`, `ragged_attention_reference`), keyed
by dtype name: the reference accumulates in float32, the kernel in the input dtype's arithmetic.
The test suite's table (tests/tolerances.py) starts from these rows; GPU checks outside the tests
(benchmarks/kernels/) judge kernels by them too.
"""

from __future__ import annotations

KERNEL_TOLERANCES: dict[str, dict[str, float]] = {
    "float32": {"atol": 1e-4, "rtol": 1e-4},
    "bfloat16": {"atol": 3e-2, "rtol": 2e-2},
}
