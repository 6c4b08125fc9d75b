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
