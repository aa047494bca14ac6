"""Tensor parallelism over a device mesh (Megatron-style base weights, S-LoRA-style adapter bank).

    mesh.py      MeshConfig (the engine config's `mesh:` section) and make_mesh
    layers.py    the collectives the model calls on one shard (psum after o/down, vocab-parallel
                 embedding and logits); imports only jax, so the model can use it
    sharding.py  PartitionSpecs of params / bank / KV cache, divisibility checks, placement (random
                 models drawn in their shards too), and `shard_step`, which runs a whole model step
                 per shard under `shard_map` (the engine's step, and jaxlora.model.forward.forward_logits
                 given a mesh)

Only mesh.py is imported here: sharding.py imports the model, which imports layers.py.
"""

from jaxlora.parallel.mesh import TENSOR_AXIS, MeshConfig, make_mesh

__all__ = ["TENSOR_AXIS", "MeshConfig", "make_mesh"]
