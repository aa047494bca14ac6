"""One tolerance table for comparisons with an independent implementation, keyed by dtype.

Whole-model logits accumulate rounding over every layer, so they get their own rows; kernel and
layer tests use the per-op rows.
"""

import numpy as np

TOLERANCES: dict[str, dict[str, float]] = {
    "float32": {"atol": 1e-4, "rtol": 1e-4},
    "bfloat16": {"atol": 3e-2, "rtol": 2e-2},
    # 30-layer SmolLM2 logits (magnitudes ~10-40) vs transformers, both in float32.
    "model_float32": {"atol": 2e-3, "rtol": 1e-4},
}


def assert_close(actual, expected, kind: str, err_msg: str = "") -> None:
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), err_msg=err_msg, **TOLERANCES[kind])
