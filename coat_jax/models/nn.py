"""Flax NNX layers of a Llama block; each asks its precision :class:`~coat_jax.models.policy.Policy`
for the precision-sensitive ops, so one code path serves BF16, FP8-linear and COAT. The pre-norm
is RMSNorm with a weight (``norm="rms"``, Llama) or LayerNorm without weight or bias
(``norm="layer"``, OLMo v1); ``clip_qkv`` clamps the query, key and value projections (OLMo).

``recompute_attention`` trades compute for activation memory in the attention branch: its
pre-norm, q/k/v projections, RoPE and attention run under ``jax.checkpoint``, so backward keeps
only the block input ``x`` (BF16, ``2 d`` bytes a token) instead of the norm's saved copy
(COAT: ``1.25 d``), q, k and v (``2 d + 4 d_kv``) and on a GPU cuDNN's output (``2 d``) and
softmax statistics: Llama-2-7B with COAT ~30 KB a token a layer less on a GPU (21.5 on the
CPU's attention), ~1.9 GB a 2048-token sequence. Backward runs those ops forward once more
(one q/k/v projection and one attention forward a layer, about a tenth of the block's FLOPs);
the recomputed values equal the forward's bit for bit, so gradients do not change.

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


def _norm_weight(norm: str, dim: int, dtype):
    """The pre-norm's weight: ones for RMSNorm, none (``None``) for the weightless LayerNorm."""
    if norm not in plain.NORMS:
        raise ValueError(f"norm={norm!r}: expected one of {plain.NORMS}")
    if norm == "layer":
        return nnx.data(None)
    return nnx.Param(jnp.ones((dim,), dtype), logical_axes=("embed",))


def _norm_project(layer, x, kernels):
    """``layer``'s pre-norm of ``x`` and the projections by ``kernels``, through its policy."""
    scale = None if layer.norm is None else layer.norm[...]
    kernels = tuple(w[...] for w in kernels)
    return layer.policy.norm_project(x, scale, kernels, layer.norm_eps, layer.norm_kind)


class Attention(nnx.Module):
    """Pre-norm causal self-attention with GQA, RoPE and optionally clipped q, k, v; returns the
    residual branch."""

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
        norm: str = "rms",
        clip_qkv: float | None = None,
        recompute: bool = False,
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
        self.rope_scaling, self.norm_kind, self.clip_qkv = rope_scaling, norm, clip_qkv
        self.recompute = recompute
        kv = n_kv_heads * self.head_dim
        self.norm = _norm_weight(norm, dim, param_dtype)
        self.wq = _dense(rngs, dim, dim, ("embed", "q_heads"), param_dtype)
        self.wk = _dense(rngs, dim, kv, ("embed", "kv_heads"), param_dtype)
        self.wv = _dense(rngs, dim, kv, ("embed", "kv_heads"), param_dtype)
        self.wo = _dense(rngs, dim, dim, ("q_heads", "embed"), param_dtype)

    def _weights(self):
        """The pre-norm's scale (``None`` without one) and the q, k, v kernels, as arrays."""
        scale = None if self.norm is None else self.norm[...]
        return scale, (self.wq[...], self.wk[...], self.wv[...])

    def _qkv(self, x, positions):
        """Heads ``(B, T, heads, head_dim)`` of the normed ``x``: q and k rotated, v."""
        return self._heads(x, positions, *self._weights())

    def _heads(self, x, positions, scale, kernels):
        """:meth:`_qkv` of the arrays it reads (a pure function of its arguments, for
        ``jax.checkpoint``)."""
        b, t, _ = x.shape
        q, k, v = self.policy.norm_project(x, scale, kernels, self.norm_eps, self.norm_kind)
        if self.clip_qkv is not None:
            q, k, v = (plain.clip(y, self.clip_qkv) for y in (q, k, v))
        rope = lambda y: plain.rope(y, positions, self.rope_theta, self.rope_scaling)
        q = rope(q.reshape(b, t, self.n_heads, self.head_dim))
        k = rope(k.reshape(b, t, self.n_kv_heads, self.head_dim))
        return q, k, v.reshape(b, t, self.n_kv_heads, self.head_dim)

    def _attend(self, x, positions, scale, kernels):
        """Attention of ``x``'s heads before the output projection: ``(B, T, heads x head_dim)``."""
        b, t, _ = x.shape
        return plain.attention(*self._heads(x, positions, scale, kernels)).reshape(b, t, -1)

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        attend = jax.checkpoint(self._attend) if self.recompute else self._attend
        return self.policy.project(attend(x, positions, *self._weights()), self.wo[...])

    def decode(self, x, k_cache, v_cache, length, start):
        """The branch for tokens in cache slots ``length ..`` (``x (B, T, dim)``), their keys and
        values written into the caches: ``(out, k_cache, v_cache)``. RoPE positions count from
        each row's ``start`` (its left padding); see :func:`coat_jax.ops.plain.cached_attention`.
        """
        b, t, _ = x.shape
        positions = length + jnp.arange(t)[None, :] - start[:, None]
        q, k, v = self._qkv(x, positions)
        write = lambda cache, new: jax.lax.dynamic_update_slice_in_dim(
            cache, new.astype(cache.dtype), length, axis=1
        )
        k_cache, v_cache = write(k_cache, k), write(v_cache, v)
        o = plain.cached_attention(q, k_cache, v_cache, length, start).reshape(b, t, -1)
        return self.policy.project(o, self.wo[...]), k_cache, v_cache


class MLP(nnx.Module):
    """Pre-norm SwiGLU MLP; returns the residual branch."""

    def __init__(
        self,
        dim: int,
        ffn_dim: int,
        *,
        policy: Policy,
        norm_eps: float = 1e-5,
        norm: str = "rms",
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.policy, self.norm_eps, self.norm_kind = policy, norm_eps, norm
        self.norm = _norm_weight(norm, dim, param_dtype)
        self.w_gate = _dense(rngs, dim, ffn_dim, ("embed", "mlp"), param_dtype)
        self.w_up = _dense(rngs, dim, ffn_dim, ("embed", "mlp"), param_dtype)
        self.w_down = _dense(rngs, ffn_dim, dim, ("mlp", "embed"), param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        scale = None if self.norm is None else self.norm[...]
        weights = (self.w_gate[...], self.w_up[...], self.w_down[...])
        return self.policy.mlp(x, scale, *weights, self.norm_eps, self.norm_kind)


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
        norm: str = "rms",
        clip_qkv: float | None = None,
        recompute_attention: bool = False,
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
            norm=norm,
            clip_qkv=clip_qkv,
            recompute=recompute_attention,
            param_dtype=param_dtype,
            rngs=rngs,
        )
        self.mlp = MLP(
            dim,
            ffn_dim,
            policy=policy,
            norm_eps=norm_eps,
            norm=norm,
            param_dtype=param_dtype,
            rngs=rngs,
        )

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        x = x + self.attention(x, positions)
        return x + self.mlp(x)

    def decode(self, x, k_cache, v_cache, length, start):
        """:meth:`__call__` for tokens in cache slots ``length ..`` (:meth:`Attention.decode`):
        ``(x, k_cache, v_cache)``."""
        branch, k_cache, v_cache = self.attention.decode(x, k_cache, v_cache, length, start)
        x = x + branch
        return x + self.mlp(x), k_cache, v_cache
