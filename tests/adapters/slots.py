"""What a bank slot must hold for an adapter, and tree equality: shared by the pager's layout tests."""

from __future__ import annotations

import jax
import numpy as np

from jaxlora.lora.bank import slot_arrays


def expected_entries(adapter, model, lora, dtype):
    """The adapter padded straight to the bank's rank (`slot_arrays`), in the bank's dtype."""
    return jax.tree_util.tree_map(lambda x: np.asarray(x, np.dtype(dtype)), slot_arrays(adapter.weights, model, lora))


def assert_trees_equal(got, want) -> None:
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    jax.tree_util.tree_map(np.testing.assert_array_equal, got, want)
