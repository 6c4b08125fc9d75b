"""A tiny byte-level causal transformer LM in plain JAX, for optimizer studies on a CPU.

Used by ``coat_jax.tools.quant_error`` (to collect real Adam moments) and by the optimizer's
convergence tests. The corpus is the source text of a fixed list of Python standard-library
modules, so it exists on every machine with no download.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import textwrap
import typing

import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = ["TinyLMConfig", "corpus_bytes", "init_params", "loss_fn", "train"]

_CORPUS_MODULES = (json.decoder, json.encoder, textwrap, typing, inspect, dataclasses)


@dataclasses.dataclass(frozen=True)
class TinyLMConfig:
    """Sizes of the tiny transformer (pre-norm, learned positions, GELU MLP)."""

    vocab: int = 256
    dim: int = 64
    heads: int = 4
    layers: int = 2
    seq_len: int = 64
    batch: int = 16


def corpus_bytes() -> np.ndarray:
    """The concatenated source of a fixed list of standard-library modules, as uint8."""
    text = "\n".join(inspect.getsource(m) for m in _CORPUS_MODULES)
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def init_params(config: TinyLMConfig, key: jax.Array) -> dict:
    d, keys = config.dim, iter(jax.random.split(key, 4 + 4 * config.layers))

    def dense(fan_in, fan_out):
        return jax.random.normal(next(keys), (fan_in, fan_out)) / np.sqrt(fan_in)

    params = {
        "embed": jax.random.normal(next(keys), (config.vocab, d)) * 0.02,
        "pos": jax.random.normal(next(keys), (config.seq_len, d)) * 0.02,
        "final_norm": jnp.ones(d),
        "layers": [],
    }
    for _ in range(config.layers):
        params["layers"].append(
            {
                "attn_norm": jnp.ones(d),
                "wqkv": dense(d, 3 * d),
                "wo": dense(d, d),
                "mlp_norm": jnp.ones(d),
                "w1": dense(d, 4 * d),
                "w2": dense(4 * d, d),
            }
        )
    return params


def _norm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def _forward(config: TinyLMConfig, params: dict, tokens: jax.Array) -> jax.Array:
    b, t = tokens.shape
    h = params["embed"][tokens] + params["pos"][:t]
    mask = jnp.tril(jnp.ones((t, t), bool))
    for layer in params["layers"]:
        q, k, v = jnp.split(_norm(h, layer["attn_norm"]) @ layer["wqkv"], 3, axis=-1)
        q, k, v = (a.reshape(b, t, config.heads, -1) for a in (q, k, v))
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
        att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
        h = h + jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, -1) @ layer["wo"]
        h = h + jax.nn.gelu(_norm(h, layer["mlp_norm"]) @ layer["w1"]) @ layer["w2"]
    return _norm(h, params["final_norm"]) @ params["embed"].T


def loss_fn(config: TinyLMConfig, params: dict, batch: jax.Array) -> jax.Array:
    """Mean next-byte cross-entropy (nats) of ``batch`` (int32, ``(B, seq_len + 1)``)."""
    logits = _forward(config, params, batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def train(
    optimizer: optax.GradientTransformation,
    steps: int,
    config: TinyLMConfig = TinyLMConfig(),
    seed: int = 0,
) -> tuple[np.ndarray, dict, optax.OptState]:
    """Trains from a fixed init on random windows of the corpus.

    Returns:
      ``(losses, params, opt_state)``; ``losses`` holds each step's training loss.
    """
    data = jnp.asarray(corpus_bytes(), jnp.int32)
    params = init_params(config, jax.random.key(seed))
    opt_state = optimizer.init(params)
    offsets = jnp.arange(config.seq_len + 1)

    @jax.jit
    def step(params, opt_state, key):
        starts = jax.random.randint(key, (config.batch,), 0, data.shape[0] - offsets.shape[0])
        batch = data[starts[:, None] + offsets]
        loss, grads = jax.value_and_grad(lambda p: loss_fn(config, p, batch))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    keys = jax.random.split(jax.random.key(seed + 1), steps)
    losses = []
    for key in keys:
        params, opt_state, loss = step(params, opt_state, key)
        losses.append(loss)
    return np.asarray(jax.device_get(losses)), params, opt_state
