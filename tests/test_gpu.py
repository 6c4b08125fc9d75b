"""GPU-only checks (marker `gpu`, skipped without a Hopper GPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coat_jax import flow, nn
from coat_jax.policy import get_policy
from coat_jax.quant import dequantize, quantize

pytestmark = pytest.mark.gpu
F8_GEMM = 'custom_call_target="__cublas$lt$matmul$f8"'


def block_hlo(policy, hidden=256, ffn=512, seq=128, batch=2):
    block = nn.Block(hidden, 4, 2, ffn, policy=get_policy(policy), rngs=nnx.Rngs(0))
    graph, params = nnx.split(block)
    x = jax.random.normal(jax.random.key(0), (batch, seq, hidden), jnp.bfloat16)
    pos = jnp.broadcast_to(jnp.arange(seq), (batch, seq))

    def loss(x, p):
        return jnp.sum(nnx.merge(graph, p)(x, pos).astype(jnp.float32) ** 2)

    return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, params).compile().as_text()


@pytest.mark.parametrize("policy", ["fp8_linear", "coat"])
def test_every_projection_is_an_fp8_gemm_forward_and_backward(policy):
    # 7 projections per block (q, k, v, o, gate, up, down): 7 forward, 7 dx and 7 dW GEMMs.
    assert block_hlo(policy).count(F8_GEMM) == 21


def test_bf16_policy_has_no_fp8_gemm():
    assert block_hlo("bf16").count(F8_GEMM) == 0


@pytest.mark.parametrize("shape", [(8192, 4096, 4096), (512, 11008, 4096), (1000, 208, 176)])
def test_fp8_gemm_matches_fp32_dot_of_dequantized_operands(shape):
    m, k, n = shape
    k1, k2 = jax.random.split(jax.random.key(np.random.default_rng().integers(1 << 30)))
    a = quantize(jax.random.normal(k1, (m, k)), "e4m3")
    b = quantize(jax.random.normal(k2, (k, n)), "e5m2")
    got = jax.jit(lambda a, b: flow.fp8_gemm(a, b, (-1, 0)))(a, b)
    want = jnp.dot(dequantize(a), dequantize(b), precision="highest")
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 1e-3
