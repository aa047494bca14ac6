"""Tensor parallelism over a device mesh (Megatron-style base weights, S-LoRA-style adapter bank).

    mesh.py      MeshConfig (the engine config's `mesh:` section) and make_mesh
    layers.py    the collectives the model calls on one shard (psum after o/down, vocab-parallel
                 embedding and logits); imports only jax, so the model can use it
    sharding.py  PartitionSpecs of params / bank / KV cache, divisibility checks, placement, and
                 `shard_step`, which runs a whole model step per shard under `shard_map` (the
                 engine's step, and jaxlora.model.forward.forward_logits given a mesh)

This package knows arrays by name and shape, never the model's classes: the model imports it (its
collectives, `shard_step`), and what allocates a model or cache in its shards lives with the model
(jaxlora.model.sharded).
"""

from jaxlora.parallel.mesh import TENSOR_AXIS, MeshConfig, check_mesh, make_mesh

__all__ = ["TENSOR_AXIS", "MeshConfig", "check_mesh", "make_mesh"]
