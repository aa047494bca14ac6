"""A dense Hugging Face base straight from its mapped safetensors files into its final device buffers.

Each stored layer parameter ([num_layers, in, out] kernels, fused where the serving layout fuses
q|k|v and gate|up, see jaxlora.model.fused) is allocated once on the device. Worker threads prepare
each layer's Hugging Face tensors ([out, in]) from the memory-mapped files
(jaxlora.safetensors_map): a single tensor as the mapped view itself, its pages asked for
ahead (madvise), a fused layer's pieces as one concatenation of their rows. The device transposes
and casts each layer and writes it into its slice in place. The tensors outside the layers
(embedding, final norm, lm_head) go whole. The older path (`hf_folder.load_hf_arrays` then
`build_model`) read, transposed, stacked and fused on the host: four copies of every weight, the
transpose the slowest (numpy transposes a 2-byte matrix element by element, far below memory
bandwidth). Why and what it measured: benchmarks/DECISIONS.md#hf-one-pass.

Every check happens before a byte is copied: each expected piece must exist with its shape, no
tensor may be left unused (rotary `inv_freq` buffers and a tied model's `lm_head.weight` aside),
and weights must be bf16, f16, f32 or f64.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxlora.config import ModelConfig
from jaxlora.errors import ModelLoadError
from jaxlora.loading.names import FLAT_LAYER_TENSORS, GLOBAL_TENSORS
from jaxlora.model.fused import FUSED_GROUPS, module_columns
from jaxlora.safetensors_map import MappedTensor, map_files

_FLOATS = ("bfloat16", "float16", "float32", "float64")
# Host work is reads of the mapped files and memcpys; past a few threads they only contend.
MAX_COPY_THREADS = 8
# Host pieces prepared ahead of the device, at most (at least one is, whatever its size).
MAX_AHEAD_BYTES = 2 << 30


@dataclasses.dataclass(frozen=True)
class Piece:
    """One Hugging Face tensor's place in a stored buffer: `dst[layer][..., column:column + w]`
    (`dst[...]` for a tensor outside the layers), transposed from [out, in] where `transpose`."""

    key: str
    canonical: str  # the flat (unfused) name it belongs to, for error messages
    layer: int | None
    column: int
    width: int
    transpose: bool


@dataclasses.dataclass(frozen=True)
class StoredParam:
    """One stored parameter: its shape and dtype and the pieces that fill it."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    pieces: tuple[Piece, ...]


def _pieces(name: str, config: ModelConfig, column: int, width: int) -> list[Piece]:
    """The pieces of one canonical flat parameter, at columns [column, column + width) of its
    stored buffer."""
    if name in GLOBAL_TENSORS:
        key, transpose = GLOBAL_TENSORS[name]
        return [Piece(key, name, None, column, width, transpose)]
    if name not in FLAT_LAYER_TENSORS:
        raise ModelLoadError(f"no Hugging Face tensor holds parameter {name}")
    suffix, transpose = FLAT_LAYER_TENSORS[name]
    return [Piece(f"model.layers.{i}.{suffix}", name, i, column, width, transpose) for i in range(config.num_layers)]


def stored_params(config: ModelConfig, expected: Mapping[str, jax.ShapeDtypeStruct]) -> list[StoredParam]:
    """The plan: each stored parameter of `expected` (jaxlora.model.params.abstract_model's shapes,
    fused names included) with its pieces, fused columns at jaxlora.model.fused's offsets."""
    fused_parts = {
        f"{parent}.{fused}.{leaf}": [f"{parent}.{p}.{leaf}" for p in parts]
        for parent, fused, parts in FUSED_GROUPS
        for leaf in ("kernel", "bias")
    }
    offsets = {parent: module_columns(config, parts) for parent, _, parts in FUSED_GROUPS}
    out = []
    for name, spec in expected.items():
        parts = fused_parts.get(name, [name])
        starts = offsets[name.rsplit(".", 2)[0]] if name in fused_parts else (0,)
        ends = (*starts[1:], spec.shape[-1])
        pieces = [p for part, a, b in zip(parts, starts, ends) for p in _pieces(part, config, a, b - a)]
        out.append(StoredParam(name, tuple(spec.shape), np.dtype(spec.dtype), tuple(pieces)))
    return out


def _piece_shape(param: StoredParam, piece: Piece) -> tuple[int, ...]:
    """The shape the piece's Hugging Face tensor must have."""
    inner = param.shape if piece.layer is None else param.shape[1:]
    slot = (*inner[:-1], piece.width)
    return slot[::-1] if piece.transpose else slot


def check_plan(plan: list[StoredParam], tensors: Mapping[str, MappedTensor], config: ModelConfig, source: str) -> None:
    """Raises ModelLoadError naming the first problem: an unexpected, missing, misshapen or
    non-float tensor."""
    wanted = {p.key for param in plan for p in param.pieces}
    for key in tensors:
        if key in wanted or key.endswith("rotary_emb.inv_freq"):
            continue
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue  # tied: the embedding is the head (as the older loader did)
        raise ModelLoadError(f"{source}: unexpected tensor {key}")
    for param in plan:
        missing = [p for p in param.pieces if p.key not in tensors]
        if missing:
            first = missing[0].canonical
            layers = [p.layer for p in missing if p.layer is not None and p.canonical == first]
            if layers:
                raise ModelLoadError(f"{source}: missing tensor for layer(s) {layers[:5]} of {first}")
            raise ModelLoadError(f"{source}: missing tensor(s) {[p.key for p in missing][:5]}")
        for p in param.pieces:
            t = tensors[p.key]
            if t.dtype.name not in _FLOATS:
                raise ModelLoadError(
                    f"{source}: tensor {p.key} has dtype {t.dtype}; a dense base loads from bf16, f16, f32 or f64"
                )
            want = _piece_shape(param, p)
            if t.shape != want:
                raise ModelLoadError(f"{source}: tensor {p.key} has shape {t.shape}, expected {want}")


