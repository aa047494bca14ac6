"""The device mesh of one engine: axes ("data", "tensor").

`tensor` splits every layer over devices (Megatron-style); `data` is reserved for replicas and must
be 1 for now.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

DATA_AXIS = "data"
TENSOR_AXIS = "tensor"


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """How many devices one engine spans.

    Attributes:
      tensor: devices each layer is split over (1: one device, nothing changes).
      data: model replicas (reserved; must be 1).
    """

    tensor: int = 1
    data: int = 1

    def __post_init__(self) -> None:
        if self.tensor < 1:
            raise ValueError(f"mesh.tensor={self.tensor} must be >= 1")
        if self.data != 1:
            raise ValueError(f"mesh.data={self.data}: data parallelism is reserved for later; it must be 1")

    @property
    def num_devices(self) -> int:
        return self.tensor * self.data

    @property
    def is_sharded(self) -> bool:
        return self.num_devices > 1


def make_mesh(config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
    """A Mesh of shape (data, tensor) over the first `config.num_devices` of `devices`.

    Raises ValueError if there are fewer devices than the config asks for.
    """
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < config.num_devices:
        raise ValueError(
            f"mesh needs {config.num_devices} devices (data={config.data} x tensor={config.tensor}), "
            f"found {len(devices)}: {[str(d) for d in devices]}"
        )
    grid = np.array(devices[: config.num_devices], dtype=object).reshape(config.data, config.tensor)
    return jax.sharding.Mesh(grid, (DATA_AXIS, TENSOR_AXIS))


def check_mesh(config: MeshConfig, mesh: jax.sharding.Mesh | None) -> None:
    """Raises ValueError unless `mesh` is the one `config` describes: None for one device, else a
    (data, tensor) mesh of the configured sizes (from `make_mesh`)."""
    if mesh is None:
        if config.is_sharded:
            raise ValueError(f"mesh config {config} needs a mesh (jaxlora.parallel.make_mesh), got None")
        return
    want = {DATA_AXIS: config.data, TENSOR_AXIS: config.tensor}
    if dict(mesh.shape) != want:
        raise ValueError(f"mesh of shape {dict(mesh.shape)} does not match the mesh config {want}")
