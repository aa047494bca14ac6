"""Quantization error where it matters: mean token negative log-likelihood of SmolLM2-135M (the
default model) on plain English, int8 within 1% of the dense model and FP8 within 2% (weights only),
and with the activations quantized per token too (W8A8, jaxlora.model.w8a8): int8 within 1%, FP8
within 0.75% (measured +0.6% in float32 activations: e4m3 activations cost about as much again as
e4m3 weights on this 135M model).

The text (tests/data/english_text.txt, an essay written for these tests) has 4,105 tokens; the test
scores the first 4,096 as 8 rows of 512. Why not ~20k tokens: a pass costs ~7 CPU-ms per token on
the 2-core machine (dense, int8 and FP8 are three passes), so 20k tokens would cost ~420 CPU-s of
passes alone, 3.5 min or more of wall time; this module measured 94-140 CPU-s in all (pytest start,
model load, three compiles, three passes of 4,096 tokens; more on a busier machine), 60-80 s of wall
time on two idle cores (the passes use both, compiles and loading one). The relative NLL changes it measures: int8 +0.02%,
FP8 +0.3%.

The dense reference and the quantized models run in float32 activations: the figure isolates the
weight format, not bf16 arithmetic. One more test runs both in bfloat16, the serving dtype, which is
how issue 40 states its bound: FP8 W8A8 within 0.5% of the bf16 model (measured +0.45%, in a child
process compiled with XLA's defaults; in float32 activations the same weights measure +0.6-0.65%,
within the 0.75% above).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxlora.kernels import StepKernels
from jaxlora.loading import load_model
from jaxlora.model import init_kv_cache
from jaxlora.model.params import quantized_model

TEXT = Path(__file__).resolve().parents[1] / "data" / "english_text.txt"
ROWS, ROW_LEN = 8, 512
ROWS_PER_CALL = 2  # bounds the float32 logits in memory: 2 x 512 x 49,152 x 4 bytes = 200 MB
MAX_RELATIVE_INCREASE = {"int8": 0.01, "fp8": 0.02}
MAX_RELATIVE_INCREASE_W8A8 = {"int8": 0.01, "fp8": 0.0075}
MAX_RELATIVE_INCREASE_W8A8_BF16 = 0.005  # FP8 W8A8 against the bf16 model, both in bf16
# Every step of either 8-bit format W8A8 (the step here is 2 x 512 tokens).
W8A8 = StepKernels(w8a8_min_tokens=(("float8_e4m3fn", 1), ("int8", 1)))


@functools.partial(jax.jit, static_argnames=("graphdef", "kernels"))
def _nll_sum(graphdef: nnx.GraphDef, params: nnx.State, tokens: jax.Array, kernels: StepKernels) -> jax.Array:
    """Summed NLL of tokens[:, 1:] given their prefixes; tokens [rows, t] int32 -> float32 scalar."""
    model = nnx.merge(graphdef, params)
    rows, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (rows, t))
    hidden, _ = model(tokens, positions, init_kv_cache(model.cfg, rows, t), kernels=kernels)
    log_probs = jax.nn.log_softmax(model.logits(hidden[:, :-1]), axis=-1)
    return -jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1).sum()


def mean_nll(model, tokens: np.ndarray, kernels: StepKernels = StepKernels()) -> float:
    """Mean NLL per predicted token of tokens [ROWS, ROW_LEN] (each row scored on its own)."""
    total = sum(
        float(_nll_sum(model.graphdef, model.params, jnp.asarray(tokens[i : i + ROWS_PER_CALL]), kernels))
        for i in range(0, len(tokens), ROWS_PER_CALL)
    )
    return total / (tokens.shape[0] * (tokens.shape[1] - 1))


@pytest.fixture(scope="module")
def scored(smollm2_gguf_path):
    """(tokens [ROWS, ROW_LEN], the dense model, its mean NLL)."""
    model, tok = load_model(smollm2_gguf_path)
    ids = tok.encode(TEXT.read_text())
    if len(ids) < ROWS * ROW_LEN:
        raise AssertionError(f"{TEXT} has {len(ids)} tokens, fewer than the {ROWS * ROW_LEN} the test scores")
    tokens = np.asarray(ids[: ROWS * ROW_LEN], np.int32).reshape(ROWS, ROW_LEN)
    return tokens, model, mean_nll(model, tokens)


def test_dense_nll_is_that_of_a_working_model(scored):
    # A working 135M model on plain English scores ~3.3 nats per token; uniform guessing over the
    # 49,152-token vocabulary would score ln(49152) = 10.8.
    _, _, dense = scored
    assert 2.0 < dense < 4.5


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_quantized_nll_within_bound_of_dense(scored, quantization):
    tokens, dense_model, dense = scored
    nll = mean_nll(quantized_model(dense_model, quantization), tokens)
    increase = (nll - dense) / dense
    print(f"{quantization}: mean NLL {nll:.5f} vs dense {dense:.5f} ({increase:+.3%})")
    assert abs(increase) <= MAX_RELATIVE_INCREASE[quantization], (nll, dense)


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_w8a8_nll_within_bound_of_dense(scored, quantization):
    tokens, dense_model, dense = scored
    quantized = quantized_model(dense_model, quantization)
    nll = mean_nll(quantized, tokens, W8A8)
    increase = (nll - dense) / dense
    print(f"{quantization} W8A8: mean NLL {nll:.5f} vs dense {dense:.5f} ({increase:+.3%})")
    assert abs(increase) <= MAX_RELATIVE_INCREASE_W8A8[quantization], (nll, dense)


def bf16_w8a8_increase(gguf_path: str) -> tuple[float, float]:
    """(mean NLL of the bf16 model, of its FP8 W8A8 quantization), both with bf16 activations."""
    model, tok = load_model(gguf_path, dtype=jnp.bfloat16)
    tokens = np.asarray(tok.encode(TEXT.read_text())[: ROWS * ROW_LEN], np.int32).reshape(ROWS, ROW_LEN)
    return mean_nll(model, tokens), mean_nll(quantized_model(model, "fp8"), tokens, W8A8)


def test_fp8_w8a8_in_bf16_within_half_a_percent_of_the_bf16_model(smollm2_gguf_path):
    """The serving dtype, as XLA compiles it for users: bf16 rounds between unfused ops, so the suite's
    XLA_FLAGS (backend optimizations off, tests/conftest.py) would add roundings no user's program
    has (+0.61% there against +0.45% compiled as served). A child process with XLA's defaults."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace("--xla_backend_optimization_level=0", "").strip()
    code = (
        "import json, sys; from tests.model.test_quant_nll import bf16_w8a8_increase; "
        "print(json.dumps(bf16_w8a8_increase(sys.argv[1])))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(smollm2_gguf_path)],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    dense, nll = json.loads(proc.stdout.strip().splitlines()[-1])
    increase = (nll - dense) / dense
    print(f"fp8 W8A8 in bf16: mean NLL {nll:.5f} vs bf16 {dense:.5f} ({increase:+.3%})")
    assert 2.0 < dense < 4.5 and abs(increase) <= MAX_RELATIVE_INCREASE_W8A8_BF16, (nll, dense)
