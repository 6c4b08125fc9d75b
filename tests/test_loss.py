"""The chunked cross-entropy: the whole-logits loss and gradients, without the whole logits."""

import dataclasses
import secrets

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from coat_jax.models.llama import Llama, LlamaConfig, loss_fn
from coat_jax.ops import plain
from coat_jax.ops.loss import chunked_cross_entropy


def fresh_key():
    return jax.random.key(secrets.randbits(31))


def whole_logits_loss(x, head, targets, weights):
    losses = optax.softmax_cross_entropy_with_integer_labels(x @ head, targets)
    if weights is None:
        return losses.mean()
    return (losses * weights).sum() / jnp.maximum(weights.sum(), 1.0)


# 37: T padded with weight-0 positions; 200 > T: one chunk
@pytest.mark.parametrize("chunk,masked", [(1, False), (16, False), (37, True), (200, True)])
def test_chunked_equals_the_whole_logits_loss_and_gradients(chunk, masked):
    """fp32: the loss within 1e-6 and both gradients within 1e-5 (relative), any chunk size."""
    kx, kh, kt, km = jax.random.split(fresh_key(), 4)
    x = jax.random.normal(kx, (3, 100, 32))
    head = jax.random.normal(kh, (32, 300)) * 0.3
    targets = jax.random.randint(kt, (3, 100), 0, 300)
    weights = jax.random.bernoulli(km, 0.6, (3, 100)).astype(jnp.float32) if masked else None

    def chunked(x, head):
        return chunked_cross_entropy(lambda xc: xc @ head, x, targets, weights, chunk)

    got, got_grads = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1)))(x, head)
    whole = jax.jit(jax.value_and_grad(whole_logits_loss, argnums=(0, 1)))
    want, want_grads = whole(x, head, targets, weights)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert float(jnp.linalg.norm(g - w) / jnp.linalg.norm(w)) < 1e-5


def model_and_tokens(precision, vocab=512, seq=48):
    cfg = LlamaConfig(vocab_size=vocab, dim=64, n_layers=2, n_heads=4, ffn_dim=176,
                      precision=precision)  # fmt: skip
    graph, params = nnx.split(Llama(cfg, rngs=nnx.Rngs(0)))
    tokens = jax.random.randint(fresh_key(), (4, seq + 1), 0, vocab)
    return cfg, graph, params, tokens


# fp32: 3.1e-5 on an H200 (2026-12-04; XLA:GPU orders the chunked sums apart), 1e-6 on the CPU
FP32_TOL = 1e-5 if jax.default_backend() == "cpu" else 1e-4


@pytest.mark.parametrize("precision,grad_tol", [("fp32", FP32_TOL), ("coat", 1e-2)])
def test_model_loss_is_the_same_with_chunks(precision, grad_tol):
    """``LlamaConfig.loss_chunk``: the same loss (1e-6) and gradients; with BF16 compute the
    head's gradient is rounded to BF16 per chunk instead of once (about 2^-9 relative)."""
    cfg, graph, params, tokens = model_and_tokens(precision)
    mask = jax.random.bernoulli(fresh_key(), 0.7, (4, 48))

    def loss(params, chunk):
        model = nnx.merge(graph, params)
        model.config = dataclasses.replace(cfg, loss_chunk=chunk)
        return loss_fn(model, tokens, mask)

    grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    want, want_grads = grad(params, 0)
    got, got_grads = grad(params, 20)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        assert float(jnp.linalg.norm(g - w) / jnp.linalg.norm(w)) < grad_tol


def test_chunks_keep_the_whole_logits_out_of_the_compiled_step():
    """The compiled loss-and-gradient's temporary bytes fall by more than 1.5x the whole fp32
    logits (whole: the logits and their gradient live at once)."""
    batch, seq, vocab = 8, 128, 8192

    def temp_bytes(chunk):
        cfg = LlamaConfig(vocab_size=vocab, dim=64, n_layers=1, n_heads=4, ffn_dim=176,
                          loss_chunk=chunk)  # fmt: skip
        graph, params = nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))))
        step = jax.jit(jax.value_and_grad(lambda p, t: loss_fn(nnx.merge(graph, p), t)))
        tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)
        return step.lower(params, tokens).compile().memory_analysis().temp_size_in_bytes

    logits = batch * seq * vocab * 4
    assert temp_bytes(0) - temp_bytes(16) > 1.5 * logits


