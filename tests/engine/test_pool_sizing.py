"""`jaxlora.engine.runner.pool_positions` on a GPU: the KV pool fits the largest free block."""

import logging

import jax
import pytest

from jaxlora.engine import runner
from jaxlora.engine.config import EngineConfig
from jaxlora.model.kv_cache import kv_bytes_per_position
from tests.factories import tiny_config

GIB = 2**30


class _Device:
    def __init__(self, stats: dict) -> None:
        self.stats = stats

    def memory_stats(self) -> dict:
        return self.stats


def _positions(monkeypatch, stats: dict) -> int:
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "local_devices", lambda: [_Device(stats)])
    return runner.pool_positions(tiny_config(), EngineConfig(max_batch=2, token_budgets=(8,), page_size=16))


def _pool_bytes(positions: int) -> int:
    return positions * kv_bytes_per_position(tiny_config(), EngineConfig().jnp_dtype)


def test_unfragmented_memory_gives_the_configured_share(monkeypatch, caplog):
    stats = {"bytes_limit": 10 * GIB, "bytes_in_use": 2 * GIB, "largest_free_block_bytes": 8 * GIB}
    with caplog.at_level(logging.WARNING, logger="jaxlora.engine.runner"):
        positions = _positions(monkeypatch, stats)
    share = EngineConfig().kv_memory_fraction
    assert 0.99 * share * 8 * GIB < _pool_bytes(positions) <= share * 8 * GIB
    assert "fragmented" not in caplog.text


def test_fragmented_memory_sizes_the_pool_to_its_largest_free_block(monkeypatch, caplog):
    # 8 GiB free in pieces, the largest 3 GiB: a pool of 0.85 x 8 GiB could not be allocated.
    stats = {"bytes_limit": 10 * GIB, "bytes_in_use": 2 * GIB, "largest_free_block_bytes": 3 * GIB}
    with caplog.at_level(logging.WARNING, logger="jaxlora.engine.runner"):
        positions = _positions(monkeypatch, stats)
    assert 0.99 * runner.BLOCK_SHARE * 3 * GIB < _pool_bytes(positions) <= runner.BLOCK_SHARE * 3 * GIB
    assert "device memory is fragmented" in caplog.text


@pytest.mark.parametrize("stats", [{"bytes_limit": 10 * GIB, "bytes_in_use": 2 * GIB}])
def test_a_backend_without_the_block_statistic_uses_the_free_bytes(monkeypatch, stats):
    share = EngineConfig().kv_memory_fraction
    assert _pool_bytes(_positions(monkeypatch, stats)) <= share * 8 * GIB
