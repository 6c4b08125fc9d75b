"""GPU-only checks (marker `gpu`, skipped without a Hopper GPU)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coat_jax.core.quant import dequantize, quantize
from coat_jax.models import nn
from coat_jax.models.policy import get_policy
from coat_jax.ops import flow

pytestmark = pytest.mark.gpu


def block_hlo(policy, hidden=1024, ffn=2816, seq=512, batch=2):
    block = nn.Block(hidden, 4, 2, ffn, policy=get_policy(policy), rngs=nnx.Rngs(0))
    graph, params = nnx.split(block)
    x = jax.random.normal(jax.random.key(0), (batch, seq, hidden), jnp.bfloat16)
    pos = jnp.broadcast_to(jnp.arange(seq), (batch, seq))

    def loss(x, p):
        return jnp.sum(nnx.merge(graph, p)(x, pos).astype(jnp.float32) ** 2)

    return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, params).compile().as_text()


def gemm_counts(hlo):
    """``(fp8, other)`` GEMMs in compiled HLO: cuBLAS custom calls and ``dot`` instructions
    (those inside Triton GEMM fusions included), told apart by their operand types."""
    f8 = other = 0
    for line in hlo.splitlines():
        if 'custom_call_target="__cublas' in line:
            f8 += "$f8" in line
            other += "$f8" not in line
        elif re.search(r"\bdot\(", line):
            operands = line.split("dot(", 1)[1]
            f8 += "f8e" in operands
            other += "f8e" not in operands
    return f8, other


@pytest.mark.parametrize("policy", ["fp8_linear", "coat"])
def test_every_projection_is_an_fp8_gemm_forward_and_backward(policy):
    # 7 projections (q, k, v, o, gate, up, down) x (forward, dx, dW); XLA may merge GEMMs that
    # share an operand, so: at least 14 FP8 GEMMs, and no GEMM of any other kind left.
    f8, other = gemm_counts(block_hlo(policy))
    assert f8 >= 14 and other == 0, (f8, other)


def test_bf16_weight_gradients_stay_fp8_gemms():
    """With BF16 weights (``grad_dtype=bfloat16``) the weight-gradient GEMMs emit BF16 from the
    GEMM itself (``partials_in_out_dtype``): still cuBLASLt FP8 GEMMs, none of another kind."""
    block = nn.Block(1024, 4, 2, 2816, policy=get_policy("coat"), rngs=nnx.Rngs(0))
    graph, params = nnx.split(block)
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    x = jax.random.normal(jax.random.key(0), (2, 512, 1024), jnp.bfloat16)
    pos = jnp.broadcast_to(jnp.arange(512), (2, 512))

    def loss(x, p):
        return jnp.sum(nnx.merge(graph, p)(x, pos).astype(jnp.float32) ** 2)

    f8, other = gemm_counts(jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, params).compile()
                            .as_text())  # fmt: skip
    assert f8 >= 14 and other == 0, (f8, other)


@pytest.mark.parametrize("shape", [(8192, 4096, 4096), (4096, 1000, 208)])
def test_fp8_gemm_with_bf16_partials_matches_fp32_product(shape):
    """``partials_in_out_dtype``: the BF16 result is the fp32 one within BF16 rounding."""
    m, k, n = shape
    k1, k2 = jax.random.split(jax.random.key(np.random.default_rng().integers(1 << 30)))
    a = quantize(jax.random.normal(k1, (k, m)), "e4m3")
    b = quantize(jax.random.normal(k2, (k, n)), "e5m2")
    fn = lambda a, b, p: flow.fp8_gemm(a, b, (0, 0), jnp.bfloat16, partials_in_out_dtype=p)
    got = jax.jit(lambda a, b: fn(a, b, True))(a, b).astype(jnp.float32)
    want = jax.jit(lambda a, b: flow.fp8_gemm(a, b, (0, 0)))(a, b)
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 8e-3


def test_bf16_policy_has_no_fp8_gemm():
    f8, other = gemm_counts(block_hlo("bf16"))
    assert f8 == 0 and other >= 14, (f8, other)


@pytest.mark.parametrize("shape", [(8192, 4096, 4096), (512, 11008, 4096), (1000, 208, 176)])
def test_fp8_gemm_matches_fp32_dot_of_dequantized_operands(shape):
    m, k, n = shape
    k1, k2 = jax.random.split(jax.random.key(np.random.default_rng().integers(1 << 30)))
    a = quantize(jax.random.normal(k1, (m, k)), "e4m3")
    b = quantize(jax.random.normal(k2, (k, n)), "e5m2")
    got = jax.jit(lambda a, b: flow.fp8_gemm(a, b, (-1, 0)))(a, b)
    want = jnp.dot(dequantize(a), dequantize(b), precision="highest")
    # Hopper's FP8 tensor cores accumulate with ~14 significant bits (the reason DeepSeek-V3
    # promotes partial sums to fp32 every 128 of K): ~2e-3 relative at K = 4096, not fp32's 1e-6.
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 5e-3


@pytest.mark.parametrize(("fmt", "group_size", "expand"),
                         [("e4m3", None, False), ("e5m2", None, False), ("e4m3", 16, False),
                          ("e4m3", 16, True)])  # fmt: skip
def test_jitted_quantize_keeps_non_finite_elements(fmt, group_size, expand):
    """XLA's GPU clip turns NaN into a bound: the encode marks non-finite elements after it,
    so they decode to NaN, and every finite element decodes as if they were zeros (left out of
    its group's or tensor's maximum)."""
    x = jax.random.normal(jax.random.key(np.random.default_rng().integers(1 << 30)), (64, 256))
    x = 3.0 * x
    bad = (np.array([3, 10, 40, 63]), np.array([5, 17, 200, 255]))
    broken = x.at[bad].set(jnp.array([jnp.nan, jnp.inf, -jnp.inf, jnp.nan]))

    @jax.jit
    def roundtrip(v):
        return dequantize(quantize(v, fmt, group_size=group_size, expand=expand))

    got = np.asarray(roundtrip(broken))
    want = np.asarray(roundtrip(x.at[bad].set(0.0)))
    assert np.isnan(got[bad]).all()
    finite = np.ones(x.shape, bool)
    finite[bad] = False
    np.testing.assert_array_equal(got[finite], want[finite])
