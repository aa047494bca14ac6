"""The model's XLA ragged-attention path (query blocks of one sequence each, pages gathered once per
block) against the per-token reference, on the kernel tests' poisoned batches."""

from __future__ import annotations

import numpy as np
import pytest

from pallas_kernels import ragged_paged_attention_reference, ragged_paged_attention_xla
from tests.kernels.paged_data import ragged_batch
from tests.kernels.test_ragged_attention import CASES
from tests.tolerances import assert_close


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("block_q", [1, 16])
def test_xla_path_matches_reference(rng, name, block_q):
    case = {k: v for k, v in CASES[name].items() if k not in ("block_q", "block_k")}
    batch = ragged_batch(rng, **case)
    for layer in range(batch.k_pages.shape[0]):
        out = ragged_paged_attention_xla(*batch.args(layer), block_q=block_q)
        assert np.isfinite(np.asarray(out)).all(), "a NaN page, offset or padding row was read"
        assert_close(out, ragged_paged_attention_reference(*batch.args(layer)), "float32")
        assert not np.asarray(out)[~batch.is_token].any(), "padding rows must be zero"
