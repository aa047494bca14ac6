"""Lower every Triton kernel for CUDA on the CPU machine: catches what interpret mode does not check
(power-of-two sizes, dot shapes, unsupported ops), with an abstract H200 standing in for the GPU.
Every Triton module is also run through the MLIR verifier, as XLA does when it parses the module on
the GPU (a loop whose bounds differ in type lowers, and fails only there)."""

from __future__ import annotations

import contextlib
from unittest import mock

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

import pallas_kernels as pk

H200 = AbstractMesh(
    (1,), ("x",), abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
)
I32 = jnp.int32


@contextlib.contextmanager
def _verified_triton_modules():
    """Every Triton module lowered inside is verified (raises on an invalid one); yields the count."""
    from jax._src.pallas.triton import lowering

    lower, count = lowering.lower_jaxpr_to_triton_module, [0]

    def verified(*args, **kwargs):
        result = lower(*args, **kwargs)
        result.module.operation.verify()
        count[0] += 1
        return result

    with mock.patch.object(lowering, "lower_jaxpr_to_triton_module", verified):
        yield count


def _lower_for_cuda(fn, *args) -> str:
    with jax.sharding.use_abstract_mesh(H200), _verified_triton_modules() as verified:
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    if text.count("__gpu$xla.gpu.triton") and not verified[0]:
        raise AssertionError("Triton modules were lowered without passing through the verifier")
    return text


def _specs(dtype, num_tokens, hidden, rank, out_dim, num_slots=5, num_segments=3):
    sd = jax.ShapeDtypeStruct
    return dict(
        x=sd((num_tokens, hidden), dtype),
        a=sd((num_slots, hidden, rank), dtype),
        y=sd((num_tokens, out_dim), dtype),
        h=sd((num_tokens, rank), dtype),
        b=sd((num_slots, rank, out_dim), dtype),
        slots=sd((num_tokens,), I32),
        starts=sd((num_segments + 1,), I32),
        seg_slots=sd((num_segments,), I32),
    )


def _grouped_decode_expand(y, h, b, slots, **knobs):
    """The benchmarks' grouped decode candidate (`expand.grouped_expand` over rows grouped by slot)."""
    from pallas_kernels.lora import common, expand

    groups = common.make_row_groups(slots, num_slots=b.shape[0], seg_len=None, block_rows=())
    return expand.grouped_expand(y, h, b, groups, mode="decode", **knobs)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("shape", [(37, 2049, 48, 300), (256, 4096, 16, 11008), (2048, 576, 1, 1536)])
def test_kernels_lower_for_cuda(dtype, shape):
    s = _specs(dtype, *shape)
    cases = {
        "bgmv_shrink": (pk.bgmv_shrink, (s["x"], s["a"], s["slots"])),
        "sgmv_shrink": (pk.sgmv_shrink, (s["x"], s["a"], s["starts"], s["seg_slots"])),
        "bgmv_expand_rows": (
            lambda *a: pk.bgmv_expand(*a, block_rows=4),
            (s["y"], s["h"], s["b"], s["slots"]),
        ),
        "decode_expand_grouped": (
            lambda *a: _grouped_decode_expand(*a, block_rows=16, block_out=128),
            (s["y"], s["h"], s["b"], s["slots"]),
        ),
        "decode_expand_grouped_small": (
            lambda *a: _grouped_decode_expand(*a, block_rows=4, block_out=128),
            (s["y"], s["h"], s["b"], s["slots"]),
        ),
        "sgmv_expand": (pk.sgmv_expand, (s["y"], s["h"], s["b"], s["starts"], s["seg_slots"])),
    }
    for name, (fn, args) in cases.items():
        assert "__gpu$xla.gpu.triton" in _lower_for_cuda(fn, *args), name


def test_multi_module_expand_lowers_for_cuda():
    s = _specs(jnp.bfloat16, 64, 576, 48, 576)
    sd = jax.ShapeDtypeStruct
    bs = tuple(sd((5, 16, o), jnp.bfloat16) for o in (576, 192, 192))
    ys = tuple(sd((64, o), jnp.bfloat16) for o in (576, 192, 192))

    def step(x, a, ys, bs, slots):
        h = pk.lora_shrink(x, a, slots, backend="pallas")
        return pk.lora_expand_multi(ys, h, bs, slots, backend="pallas")

    assert "__gpu$xla.gpu.triton" in _lower_for_cuda(step, s["x"], s["a"], ys, bs, s["slots"])


