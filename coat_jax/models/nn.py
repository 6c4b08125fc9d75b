"""Flax NNX layers of a Llama block; each asks its precision :class:`~coat_jax.models.policy.Policy`
for the precision-sensitive ops, so one code path serves BF16, FP8-linear and COAT.

Parameters are stored in ``param_dtype`` (fp32 master weights by default) and annotated with
logical axis names (metadata ``logical_axes``) that :mod:`coat_jax.ops.sharding` maps to a mesh:

=============  ===========================================
name           meaning
=============  ===========================================
``embed``      model (hidden) dimension
``q_heads``    query heads x head dim
``kv_heads``   key/value heads x head dim
``mlp``        MLP width
``vocab``      vocabulary
=============  ===========================================
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from coat_jax.models.policy import Policy
from coat_jax.ops import plain

__all__ = ["Attention", "Block", "MLP"]


def _dense(rngs: nnx.Rngs, fan_in: int, fan_out: int, axes, dtype) -> nnx.Param:
    w = jax.random.normal(rngs.params(), (fan_in, fan_out), dtype) / jnp.sqrt(fan_in).astype(dtype)
    return nnx.Param(w, logical_axes=axes)


def _ones(dim: int, dtype) -> nnx.Param:
    return nnx.Param(jnp.ones((dim,), dtype), logical_axes=("embed",))


class Attention(nnx.Module):
    """Pre-norm causal self-attention with GQA and RoPE; returns the residual branch."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        *,
        policy: Policy,
        rope_theta: float = 10000.0,
        rope_scaling: plain.RopeScaling | None = None,
        norm_eps: float = 1e-5,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        if dim % n_heads or n_heads % n_kv_heads:
            raise ValueError(
                f"Attention: dim {dim} must divide into {n_heads} heads and n_heads into "
                f"{n_kv_heads} kv heads"
            )
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.policy, self.rope_theta, self.norm_eps = policy, rope_theta, norm_eps
        self.rope_scaling = rope_scaling
        kv = n_kv_heads * self.head_dim
        self.norm = _ones(dim, param_dtype)
        self.wq = _dense(rngs, dim, dim, ("embed", "q_heads"), param_dtype)
        self.wk = _dense(rngs, dim, kv, ("embed", "kv_heads"), param_dtype)
        self.wv = _dense(rngs, dim, kv, ("embed", "kv_heads"), param_dtype)
        self.wo = _dense(rngs, dim, dim, ("q_heads", "embed"), param_dtype)

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        b, t, _ = x.shape
        q, k, v = self.policy.norm_project(
            x, self.norm[...], (self.wq[...], self.wk[...], self.wv[...]), self.norm_eps
        )
        rope = lambda y: plain.rope(y, positions, self.rope_theta, self.rope_scaling)
        q = rope(q.reshape(b, t, self.n_heads, self.head_dim))
        k = rope(k.reshape(b, t, self.n_kv_heads, self.head_dim))
        v = v.reshape(b, t, self.n_kv_heads, self.head_dim)
        o = plain.attention(q, k, v).reshape(b, t, -1)
        return self.policy.project(o, self.wo[...])


class MLP(nnx.Module):
    """Pre-norm SwiGLU MLP; returns the residual branch."""

    def __init__(
        self,
        dim: int,
        ffn_dim: int,
        *,
        policy: Policy,
        norm_eps: float = 1e-5,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.policy, self.norm_eps = policy, norm_eps
        self.norm = _ones(dim, param_dtype)
        self.w_gate = _dense(rngs, dim, ffn_dim, ("embed", "mlp"), param_dtype)
        self.w_up = _dense(rngs, dim, ffn_dim, ("embed", "mlp"), param_dtype)
        self.w_down = _dense(rngs, ffn_dim, dim, ("mlp", "embed"), param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = self.policy.norm_project(
            x, self.norm[...], (self.w_gate[...], self.w_up[...]), self.norm_eps
        )
        return self.policy.swiglu_project(gate, up, self.w_down[...])


class Block(nnx.Module):
    """One Llama block: ``x + attn(x)``, then ``+ mlp(.)``; the residual stream stays BF16."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        ffn_dim: int,
        *,
        policy: Policy,
        rope_theta: float = 10000.0,
        rope_scaling: plain.RopeScaling | None = None,
        norm_eps: float = 1e-5,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.attention = Attention(
            dim,
            n_heads,
            n_kv_heads,
            policy=policy,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            norm_eps=norm_eps,
            param_dtype=param_dtype,
            rngs=rngs,
        )
        self.mlp = MLP(
            dim, ffn_dim, policy=policy, norm_eps=norm_eps, param_dtype=param_dtype, rngs=rngs
        )

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        x = x + self.attention(x, positions)
        return x + self.mlp(x)
