"""Model parameters as a flat name -> array mapping, and the split (graphdef, state) the jitted
steps take.

Flat names are the NNX state paths joined by dots, e.g. `layers.self_attn.q_proj.kernel`
([num_layers, in, out]) or `embed_tokens.embedding` ([vocab, hidden]). Loaders produce this mapping;
`build_model` checks it against the architecture (names and shapes) before any array is used. With a
quantization the seven projections hold `qkernel` + `qscale` instead of `kernel` (jaxlora.model.quant).
A model built with fused=True holds q|k|v and gate|up as one projection each (jaxlora.model.fused);
its `flat_params()` still gives the canonical names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlora.config import ModelConfig
from jaxlora.errors import ModelLoadError
from jaxlora.model.fused import fuse_arrays, is_fused_name, split_arrays
from jaxlora.model.llama import Llama
from jaxlora.model.quant import (
    Quantization,
    from_kmajor_arrays,
    parse_quantization,
    quantize_arrays,
    serving_kmajor,
    to_kmajor_arrays,
)


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A base model ready to run: config, the static graph and the parameter state (a pytree).

    dtype: activations and every dense parameter; quantization: how the projections are stored
    (None: dense, in `dtype`); fused: q|k|v and gate|up stored as one projection each; kmajor:
    the quantized projections stored K-major (`qkernel_t`, the serving layout only).
    """

    config: ModelConfig
    graphdef: nnx.GraphDef
    params: nnx.State
    dtype: jnp.dtype
    quantization: Quantization | None = None
    fused: bool = False
    kmajor: bool = False

    def module(self) -> Llama:
        """A Llama module bound to the params (cheap: use inside jit, or for eager tests)."""
        return nnx.merge(self.graphdef, self.params)

    def flat_params(self) -> dict[str, jax.Array]:
        """name -> array in the canonical layout (a fused model's matrices cut back into modules)."""
        flat = {".".join(map(str, path)): leaf for path, leaf in _flat(self.params)}
        return split_arrays(from_kmajor_arrays(flat), self.config) if self.fused else flat


def _flat(state: nnx.State) -> list[tuple[tuple, jax.Array]]:
    return [(path, var.get_value()) for path, var in nnx.to_flat_state(state)]


def _abstract_state(
    config: ModelConfig,
    dtype: jnp.dtype,
    quantization: Quantization | None,
    fused: bool = False,
    kmajor: bool = False,
) -> tuple[nnx.GraphDef, nnx.State]:
    layout = dict(quantization=quantization, fused=fused, kmajor=kmajor)
    make = lambda: Llama(config, dtype=dtype, rngs=nnx.Rngs(0), **layout)  # noqa: E731
    return nnx.split(nnx.eval_shape(make))


def _expected(state: nnx.State) -> dict[str, jax.ShapeDtypeStruct]:
    """name -> (shape, dtype) of every parameter of an abstract state."""
    return {".".join(map(str, p)): v for p, v in _flat(state)}