def test_fused_decode_group_on_a_stacked_bank_lowers_for_cuda():
    """The model's decode path: two Triton launches per group, the layer index traced."""
    sd = jax.ShapeDtypeStruct
    x, slots = sd((64, 576), jnp.bfloat16), sd((64,), jnp.int32)
    a = sd((3, 5, 576, 48), jnp.bfloat16)
    bs = tuple(sd((3, 5, 16, o), jnp.bfloat16) for o in (576, 192, 192))
    ys = tuple(sd((64, o), jnp.bfloat16) for o in (576, 192, 192))

    def step(x, a, ys, bs, slots, layer):
        return pk.lora_group(x, a, ys, bs, slots, backend="pallas", layer=layer)

    text = _lower_for_cuda(step, x, a, ys, bs, slots, sd((), jnp.int32))
    assert text.count("__gpu$xla.gpu.triton") == 2


@pytest.mark.parametrize("expand", ["rows", "tiles"])
def test_decode_group_into_one_fused_output_lowers_for_cuda(monkeypatch, expand):
    """The serving layout's decode path: q|k|v in one output [T, 960], still two Triton launches,
    with the per-row expand or the tile expand (b once per work item)."""
    if expand == "tiles":
        row = dict(impl="split_tiles", block_rows=16, block_out=128, num_warps=4, num_stages=1)
        for rank_bucket in list(pk.tuning.GROUP_DECODE):
            monkeypatch.setitem(pk.tuning.GROUP_DECODE, rank_bucket, {1 << 30: row})
    sd = jax.ShapeDtypeStruct
    x, slots = sd((64, 576), jnp.bfloat16), sd((64,), jnp.int32)
    a = sd((3, 5, 576, 48), jnp.bfloat16)
    bs = tuple(sd((3, 5, 16, o), jnp.bfloat16) for o in (576, 192, 192))
    y = sd((64, 960), jnp.bfloat16)

    def step(x, a, y, bs, slots, layer):
        return pk.lora_group(x, a, (y,), bs, slots, backend="pallas", layer=layer, out_cols=(0, 576, 768))

    text = _lower_for_cuda(step, x, a, y, bs, slots, sd((), jnp.int32))
    assert text.count("__gpu$xla.gpu.triton") == 2
    assert ("lora_decode_expand_tiles" in text) == (expand == "tiles")


def test_non_power_of_two_block_is_rejected_before_lowering():
    s = _specs(jnp.bfloat16, 32, 576, 16, 576)
    with pytest.raises(ValueError, match="power of two"):
        _lower_for_cuda(lambda x, a, sl: pk.bgmv_shrink(x, a, sl, block_k=96), s["x"], s["a"], s["slots"])
    with pytest.raises(ValueError, match="block_rows"):
        _lower_for_cuda(lambda x, a, sl: pk.bgmv_shrink(x, a, sl, block_rows=8), s["x"], s["a"], s["slots"])


@pytest.mark.parametrize(
    "hidden, rank, dtype", [(2049, 16, jnp.bfloat16), (2049, 5, jnp.float32), (4096, 64, jnp.bfloat16)]
)
def test_one_launch_group_lowers_for_cuda(hidden, rank, dtype):
    """The fused group kernel (shrink and expand in one program): one Triton launch for three modules
    of a fused q|k|v output, the layer index traced, awkward widths; at hidden 4096 and a power-of-two
    rank the A tiles load unmasked (Triton then takes no fill value)."""
    from pallas_kernels.lora import common, fused

    sd = jax.ShapeDtypeStruct
    x, slots = sd((37, hidden), dtype), sd((37,), jnp.int32)
    a = sd((3, 5, hidden, 3 * rank), dtype)
    bs = tuple(sd((3, 5, rank, o), dtype) for o in (576, 192, 300))
    y = sd((37, 1068), dtype)

    def step(x, a, y, bs, slots, layer):
        groups = common.make_row_groups(slots, num_slots=5, seg_len=None, block_rows=(16,))
        knobs = dict(block_rows=16, block_k=128, block_out=256, col_split=2, num_warps=4, num_stages=3)
        return fused.fused_group(x, a, (y,), bs, groups, mode="decode", layer=layer, out_cols=(0, 576, 768), **knobs)

    text = _lower_for_cuda(step, x, a, y, bs, slots, sd((), jnp.int32))
    assert text.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("dtype, hidden, out, page_rows", [(jnp.bfloat16, 4096, 11008, 8), (jnp.float32, 2049, 300, 1)])