def _host_piece(param: StoredParam, layer: int | None, tensors: Mapping[str, MappedTensor]) -> np.ndarray:
    """One layer of `param` (or the whole of a tensor outside the layers) in the Hugging Face
    layout: the mapped view itself for a single piece (no copy), else its pieces concatenated in
    column order (one contiguous copy: [out, in] pieces stack on their rows)."""
    pieces = [p for p in param.pieces if p.layer == layer]
    if len(pieces) == 1:
        tensors[pieces[0].key].will_need()
        return tensors[pieces[0].key].array()
    views = [tensors[p.key].array() for p in pieces]
    return np.concatenate(views, axis=0 if pieces[0].transpose else -1)


@functools.partial(jax.jit, donate_argnums=0)
def _write_layer(dst: jax.Array, x: jax.Array, layer: jax.Array) -> jax.Array:
    """dst [L, ...] with dst[layer] = x, in place (dst donated)."""
    return jax.lax.dynamic_update_index_in_dim(dst, x, layer, 0)


@functools.partial(jax.jit, static_argnames=("dtype", "transpose"))
def _to_stored(x: jax.Array, *, dtype: np.dtype, transpose: bool) -> jax.Array:
    """x transposed from [out, in] (where `transpose`) and cast. A program of its own, not fused into
    `_write_layer`: XLA's CPU backend runs a transpose fused into the in-place update several times
    slower than the two apart."""
    return (x.T if transpose else x).astype(dtype)


def _place(param: StoredParam, layers: Iterator[np.ndarray], device: jax.Device | None) -> jax.Array:
    """`param` on `device` (None: JAX's default) from its host pieces (in `_layers` order): transposed
    and cast there."""
    transpose = param.pieces[0].transpose
    if param.pieces[0].layer is None:
        x = jax.device_put(next(layers), device)
        if not transpose and x.dtype == param.dtype:
            return x  # already fresh device memory in its final form
        return _to_stored(x, dtype=param.dtype, transpose=transpose)
    dst = jnp.zeros(param.shape, param.dtype, device=device)
    for i in _layers(param):
        x = _to_stored(jax.device_put(next(layers), device), dtype=param.dtype, transpose=transpose)
        dst = _write_layer(dst, x, np.int32(i))
    return dst


def _layers(param: StoredParam) -> list[int | None]:
    """The host pieces `param` is placed from, in order: its layers, or [None] outside the layers."""
    return [None] if param.pieces[0].layer is None else list(range(param.shape[0]))


def _piece_nbytes(param: StoredParam, layer: int | None, tensors: Mapping[str, MappedTensor]) -> int:
    return sum(tensors[p.key].nbytes for p in param.pieces if p.layer == layer)


def place_params(
    plan: list[StoredParam],
    tensors: Mapping[str, MappedTensor],
    *,
    device: jax.Device | None = None,
    threads: int | None = None,
) -> dict[str, jax.Array]:
    """Every stored parameter of `plan` on `device` (None: JAX's default device), filled from `tensors`.

    Worker threads prepare the pieces at most `2 x threads` pieces and MAX_AHEAD_BYTES ahead of the
    device, which receives them in order and transposes, casts and writes each layer into its final
    buffer in place (donated): no buffer larger than one layer's piece is freed between the layer
    weights, so the device memory the KV pool takes next stays in one block
    (benchmarks/DECISIONS.md#load-on-device).
    """
    threads = threads or max(1, min(MAX_COPY_THREADS, os.cpu_count() or 1))
    jobs = collections.deque((param, layer) for param in plan for layer in _layers(param))
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="jaxlora-load") as pool:
        ahead: collections.deque[tuple[concurrent.futures.Future, int]] = collections.deque()

        def pieces() -> Iterator[np.ndarray]:
            while True:
                while jobs and len(ahead) < 2 * threads:
                    nbytes = _piece_nbytes(*jobs[0], tensors)
                    if ahead and sum(n for _, n in ahead) + nbytes > MAX_AHEAD_BYTES:
                        break
                    param, layer = jobs.popleft()
                    ahead.append((pool.submit(_host_piece, param, layer, tensors), nbytes))
                if not ahead:
                    return
                yield ahead.popleft()[0].result()

        stream = pieces()
        out = {param.name: _place(param, stream, device) for param in plan}
    return jax.block_until_ready(out)


def load_hf_placed(
    folder: Path, files: list[Path], config: ModelConfig, expected: Mapping[str, jax.ShapeDtypeStruct]
) -> dict[str, jax.Array]:
    """name -> device array of every stored parameter in `expected` (fused names where fused),
    from the safetensors `files` of `folder`. Raises ModelLoadError."""
    tensors = map_files(files)
    plan = stored_params(config, expected)
    check_plan(plan, tensors, config, str(folder))
    return place_params(plan, tensors)
