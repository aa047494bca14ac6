"""The one tolerance table for comparisons with an independent implementation, keyed by dtype.

Kernels, layers and steps compare against a reference accumulated in float32 with the per-dtype rows
(the kernel library's own, `pallas_kernels.tolerances`, which GPU checks outside the tests use too).
Whole-model logits accumulate rounding over every layer, so they get their own row.
"""

from __future__ import annotations

import numpy as np

from pallas_kernels.tolerances import KERNEL_TOLERANCES

TOLERANCES: dict[str, dict[str, float]] = {
    **KERNEL_TOLERANCES,
    # 30-layer SmolLM2 logits (magnitudes ~10-40) vs transformers, both in float32.
    "model_float32": {"atol": 2e-3, "rtol": 1e-4},
}


def tolerance(kind) -> dict[str, float]:
    """The row for `kind`: a row name, or a dtype (its name picks the row)."""
    return TOLERANCES[kind if isinstance(kind, str) else np.dtype(kind).name]


def assert_close(actual, expected, kind, err_msg: str = "") -> None:
    """`actual` matches `expected` within `kind`'s row (compared in float32); a non-finite value in
    `actual` fails even where `expected` has one too (a stray read of NaN padding shows)."""
    actual = np.asarray(actual).astype(np.float32)
    expected = np.asarray(expected).astype(np.float32)
    assert np.isfinite(actual).all(), f"non-finite values in the result {err_msg}"
    np.testing.assert_allclose(actual, expected, err_msg=err_msg, **tolerance(kind))