def test_paged_kernels_lower_for_cuda(dtype, hidden, out, page_rows):
    """The page-table shrink and expand (true-rank adapters): the per-row page loop has a traced trip count."""
    from pallas_kernels.lora import paged

    sd = jax.ShapeDtypeStruct
    pool = sd((300, page_rows, max(hidden, out)), dtype)
    table, ranks, ids = sd((7, 16), I32), sd((7,), I32), sd((37,), I32)
    x, y = sd((37, hidden), dtype), sd((37, out), dtype)

    def step(x, y, pool, a_table, b_table, ranks, ids):
        h = paged.paged_shrink(x, pool, a_table, ranks, ids)
        return paged.paged_expand(y, h, pool, b_table, ranks, ids)

    text = _lower_for_cuda(step, x, y, pool, table, table, ranks, ids)
    assert text.count("__gpu$xla.gpu.triton") == 2


@pytest.mark.parametrize(
    "dtype, hidden, outs, max_rank, kv_page, k_splits, unroll",
    [
        (jnp.bfloat16, 4096, (11008,), 64, (16, 32, 128), 1, 1),
        (jnp.bfloat16, 4096, (11008,), 64, (16, 32, 128), 4, 4),
        (jnp.float32, 576, (192,), 33, (16, 3, 64), 1, 1),
        (jnp.float32, 576, (192,), 33, (16, 3, 64), 2, 3),
        (jnp.bfloat16, 4096, (4096, 1024, 1024), 16, (16, 8, 128), 4, 4),
        (jnp.float32, 576, (576, 192, 192), 33, (16, 3, 64), 8, 2),
    ],
)
def test_unified_kernels_lower_for_cuda(dtype, hidden, outs, max_rank, kv_page, k_splits, unroll):
    """The shrink and expand that read adapters out of the KV pool (7B and SmolLM2 page shapes, a
    max rank that is not a power of two): the per-chunk page lookup and the rank loops lower, with
    the shrink's width split over programs (uneven: 9 chunks over 2) and its loop steps unrolled
    (with a tail), its partial sums added by the expand; and a q|k|v group (GQA widths) in one
    launch each way, [S, G] tables."""
    from pallas_kernels.lora import unified

    sd = jax.ShapeDtypeStruct
    pool = sd((4, 300, *kv_page), dtype)
    table = (7,) if len(outs) == 1 else (7, len(outs))
    pages, offsets, ranks, ids = sd((7, 40), I32), sd(table, I32), sd(table, I32), sd((37,), I32)
    x, y = sd((37, hidden), dtype), sd((37, sum(outs)), dtype)
    columns = tuple(sum(outs[:i]) for i in range(len(outs)))

    def step(x, y, k, v, layer, pages, a_off, b_off, ranks, ids):
        kw = dict(k_splits=k_splits, unroll=unroll, partials=k_splits > 1)
        h = unified.unified_shrink(x, k, v, layer, pages, a_off, ranks, ids, max_rank=max_rank, align=128, **kw)
        return unified.unified_expand(y, h, k, v, layer, pages, b_off, ranks, ids, align=128, columns=columns)

    text = _lower_for_cuda(step, x, y, pool, pool, sd((), I32), pages, offsets, offsets, ranks, ids)
    assert text.count("__gpu$xla.gpu.triton") == 2


@pytest.mark.parametrize(
    "dtype, hidden, out, max_rank, kv_page, tokens",
    [(jnp.bfloat16, 4096, 11008, 64, (16, 32, 128), 2048), (jnp.float32, 576, 192, 33, (16, 3, 64), 37)],
)
def test_unified_tiled_kernels_lower_for_cuda(dtype, hidden, out, max_rank, kv_page, tokens):
    """The tiled unified shrink and expand (rows grouped by slot, tensor-core dots) lower and verify."""
    from pallas_kernels.lora import common, unified_tiled

    sd = jax.ShapeDtypeStruct
    pool = sd((4, 300, *kv_page), dtype)
    pages, offsets, ranks, ids = sd((7, 40), I32), sd((7,), I32), sd((7,), I32), sd((tokens,), I32)
    x, y = sd((tokens, hidden), dtype), sd((tokens, out), dtype)

    def step(x, y, k, v, layer, pages, a_off, b_off, ranks, ids):
        groups = common.make_row_groups(ids, num_slots=7, seg_len=None, block_rows=(16,))
        kw = dict(align=128, block_rows=16)
        h = unified_tiled.unified_tiled_shrink(x, k, v, layer, pages, a_off, ranks, groups, max_rank=max_rank, **kw)
        return unified_tiled.unified_tiled_expand(y, h, k, v, layer, pages, b_off, ranks, groups, **kw)

    text = _lower_for_cuda(step, x, y, pool, pool, sd((), I32), pages, offsets, offsets, ranks, ids)
    assert text.count("__gpu$xla.gpu.triton") == 2