def _check_arrays(
    expected: Mapping[str, jax.ShapeDtypeStruct],
    arrays: Mapping[str, np.ndarray | jax.Array],
    quantization: Quantization | None,
    source: str,
) -> None:
    """Raises ModelLoadError naming `source` unless `arrays` has exactly the expected names, shapes
    and (for quantized storage) dtypes."""
    missing = sorted(set(expected) - set(arrays))
    if missing:
        raise ModelLoadError(f"{source}: missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    unexpected = sorted(set(arrays) - set(expected))
    if unexpected:
        raise ModelLoadError(f"{source}: unexpected tensor(s) {unexpected[:5]} for this architecture")
    for name, spec in expected.items():
        if tuple(arrays[name].shape) != tuple(spec.shape):
            raise ModelLoadError(
                f"{source}: tensor {name} has shape {tuple(arrays[name].shape)}, expected {tuple(spec.shape)}"
            )
        if not _is_float(spec.dtype) and arrays[name].dtype != spec.dtype:
            raise ModelLoadError(
                f"{source}: tensor {name} has dtype {arrays[name].dtype}, expected {spec.dtype} "
                f"({quantization} weights are never cast from another format)"
            )


def abstract_model(
    config: ModelConfig,
    dtype: jnp.dtype,
    quantization: Quantization | str | None = None,
    fused: bool = False,
    kmajor: bool | None = None,
) -> tuple[nnx.GraphDef, dict[str, jax.ShapeDtypeStruct]]:
    """The graph and the expected name -> (shape, dtype) of every parameter, without allocating
    (kmajor as in `build_model`)."""
    quantization = parse_quantization(quantization)
    kmajor = serving_kmajor(quantization, fused, kmajor)
    graphdef, state = _abstract_state(config, dtype, quantization, fused, kmajor)
    return graphdef, _expected(state)


def build_model(
    config: ModelConfig,
    arrays: Mapping[str, np.ndarray | jax.Array],
    *,
    dtype: jnp.dtype = jnp.float32,
    quantization: Quantization | str | None = None,
    fused: bool = False,
    kmajor: bool | None = None,
    source: str = "<arrays>",
) -> LoadedModel:
    """Validates names and shapes of `arrays` (canonical names) against `config` and places them on
    the device.

    With a quantization, dense projection kernels among `arrays` are quantized here (on the default
    device, one tensor at a time); projections given already quantized must have the format's dtype.
    fused=True builds the serving layout (jaxlora.model.fused): q|k|v and gate|up are concatenated
    here, after quantizing (each scale stays with its column), and the quantized weights are stored
    K-major (`qkernel_t`, jaxlora.model.quant) where `kmajor` says: None takes the format's default,
    jaxlora.kernels.KMAJOR_SERVING (both 8-bit formats); True or False overrides it (True only for a
    quantized serving layout: ValueError otherwise), so one process can build both layouts.
    Raises ModelLoadError naming `source` and the offending tensor.
    """
    quantization = parse_quantization(quantization)
    kmajor = serving_kmajor(quantization, fused, kmajor)
    if quantization is not None:
        arrays = quantize_arrays(arrays, quantization)
    if fused:
        if any(is_fused_name(n) for n in arrays):
            raise ModelLoadError(f"{source}: give the canonical (unfused) tensors; fused ones are made here")
        # Each piece is checked before the concatenation: a fused width that adds up can still hide
        # swapped pieces (q as wide as k|v), and a misshapen one would fail inside the concatenate.
        _check_arrays(_expected(_abstract_state(config, dtype, quantization)[1]), arrays, quantization, source)
        arrays = fuse_arrays(arrays)
        if kmajor:
            arrays = to_kmajor_arrays(arrays)
    return assemble_model(
        config, arrays, dtype=dtype, quantization=quantization, fused=fused, kmajor=kmajor, source=source
    )


def assemble_model(
    config: ModelConfig,
    arrays: Mapping[str, np.ndarray | jax.Array],
    *,
    dtype: jnp.dtype,
    quantization: Quantization | None,
    fused: bool,
    kmajor: bool | None = None,
    source: str = "<arrays>",
) -> LoadedModel:
    """A LoadedModel of `arrays` given in the stored layout (fused names where `fused`, `qkernel_t`
    where `kmajor`, as in `build_model`; storage dtypes): checked against `config` and placed,
    nothing converted or concatenated, so arrays already on the device (a 70B-shape base drawn there
    in FP8) are used as they are. Raises ModelLoadError."""
    quantization = parse_quantization(quantization)
    kmajor = serving_kmajor(quantization, fused, kmajor)
    graphdef, state = _abstract_state(config, dtype, quantization, fused, kmajor)
    _check_arrays(_expected(state), arrays, quantization, source)
    for path, var in nnx.to_flat_state(state):
        # The expected dtype: `dtype` for dense parameters, the storage dtype / float32 for quantized ones.
        var.set_value(jnp.asarray(arrays[".".join(map(str, path))], dtype=var.get_value().dtype))
    return LoadedModel(
        config=config,
        graphdef=graphdef,
        params=state,
        dtype=jnp.dtype(dtype),
        quantization=quantization,
        fused=fused,
        kmajor=kmajor,
    )


def _is_float(dtype: jnp.dtype) -> bool:
    """A dtype any float array may be cast to (fp8 storage is not: it takes scaled values only)."""
    return jnp.dtype(dtype) in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def random_model(
    config: ModelConfig,
    *,
    dtype: jnp.dtype = jnp.float32,
    seed: int = 0,
    std: float = 0.02,
    quantization: Quantization | str | None = None,
    fused: bool = False,
    kmajor: bool | None = None,
) -> LoadedModel:
    """A model with random weights (tests and benchmarks); fused=True in the serving layout, with
    the same values as the separate layout drawn from the same seed (kmajor as in `build_model`).

    Matrices are N(0, std); norm scales are 1 + N(0, 0.1) so that a norm applied with the wrong
    weight cannot go unnoticed. Drawn as `draw_params` says (small models on the host, large ones
    on the device, so a 7B-shape model never crosses the host link). With a quantization the dense
    draw is quantized (the same seed gives the same underlying weights in every format).
    """
    return build_model(
        config,
        draw_params(config, dtype=dtype, seed=seed, std=std),
        dtype=dtype,
        quantization=quantization,
        fused=fused,
        kmajor=kmajor,
        source="random",
    )


def draw_params(
    config: ModelConfig,
    *,
    dtype: jnp.dtype,
    seed: int = 0,
    std: float = 0.02,
    shardings: Mapping[str, jax.sharding.Sharding] | None = None,
    host_max_values: int = 50_000_000,
) -> dict[str, np.ndarray | jax.Array]:
    """Random parameters, name -> array, as `random_model` draws them.

    Models under `host_max_values` values are drawn with numpy (instant; a jitted draw costs seconds
    of compile on a CPU), larger ones on the device in one jitted call, so a big model never crosses
    the host link.
    shardings: name -> where each array goes (None: numpy arrays or the default device). On the
    device path each device draws only its own shard: jax's partitionable threefry gives the same
    numbers for every placement, so a model split over a mesh is never whole on one device or on
    the host, and equals the unsplit one.
    """
    _, expected = abstract_model(config, dtype)
    names = sorted(expected)
    if sum(int(np.prod(expected[n].shape)) for n in names) < host_max_values:
        rng = np.random.default_rng(seed)
        arrays = {n: _init_value(n, rng.standard_normal(expected[n].shape, np.float32), std) for n in names}
        if shardings is None:
            return arrays
        return {n: jax.device_put(np.asarray(a, dtype), shardings[n]) for n, a in arrays.items()}

    def draw(key):
        return {
            n: _init_value(n, _normal(jax.random.fold_in(key, i), expected[n].shape, dtype), std)
            for i, n in enumerate(names)
        }

    return jax.jit(draw, out_shardings=None if shardings is None else dict(shardings))(jax.random.key(seed))


def _normal(key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
    """N(0, 1) of `shape`; a stacked leaf [L, ...] one layer at a time, so that the draw's temporaries
    stay one layer's size (a 70B-shape MLP leaf is ~19 GB per device even split over two)."""
    if len(shape) < 3:
        return jax.random.normal(key, shape, dtype)
    layers = jnp.arange(shape[0], dtype=jnp.int32)
    return jax.lax.map(lambda i: jax.random.normal(jax.random.fold_in(key, i), shape[1:], dtype), layers)


def quantized_model(model: LoadedModel, quantization: Quantization | str, *, kmajor: bool | None = None) -> LoadedModel:
    """`model` (dense) with its projections quantized, in `model`'s layout and stored K-major where
    `kmajor` says (as in `build_model`); the dense model is left as it is."""
    if model.quantization is not None:
        raise ValueError(f"the model is already quantized ({model.quantization}); quantize a dense model")
    return build_model(
        model.config,
        model.flat_params(),
        dtype=model.dtype,
        quantization=quantization,
        fused=model.fused,
        kmajor=kmajor,
        source="quantized_model",
    )


def _init_value(name: str, normal, std: float):
    return 1.0 + 0.1 * normal if name.endswith(".scale") else std * normal
