"""Llama.decode with a KV cache: the logits of prefill + one-token steps equal the full
forward's, also for left-padded rows (the bf16 policy, fp32 compute: equal to rounding)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coat_jax.models.llama import PRESETS, Llama, init_cache

TOL = 2e-5  # fp32 compute: the cached path sums the same products in another order


def tiny(seed):
    config = dataclasses.replace(PRESETS["tiny"], precision="bf16")
    return config, Llama(config, rngs=nnx.Rngs(seed))


@pytest.mark.parametrize("prefill", [1, 6, 10])
def test_prefill_then_steps_equal_the_full_forward(prefill):
    seed = int(np.random.default_rng().integers(1 << 30))
    config, model = tiny(seed)
    tokens = jax.random.randint(jax.random.key(seed), (2, 10), 0, config.vocab_size)
    full = model(tokens, compute_dtype=jnp.float32)
    cache = init_cache(config, 2, 12, jnp.float32)
    logits, cache = model.decode(tokens[:, :prefill], cache, compute_dtype=jnp.float32)
    steps = [logits]
    for t in range(prefill, 10):
        logits, cache = model.decode(tokens[:, t : t + 1], cache, compute_dtype=jnp.float32)
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, 1), full, atol=TOL, rtol=0)
    assert int(cache.length) == 10


def test_left_padded_rows_see_only_their_own_tokens():
    seed = int(np.random.default_rng().integers(1 << 30))
    config, model = tiny(seed)
    tokens = jax.random.randint(jax.random.key(seed), (2, 9), 0, config.vocab_size)
    pad = 4  # row 1 is its last 5 tokens, left-padded with garbage ids
    garbage = jax.random.randint(jax.random.key(seed + 1), (1, pad), 0, config.vocab_size)
    batch = jnp.concatenate([tokens[:1], jnp.concatenate([garbage, tokens[1:, pad:]], 1)], 0)
    cache = init_cache(config, 2, 11, jnp.float32, start=[0, pad])
    logits, cache = model.decode(batch, cache, compute_dtype=jnp.float32)
    step, cache = model.decode(jnp.array([[3], [7]]), cache, compute_dtype=jnp.float32)
    want0 = model(jnp.concatenate([tokens[:1], jnp.array([[3]])], 1), compute_dtype=jnp.float32)
    want1 = model(
        jnp.concatenate([tokens[1:, pad:], jnp.array([[7]])], 1), compute_dtype=jnp.float32
    )
    np.testing.assert_allclose(logits[0], want0[0, :-1], atol=TOL, rtol=0)
    np.testing.assert_allclose(logits[1, pad:], want1[0, :-1], atol=TOL, rtol=0)
    np.testing.assert_allclose(step[:, 0], jnp.stack([want0[0, -1], want1[0, -1]]), atol=TOL)


def test_decode_refuses_float_tokens():
    config, model = tiny(0)
    with pytest.raises(ValueError, match="Llama.decode expects int tokens"):
        model.decode(jnp.zeros((1, 2)), init_cache(config, 1, 4))
