"""``LlamaConfig.recompute_attention``: backward recomputes the attention branch's pre-norm,
q/k/v projections, RoPE and attention from the block input, so it saves fewer activations and
the gradients do not change."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny import ROOT, assert_trains_identically

from coat_jax.models import nn
from coat_jax.models.policy import get_policy
from coat_jax.training import configs, residuals

B, T, DIM, HEADS, KV_HEADS, FFN = 2, 64, 128, 4, 2, 352


def _block(policy: str, recompute: bool, seed: int):
    """A block's graph and parameters, an input, its positions, and the block's loss."""
    block = nn.Block(DIM, HEADS, KV_HEADS, FFN, policy=get_policy(policy),
                     recompute_attention=recompute, rngs=nnx.Rngs(seed))  # fmt: skip
    graph, params = nnx.split(block)
    dtype = jnp.float32 if policy == "fp32" else jnp.bfloat16
    x = jax.random.normal(jax.random.key(seed + 1), (B, T, DIM), dtype)
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))

    def loss(x, params):
        out = nnx.merge(graph, params)(x, positions).astype(jnp.float32)
        return jnp.sum(out * jnp.cos(out))  # a cotangent that is not all ones

    return x, params, loss


def _saved_activation_bytes(loss, x, params) -> int:
    """Bytes of the residuals of ``loss``'s VJP shaped ``(B, T, ...)``: the activations saved."""
    return residuals.saved_activation_bytes_abstract(loss, x, params, batch_dims=(B, T))


@pytest.mark.parametrize("policy", ["coat", "fp8_linear", "bf16", "fp32"])
def test_recomputed_attention_gives_the_same_gradients_and_saves_less(policy):
    seed = int(np.random.default_rng().integers(1000))
    grads, saved = [], []
    for recompute in (False, True):
        x, params, loss = _block(policy, recompute, seed)
        grads.append(jax.jit(jax.grad(loss, argnums=(0, 1)))(x, params))
        saved.append(_saved_activation_bytes(loss, x, params))
    for a, b in zip(*map(jax.tree.leaves, grads), strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if jax.default_backend() == "cpu":
            np.testing.assert_array_equal(a, b)
        else:  # XLA:GPU fuses the two programs apart: fp32 grads 1e-4 apart on an H200
            np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3 * np.abs(b).max())
    assert saved[1] < saved[0], saved


@pytest.mark.xla_cpu  # the CPU's attention residuals (cuDNN's differ, see below)
def test_coat_saves_the_block_input_instead_of_q_k_v_and_the_norms_copy():
    """Per token, COAT saves ``q, k, v`` in BF16 and the pre-norm's input as FP8 1x16 groups
    with an fp32 scale each; recomputing saves the BF16 block input instead (the CPU's
    attention saves only q, k, v; cuDNN's also its output and softmax statistics)."""
    x, params, loss = _block("coat", False, 0)
    x, params_rc, loss_rc = _block("coat", True, 0)
    kv = DIM // HEADS * KV_HEADS
    qkv = (DIM + 2 * kv) * 2
    norm_copy = DIM + DIM // 16 * 4
    drop = _saved_activation_bytes(loss, x, params) - _saved_activation_bytes(loss_rc, x, params_rc)
    assert drop == B * T * (qkv + norm_copy - DIM * 2)


@pytest.mark.slow
def test_the_trainer_steps_bit_identically_with_recomputed_attention():
    """llama_tiny, COAT, 3 steps: losses and weights equal the default's bit for bit, with fp32
    master weights and with every memory option (the update in the backward pass, BF16 + 8-bit
    master weights, requantized weights)."""
    memory = {"optimizer.update_in_backward": True, "optimizer.master_weights": "bf16+8",
              "fp8.saved_weights": "requantize"}  # fmt: skip
    for options in ({}, memory):
        assert_trains_identically(options, "model.recompute_attention", (False, True))


def test_a_run_resumes_with_the_attention_recomputed():
    """The option changes no saved state: a checkpoint from before it (no key) resumes with
    nothing reported, and switching it on is reported as a change, not refused; a model shape
    key still is."""
    config = configs.load_file(str(ROOT / "configs" / "llama_tiny.py"), {})
    saved = config.to_dict()
    del saved["model"]["recompute_attention"]
    assert configs.resume_changes(saved, config) == ([], [])
    config.model.recompute_attention = True
    assert configs.resume_changes(saved, config) == (
        [], ["model.recompute_attention: False -> True"])  # fmt: skip
    config.model.n_layers += 1
    refused, _ = configs.resume_changes(saved, config)
    assert [line.split(":")[0] for line in refused] == ["model.n_layers"]