def test_head_logits_rounds_the_loss_gradient_to_the_operands_dtype():
    """BF16 operands: fp32 logits within fp32 summation error of the fp64 product; backward
    ``dx = rd(dz) W^T`` and ``dW = x^T rd(dz)`` (``rd``: BF16 rounding of the fp32 ``dz``)
    within one BF16 rounding of the fp64 math plus fp32 summation error, both in BF16."""
    kx, kw, kz = jax.random.split(fresh_key(), 3)
    x = jax.random.normal(kx, (3, 50, 64), jnp.bfloat16)
    head = (jax.random.normal(kw, (64, 300)) * 0.1).astype(jnp.bfloat16)
    dz = jax.random.normal(kz, (3, 50, 300), jnp.float32) * 1e-3
    z, vjp = jax.vjp(plain.head_logits, x, head)
    dx, dhead = vjp(dz)
    assert z.dtype == jnp.float32 and dx.dtype == dhead.dtype == jnp.bfloat16
    f64 = lambda a: np.asarray(a.astype(jnp.float32), np.float64)
    x64, w64, dz64 = f64(x), f64(head), f64(dz.astype(jnp.bfloat16))
    sums = 64 * 2.0**-24  # fp32 accumulation of 64 exact BF16 products
    np.testing.assert_array_less(np.abs(f64(z) - x64 @ w64), sums * (np.abs(x64) @ np.abs(w64)))
    x_dz = lambda a, b: np.einsum("bth,btv->hv", a, b)
    for got, want, size, terms in [
        (dx, dz64 @ w64.T, 300, np.abs(dz64) @ np.abs(w64.T)),
        (dhead, x_dz(x64, dz64), 150, x_dz(np.abs(x64), np.abs(dz64))),
    ]:
        bound = 2.0**-8 * np.abs(want) + size * 2.0**-24 * terms
        np.testing.assert_array_less(np.abs(f64(got) - want), bound + 1e-30)


def test_head_logits_with_fp32_operands_is_the_plain_dot():
    kx, kw, kz = jax.random.split(fresh_key(), 3)
    x, head = jax.random.normal(kx, (2, 7, 16)), jax.random.normal(kw, (16, 40))
    dz = jax.random.normal(kz, (2, 7, 40))
    plain_dot = lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32)
    for got, want in zip(jax.vjp(plain.head_logits, x, head)[1](dz),
                         jax.vjp(plain_dot, x, head)[1](dz), strict=True):  # fmt: skip
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("chunk", [0, 16])
@pytest.mark.parametrize("precision", ["bf16", "coat"])
def test_the_lm_head_backward_gemms_take_bf16_operands(precision, chunk):
    """JAX's transpose of a BF16 x BF16 -> fp32 dot multiplies the fp32 loss gradient with a
    BF16 operand, lowered as an fp32 GEMM (on an H100 3-4x slower than BF16 at the LM head's
    shapes); every GEMM of the loss's gradient that reads the vocabulary axis takes BF16."""
    vocab = 509  # no other axis of this model has that size
    cfg, graph, params, tokens = model_and_tokens(precision, vocab=vocab)
    cfg = dataclasses.replace(cfg, loss_chunk=chunk)

    def loss(params):
        model = nnx.merge(graph, params)
        model.config = cfg
        return loss_fn(model, tokens)

    hlo = jax.jit(jax.grad(loss)).lower(params).as_text()
    dots = [line for line in hlo.splitlines() if "stablehlo.dot_general" in line]
    vocab_dots = [d for d in dots if f"x{vocab}x" in d.split(":")[-1] or f"<{vocab}x" in d]
    assert len(vocab_dots) >= 3, vocab_dots  # forward, dx, dW
    for d in vocab_dots:
        operands = d.split(":")[-1].split("->")[0]
        assert "f32>" not in operands, d


@pytest.mark.parametrize("chunk", [0, -4, 2.5, True])
def test_bad_chunk(chunk):
    x, targets = jnp.zeros((1, 4, 8)), jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="chunk must be a positive int"):
        chunked_cross_entropy(lambda xc: xc, x, targets, None, chunk)
    if chunk != 0:
        with pytest.raises(ValueError, match="loss_chunk"):
            LlamaConfig(loss_chunk=chunk)


def test_bad_shapes():
    with pytest.raises(ValueError, match=r"x \(B, T, h\) and targets \(B, T\)"):
        chunked_cross_entropy(lambda xc: xc, jnp.zeros((1, 4, 8)), jnp.zeros((1, 5), jnp.int32),
                              None, 2)  # fmt: skip
