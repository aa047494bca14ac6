"""A Llama-family decoder in Flax NNX: GQA, RoPE, RMSNorm, SwiGLU, optional q/k/v(/o) bias.

Layers are stacked (every per-layer parameter has a leading `num_layers` axis) and run with
`lax.scan`, so compile time does not grow with depth. The model is pure: the KV cache and the
adapter bank go in as arguments and the updated cache comes back.

Two cache layouts, one model: rows of a dense `KVCache` ([b, t] tokens, row i of the batch is cache
row i or `row_ids[i]`; tests, training and tools), and the serving engine's `PagedKVCache` with a
`RaggedBatch`: a flat batch of tokens of many sequences (decode tokens and prompt chunks packed with
no per-row padding), keys and values written through each sequence's block table, attention by the
ragged paged-attention kernel (`pallas_kernels.ragged_paged_attention`).

Parameter names follow Hugging Face's (`layers.self_attn.q_proj.kernel` is HF's
`model.layers.{i}.self_attn.q_proj.weight`, transposed to [in, out] and stacked over layers).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

import pallas_kernels
from jaxlora.config import AttentionBackend, ModelConfig
from jaxlora.kernels import StepKernels
from jaxlora.lora.apply import (
    GROUP_MODULES,
    apply_group,
    apply_group_fused,
    step_plan,
    token_slots_for,
)
from jaxlora.lora.unified_bank import is_unified, with_kv_pool, with_stacked_tables
from jaxlora.model.fused import module_columns
from jaxlora.model.kv_cache import KVCache, PagedKVCache
from jaxlora.model.quant import Quantization, QuantLinear, project, serving_kmajor
from jaxlora.model.rope import apply_rope, inverse_frequencies
from jaxlora.parallel import layers as tp

_NEG_INF = -1e30
_QKV = GROUP_MODULES["qkv"]
_GATE_UP = GROUP_MODULES["gate_up"]


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, param_dtype: jnp.dtype):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        # Normalise in float32, cast back, then scale: the order Hugging Face uses.
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.scale[...] * xf.astype(x.dtype)


def _linear(
    d_in: int,
    d_out: int,
    bias: bool,
    dtype: jnp.dtype,
    rngs: nnx.Rngs,
    quantization: Quantization | None = None,
    k_major: bool = False,
) -> nnx.Linear | QuantLinear:
    """A projection, `layer(x) = x @ W (+ b)`: dense in `dtype`, or weight-only quantized (stored
    K-major with `k_major`: jaxlora.model.quant's module doc)."""
    if quantization is not None:
        return QuantLinear(d_in, d_out, quantization=quantization, use_bias=bias, dtype=dtype, k_major=k_major)
    return nnx.Linear(
        d_in, d_out, use_bias=bias, dtype=dtype, param_dtype=dtype, rngs=rngs, kernel_init=nnx.initializers.normal(0.02)
    )


# The parameters a quantized projection keeps stacked over layers on the kernel path (see `Llama.__call__`).
_IN_PLACE_WEIGHTS = nnx.Any(nnx.PathContains("qkernel"), nnx.PathContains("qkernel_t"), nnx.PathContains("qscale"))


def _apply_linear(linear: nnx.Linear | QuantLinear, x: jax.Array, layer: jax.Array, kernels: StepKernels) -> jax.Array:
    """linear(x) with its bias; a quantized projection holding the whole stack multiplies by layer `layer`."""
    if isinstance(linear, QuantLinear):
        return linear(
            x, layer=layer, kernel=kernels.quant_kernel, interpret=kernels.interpret, w8a8=_w8a8(linear, x, kernels)
        )
    return linear(x)


def _w8a8(linear: nnx.Linear | QuantLinear, x: jax.Array, kernels: StepKernels) -> bool:
    """Whether this step (x [N, in]: N tokens) multiplies `linear` W8A8 (StepKernels.w8a8_at)."""
    return isinstance(linear, QuantLinear) and kernels.w8a8_at(x.shape[0], linear.storage_dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RaggedBatch:
    """Where the tokens of a flat batch [T] belong, for the paged cache (S = sequences per step).

    q_start: [S] int32 first flat index of sequence s's tokens in this step.
    q_len: [S] int32 tokens of sequence s in this step (0: not in this step).
    kv_len: [S] int32 positions of s cached after this step (its tokens are the last q_len).
    block_tables: [S, pages_per_seq] int32 page of each page-sized span of s's positions.
    write_page: [T] int32 page each token's key/value goes to (out of range for padding: dropped).
    write_offset: [T] int32 offset in that page. Each in-range (write_page, write_offset) is written
      by at most one token of the step: the scatter promises XLA unique indices (`_write_pages`).
    """

    q_start: jax.Array
    q_len: jax.Array
    kv_len: jax.Array
    block_tables: jax.Array
    write_page: jax.Array
    write_offset: jax.Array

    @property
    def last_index(self) -> jax.Array:
        """[S] int32 flat index of each sequence's last token in this step (0 when it has none)."""
        return jnp.maximum(self.q_start + self.q_len - 1, 0)


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """What one layer needs besides its own weights (the same for every layer).

    positions: [b, t] int32 absolute position of each token.
    row_ids: [b] int32 cache row of each batch row, or None when batch row i is cache row i.
    token_slots: [b * t] int32 adapter slot of each token.
    seg_len: t when t > 1 (rows are contiguous runs sharing a slot), else None.
    lora_plan: the row grouping every LoRA op of this step shares (built once, before the layer
      scan), or None without a bank.
    tensor_axis: the mesh axis the weights are split over when the step runs per shard under
      `shard_map` (jaxlora.parallel), else None. Head counts then come from the local shapes.
    """

    positions: jax.Array
    row_ids: jax.Array | None
    token_slots: jax.Array
    seg_len: int | None
    kernels: StepKernels
    inv_freq: jax.Array
    lora_plan: pallas_kernels.LoraPlan | None = None
    tensor_axis: str | None = None
    ragged: RaggedBatch | None = None


def _check_unfused(fused: bool, s: StepInputs) -> None:
    if fused and s.tensor_axis is not None:
        raise ValueError("tensor parallelism needs the separate projection layout (build the model with fused=False)")


def _fused_projection(
    linear, group: str, modules: tuple[str, ...], cfg: ModelConfig, x2, layer, lora: dict, s: StepInputs
) -> dict[str, jax.Array]:
    """One GEMM for the modules sharing x2 (jaxlora.model.fused), their LoRA terms added in place in
    its columns, then split: module -> [N, out_m]."""
    y = _apply_linear(linear, x2, layer, s.kernels)  # [N, sum of the modules' widths]
    starts = module_columns(cfg, modules)
    y = apply_group_fused(
        group, lora.get(group), x2, y, starts, s.token_slots, s.kernels, s.seg_len, plan=s.lora_plan, layer=layer
    )
    cols = starts + (y.shape[1],)
    return {m: y[:, cols[i] : cols[i + 1]] for i, m in enumerate(modules)}


class Attention(nnx.Module):
    """fused: q|k|v as one projection `qkv_proj` (the serving layout, jaxlora.model.fused)."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
        quantization: Quantization | None = None,
        fused: bool = False,
        kmajor: bool = False,
    ):
        self.cfg = cfg
        self.fused = fused
        if fused:
            width = cfg.q_size + 2 * cfg.kv_size
            self.qkv_proj = _linear(cfg.hidden_size, width, cfg.attention_bias, dtype, rngs, quantization, kmajor)
        else:
            self.q_proj = _linear(cfg.hidden_size, cfg.q_size, cfg.attention_bias, dtype, rngs, quantization)
            self.k_proj = _linear(cfg.hidden_size, cfg.kv_size, cfg.attention_bias, dtype, rngs, quantization)
            self.v_proj = _linear(cfg.hidden_size, cfg.kv_size, cfg.attention_bias, dtype, rngs, quantization)
        self.o_proj = _linear(cfg.q_size, cfg.hidden_size, cfg.o_proj_bias, dtype, rngs, quantization, kmajor)

    def __call__(self, x: jax.Array, kv: KVCache, layer: jax.Array, lora: dict, s: StepInputs):
        """x [b, t, D]; kv: every layer's cache; layer: this layer's index -> (out [b, t, D], kv)."""
        cfg = self.cfg
        b, t, _ = x.shape
        x2 = x.reshape(b * t, -1)
        _check_unfused(self.fused, s)
        lora = _read_pool(lora, kv)
        if self.fused:
            qkv = _fused_projection(self.qkv_proj, "qkv", _QKV, cfg, x2, layer, lora, s)
        else:
            qkv = {m: _apply_linear(getattr(self, m), x2, layer, s.kernels) for m in _QKV}
            qkv = apply_group(
                "qkv", lora.get("qkv"), x2, qkv, s.token_slots, s.kernels, s.seg_len, plan=s.lora_plan, layer=layer
            )
        # -1 heads: under tensor parallelism this shard holds num_heads / n of them.
        q = qkv["q_proj"].reshape(b, t, -1, cfg.head_dim)
        k = qkv["k_proj"].reshape(b, t, -1, cfg.head_dim)
        v = qkv["v_proj"].reshape(b, t, -1, cfg.head_dim)
        q = apply_rope(q, s.positions, s.inv_freq)
        k = apply_rope(k, s.positions, s.inv_freq)
        if is_unified(lora):
            # q's adapter term read the pool too, yet the KV write below does not depend on q: without
            # this barrier XLA cannot order that read before the in-place write, and copies the whole
            # pool every layer to keep it.
            q, k, v = jax.lax.optimization_barrier((q, k, v))
        if s.ragged is not None:
            kv = _write_pages(kv, layer, k[:, 0], v[:, 0], s.ragged)
            attn = _attend_ragged(q[:, 0], kv, layer, s.ragged, s.kernels).reshape(b, t, -1)
        else:
            kv, keys, values = _update_cache(kv, layer, k, v, s.positions, s.row_ids)
            attn = _attend(q, keys, values, s.positions)  # [b, t, H * Dh]
        a2 = attn.reshape(b * t, -1)
        if s.tensor_axis is None:
            out = {"o_proj": _apply_linear(self.o_proj, a2, layer, s.kernels)}
        else:  # row-parallel: the bias joins after the all-reduce, or every shard would add it
            out = {
                "o_proj": project(
                    self.o_proj,
                    a2,
                    layer=layer,
                    kernel=s.kernels.quant_kernel,
                    interpret=s.kernels.interpret,
                    w8a8=_w8a8(self.o_proj, a2, s.kernels),
                )
            }
        out = apply_group(
            "o",
            _read_pool(lora, kv).get("o"),
            a2,
            out,
            s.token_slots,
            s.kernels,
            s.seg_len,
            plan=s.lora_plan,
            layer=layer,
        )
        o = out["o_proj"]
        if s.tensor_axis is not None:
            # Base and LoRA partial sums share one all-reduce (A is split on the input side, B whole).
            o = tp.all_reduce(o, s.tensor_axis)
            if self.o_proj.bias is not None:
                o = o + self.o_proj.bias[...]
        return o.reshape(b, t, -1), kv


def _read_pool(lora: dict, kv: KVCache | PagedKVCache) -> dict:
    """A unified bank's groups reading `kv` as it stands here (adapters live in its pages); any other
    bank unchanged. The pool after this layer's KV write serves o and the MLP: their adapter pages
    are not the pages written."""
    if not is_unified(lora):
        return lora
    if not isinstance(kv, PagedKVCache):
        raise ValueError("a unified adapter bank lives in the paged KV pool: run the ragged (engine) step")
    return with_kv_pool(lora, kv.k, kv.v)


def _update_cache(kv: KVCache, layer: jax.Array, k, v, positions, row_ids):
    """Writes this step's k/v of one layer at their positions; returns the cache and this batch's
    keys and values of that layer ([b, T, KVH, Dh]).

    The whole cache rides in the layer scan's carry and only the new tokens are scattered into it,
    so a step moves the cache once (attention's read) instead of copying every layer in and out.
    """
    b = k.shape[0]
    rows = jnp.arange(b, dtype=jnp.int32) if row_ids is None else row_ids
    kv = _write_cache(kv, layer, k, v, positions, rows)
    if row_ids is None:
        return kv, kv.k[layer], kv.v[layer]
    return kv, kv.k[layer, rows], kv.v[layer, rows]


def _write_cache(kv: KVCache, layer: jax.Array, k, v, positions, rows) -> KVCache:
    """Scatters k/v [b, t, KVH, Dh] of one layer at (rows [b], positions [b, t]) into the cache."""
    # Out-of-range positions (padding past max_len) and rows (padding rows) are dropped.
    index = (layer, rows[:, None], positions)
    # unique_indices: each (row, position) is written once (see `_write_pages`).
    return KVCache(
        k=kv.k.at[index].set(k.astype(kv.k.dtype), mode="drop", unique_indices=True),
        v=kv.v.at[index].set(v.astype(kv.v.dtype), mode="drop", unique_indices=True),
    )


def _write_pages(kv: PagedKVCache, layer: jax.Array, k: jax.Array, v: jax.Array, batch: RaggedBatch) -> PagedKVCache:
    """Scatters this layer's k/v [T, KVH, Dh] to (write_page, write_offset); padding is dropped."""
    index = (layer, batch.write_page, batch.write_offset)
    # unique_indices: every token has its own (page, offset) (padding's are out of range, dropped), so
    # XLA writes plainly; otherwise it guards each element against a duplicate index with an atomic,
    # a compare-and-swap loop for 16-bit types (benchmarks/DECISIONS.md#kv-write-unique).
    return PagedKVCache(
        k=kv.k.at[index].set(k.astype(kv.k.dtype), mode="drop", unique_indices=True),
        v=kv.v.at[index].set(v.astype(kv.v.dtype), mode="drop", unique_indices=True),
    )


def _attend_ragged(q: jax.Array, kv: PagedKVCache, layer: jax.Array, batch: RaggedBatch, kernels) -> jax.Array:
    """q [T, H, Dh] over each token's own sequence in the page pool -> [T, H, Dh]."""
    args = (q, kv.k, kv.v, layer, batch.q_start, batch.q_len, batch.kv_len, batch.block_tables)
    if kernels.attention is AttentionBackend.PALLAS:
        return pallas_kernels.ragged_paged_attention(*args, interpret=kernels.interpret)
    return pallas_kernels.ragged_paged_attention_xla(*args)


def _attend(q: jax.Array, keys: jax.Array, values: jax.Array, positions: jax.Array) -> jax.Array:
    """Causal GQA over the cache. q [b, t, H, Dh], keys/values [b, T, KVH, Dh] -> [b, t, H*Dh]."""
    b, t, num_heads, head_dim = q.shape
    num_kv = keys.shape[2]
    qg = q.reshape(b, t, num_kv, num_heads // num_kv, head_dim)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, keys, preferred_element_type=jnp.float32)
    scores = scores * (head_dim**-0.5)
    key_pos = jnp.arange(keys.shape[1], dtype=jnp.int32)
    mask = key_pos[None, None, :] <= positions[:, :, None]  # [b, t, T]
    scores = jnp.where(mask[:, None, None], scores, _NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, values, preferred_element_type=jnp.float32)
    return out.astype(q.dtype).reshape(b, t, num_heads * head_dim)


class MLP(nnx.Module):
    """fused: gate|up as one projection `gate_up_proj` (the serving layout, jaxlora.model.fused)."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
        quantization: Quantization | None = None,
        fused: bool = False,
        kmajor: bool = False,
    ):
        self.cfg = cfg
        self.fused = fused
        if fused:
            width = 2 * cfg.intermediate_size
            self.gate_up_proj = _linear(cfg.hidden_size, width, False, dtype, rngs, quantization, kmajor)
        else:
            self.gate_proj = _linear(cfg.hidden_size, cfg.intermediate_size, False, dtype, rngs, quantization)
            self.up_proj = _linear(cfg.hidden_size, cfg.intermediate_size, False, dtype, rngs, quantization)
        self.down_proj = _linear(cfg.intermediate_size, cfg.hidden_size, False, dtype, rngs, quantization, kmajor)

    def __call__(self, x: jax.Array, layer: jax.Array, lora: dict, s: StepInputs) -> jax.Array:
        b, t, _ = x.shape
        x2 = x.reshape(b * t, -1)
        _check_unfused(self.fused, s)
        if self.fused:
            gu = _fused_projection(self.gate_up_proj, "gate_up", _GATE_UP, self.cfg, x2, layer, lora, s)
        else:
            gu = {m: _apply_linear(getattr(self, m), x2, layer, s.kernels) for m in _GATE_UP}
            gu = apply_group(
                "gate_up",
                lora.get("gate_up"),
                x2,
                gu,
                s.token_slots,
                s.kernels,
                s.seg_len,
                plan=s.lora_plan,
                layer=layer,
            )
        hidden = jax.nn.silu(gu["gate_proj"]) * gu["up_proj"]
        out = {"down_proj": _apply_linear(self.down_proj, hidden, layer, s.kernels)}
        out = apply_group(
            "down", lora.get("down"), hidden, out, s.token_slots, s.kernels, s.seg_len, plan=s.lora_plan, layer=layer
        )
        # Row-parallel under tensor parallelism: base and LoRA partial sums share one all-reduce.
        return tp.all_reduce(out["down_proj"], s.tensor_axis).reshape(b, t, -1)


class DecoderLayer(nnx.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        *,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
        quantization: Quantization | None = None,
        fused: bool = False,
        kmajor: bool = False,
    ):
        layout = dict(quantization=quantization, fused=fused, kmajor=kmajor)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=dtype)
        self.self_attn = Attention(cfg, dtype=dtype, rngs=rngs, **layout)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=dtype)
        self.mlp = MLP(cfg, dtype=dtype, rngs=rngs, **layout)

    def __call__(self, x, kv: KVCache, layer: jax.Array, lora: dict, s: StepInputs):
        attn, kv = self.self_attn(self.input_layernorm(x), kv, layer, lora, s)
        x = x + attn
        x = x + self.mlp(self.post_attention_layernorm(x), layer, _read_pool(lora, kv), s)
        return x, kv


class Llama(nnx.Module):
    """Decoder-only Llama. `__call__` returns final hidden states; `logits` applies the LM head.

    quantization: store the seven projections of every layer weight-only quantized
    (jaxlora.model.quant); embeddings, norms and the LM head stay in `dtype`.
    fused: q|k|v and gate|up as one projection each (the serving layout, jaxlora.model.fused).
    kmajor: the serving layout's quantized projections stored K-major (`qkernel_t`); None: the
      format's default (jaxlora.model.quant.serving_kmajor, which raises ValueError for True on a
      dense or separate-layout model).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
        quantization: Quantization | None = None,
        fused: bool = False,
        kmajor: bool | None = None,
    ):
        self.cfg = cfg
        self.fused = fused
        kmajor = serving_kmajor(quantization, fused, kmajor)
        self.embed_tokens = nnx.Embed(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype=dtype,
            param_dtype=dtype,
            embedding_init=nnx.initializers.normal(0.02),
            rngs=rngs,
        )

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(rngs: nnx.Rngs) -> DecoderLayer:
            return DecoderLayer(cfg, dtype=dtype, rngs=rngs, quantization=quantization, fused=fused, kmajor=kmajor)

        self.layers = make_layers(rngs)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=dtype)
        self.lm_head = None if cfg.tie_word_embeddings else _linear(cfg.hidden_size, cfg.vocab_size, False, dtype, rngs)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        kv: KVCache | PagedKVCache,
        *,
        bank: dict | None = None,
        slot_ids: jax.Array | None = None,
        row_ids: jax.Array | None = None,
        ragged: RaggedBatch | None = None,
        kernels: StepKernels = StepKernels(),
        tensor_axis: str | None = None,
    ) -> tuple[jax.Array, KVCache | PagedKVCache]:
        """Runs tokens [b, t] at positions [b, t] through every layer.

        Args:
          kv: a dense KVCache, whose rows `row_ids` [b] (or rows 0..b-1) are read and written; or,
            with `ragged`, the paged pool.
          bank: adapter bank (see jaxlora.lora.bank) or None for the base model alone.
          slot_ids: [b] int32 adapter slot per row (0 = base model); required with a bank.
          ragged: a flat batch: tokens and positions are [T, 1] (one token per "row", rows packed
            sequence after sequence), slot_ids [T] per token, and `ragged` says which sequence
            each token belongs to and where its key/value goes.
          tensor_axis: set only inside `shard_map` over a tensor-parallel mesh (jaxlora.parallel),
            where params, bank and cache are this device's shards.
        Returns:
          (hidden [b, t, D] after the final norm, updated cache)
        """
        b, t = tokens.shape
        if (ragged is None) != isinstance(kv, KVCache) or (ragged is not None and t != 1):
            raise ValueError("a RaggedBatch goes with a PagedKVCache and tokens [T, 1]; a KVCache without one")
        if bank is not None and slot_ids is None:
            raise ValueError("slot_ids are required when a bank is given")
        token_slots = jnp.zeros((b * t,), jnp.int32) if slot_ids is None else token_slots_for(slot_ids, t)
        seg_len = t if t > 1 else None
        # Which rows use which slot is the same in every layer: group them once, not per op.
        plan = step_plan(bank, token_slots, kernels, seg_len)
        bank = with_stacked_tables(bank) if bank else bank  # a unified bank's group tables, once a step
        s = StepInputs(
            positions=positions.astype(jnp.int32),
            row_ids=row_ids,
            token_slots=token_slots,
            seg_len=seg_len,
            kernels=kernels,
            inv_freq=jnp.asarray(inverse_frequencies(self.cfg)),
            lora_plan=plan,
            tensor_axis=tensor_axis,
            ragged=ragged,
        )
        if tensor_axis is None:
            x = self.embed_tokens(tokens)
        else:
            x = tp.embed(
                self.embed_tokens.embedding[...], tokens, vocab_size=self.cfg.vocab_size, axis=tensor_axis
            ).astype(self.embed_tokens.dtype)
        # The bank is not sliced per layer: each LoRA op gets the whole stack and the layer index, and
        # the kernels read that layer in place (a slice before a kernel call copies every slot). With
        # the quantized-GEMM kernel the quantized projections' weights stay whole the same way; every
        # other parameter is sliced (unrolled) or scanned over.
        in_place = _IN_PLACE_WEIGHTS if kernels.uses_quant_kernel(b * t) else nnx.Nothing
        graphdef, whole, layer_state = nnx.split(self.layers, in_place, ...)

        def body(carry, xs):
            h, kv = carry
            state, layer = xs
            h, kv = nnx.merge(graphdef, whole, state)(h, kv, layer, bank or {}, s)
            return (h, kv), None

        if kernels.unrolls(b, t):
            # Weight-bound steps only: XLA copies a scanned layer's weights out of the stack before
            # each GEMM, which costs a weight-bound step more than the unrolled loop's compile
            # (benchmarks/DECISIONS.md#unroll-layers); compute-bound steps keep the scan's short compile.
            # One jitted layer called num_layers times: JAX traces and lowers it once (its lowering
            # is cached per module) and XLA inlines the calls, so the program is the unrolled one but
            # a start-up with a warm compilation cache, which still traces and lowers every step, no
            # longer pays for every layer (benchmarks/DECISIONS.md#layer-call).
            layer_call = jax.jit(body)
            carry = (x, kv)
            for i in range(self.cfg.num_layers):
                carry, _ = layer_call(carry, (jax.tree.map(lambda a: a[i], layer_state), jnp.int32(i)))
            x, kv = carry
        else:
            layers = jnp.arange(self.cfg.num_layers, dtype=jnp.int32)
            (x, kv), _ = jax.lax.scan(body, (x, kv), (layer_state, layers))
        return self.norm(x), kv

    def logits(self, hidden: jax.Array, *, tensor_axis: str | None = None) -> jax.Array:
        """hidden [..., D] -> float32 logits [..., vocab] (on every device under tensor parallelism)."""
        if tensor_axis is not None:
            tied = self.lm_head is None
            weight = self.embed_tokens.embedding[...] if tied else self.lm_head.kernel[...]
            return tp.project_logits(
                hidden, weight, vocab_size=self.cfg.vocab_size, transposed=tied, axis=tensor_axis
            ).astype(jnp.float32)
        if self.lm_head is None:
            return self.embed_tokens.attend(hidden).astype(jnp.float32)
        return self.lm_head(hidden).astype(jnp.float32)
