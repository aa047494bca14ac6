"""Batch generation on Ray Data (the optional extra `jaxlora[ray]`; the only part of jaxlora that
imports ray): `BatchGenerator` for `Dataset.map_batches`, `run_ray_job` behind `jaxlora generate --ray`."""

from __future__ import annotations

from jaxlora.engine.load import EngineSpec
from jaxlora.ray.generator import BatchGenerator
from jaxlora.ray.job import RayJob, run_ray_job

__all__ = ["BatchGenerator", "EngineSpec", "RayJob", "run_ray_job"]
