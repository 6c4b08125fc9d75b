"""Plain differentiable ops of a Llama block, the same in every precision policy: the norms
(RMSNorm, and OLMo's non-parametric LayerNorm) and SwiGLU (the BF16 baseline's, saving only
their inputs), the LM head's fp32 logits (:func:`head_logits`), QKV clipping (saving a mask),
rotary embeddings (saving only the positions) and causal attention (cuDNN flash attention on a
GPU, elsewhere a reference that saves only ``q, k, v``). Each is a ``jax.custom_vjp`` with
forward, backward and ``defvjp`` side by side; math in fp32, outputs in the input's dtype. The
FP8 ops of :mod:`coat_jax.ops.flow` reuse :func:`norm_fp32` and :func:`swiglu_fp32`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "RopeScaling",
    "attention",
    "NORMS",
    "cached_attention",
    "clip",
    "head_logits",
    "layernorm",
    "layernorm_fp32",
    "norm",
    "norm_fp32",
    "rmsnorm",
    "rmsnorm_fp32",
    "rope",
    "rope_frequencies",
    "swiglu",
    "swiglu_fp32",
]


# --------------------------------------------------------------------------------------------
# The LM head.


def head_logits(x: jax.Array, head: jax.Array) -> jax.Array:
    r"""fp32 logits ``z = x @ head`` of hidden states ``x (..., h)`` and the head ``(h, vocab)``,
    both in the compute dtype, the products accumulated in fp32.

    The loss's gradient ``dz`` arrives in fp32; backward rounds it to the operands' dtype
    before its two GEMMs,

    .. math::
        \hat{dz} = \mathrm{rd}(dz), \qquad dx = \hat{dz}\, W^\top, \qquad
        dW = \textstyle\sum_{\text{tokens}} x^\top \hat{dz}

    (fp32 accumulation, results in the operands' dtypes), as mixed-precision training does
    elsewhere (BF16 autocast, MaxText's BF16 logits). JAX's own transpose of the forward dot
    multiplies the fp32 ``dz`` with a BF16 operand, which XLA runs as an fp32 GEMM: on an
    H100 the LM head's two backward GEMMs of a 7B step ran at 216 and 367 TFLOP/s beside its
    forward's 796 (bench/results/profiles_7b_2layers_b8_fused_h100_2026-12-06.tgz). With fp32
    operands (the ``fp32`` policy) it is the plain dot, differentiated by JAX under the
    caller's matmul precision.
    """
    if x.dtype == head.dtype == jnp.float32:
        return jnp.dot(x, head, preferred_element_type=jnp.float32)
    return _head_logits(x, head)


@jax.custom_vjp
def _head_logits(x, head):
    return jnp.dot(x, head, preferred_element_type=jnp.float32)


def _head_logits_fwd(x, head):
    return _head_logits(x, head), (x, head)


def _head_logits_bwd(residuals, dz):
    x, head = residuals
    dz = dz.astype(x.dtype)
    dx = jnp.dot(dz, head.T, preferred_element_type=jnp.float32)
    tokens = tuple(range(x.ndim - 1))
    dhead = jnp.tensordot(x, dz, axes=(tokens, tokens), preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), dhead.astype(head.dtype)


_head_logits.defvjp(_head_logits_fwd, _head_logits_bwd)


# --------------------------------------------------------------------------------------------
# Norms and swiglu (BF16 baseline; save only their inputs).

NORMS = ("rms", "layer")
"""Pre-norm kinds: ``"rms"`` (RMSNorm with a weight, Llama) and ``"layer"`` (LayerNorm without
weight or bias, OLMo v1)."""


def rmsnorm_fp32(x, scale, eps):
    """``x / sqrt(mean(x^2) + eps) * scale`` over the last axis, in fp32."""
    x = x.astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * rstd * scale.astype(jnp.float32)


def swiglu_fp32(gate, up):
    """``silu(gate) * up`` in fp32."""
    gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
    return jax.nn.silu(gate) * up


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rmsnorm(x: jax.Array, scale: jax.Array, eps: float = 1e-6) -> jax.Array:
    r"""``x / sqrt(mean(x^2) + eps) * scale`` over the last axis (fp32 math, ``x.dtype`` out).

    Saves only ``x`` (and ``scale``) for backward; the statistics are recomputed.
    """
    return rmsnorm_fp32(x, scale, eps).astype(x.dtype)


def _rmsnorm_fwd(x, scale, eps):
    return rmsnorm(x, scale, eps), (x, scale)


def _rmsnorm_bwd(eps, residuals, dy):
    x, scale = residuals
    _, vjp = jax.vjp(lambda a, s: rmsnorm_fp32(a, s, eps), x.astype(jnp.float32), scale)
    dx, dscale = vjp(dy.astype(jnp.float32))
    return dx.astype(x.dtype), dscale.astype(scale.dtype)


rmsnorm.defvjp(_rmsnorm_fwd, _rmsnorm_bwd)


def layernorm_fp32(x, eps):
    """``(x - mean(x)) / sqrt(var(x) + eps)`` over the last axis (biased variance), in fp32:
    the non-parametric LayerNorm of OLMo (no weight, no bias)."""
    x = x.astype(jnp.float32)
    centred = x - jnp.mean(x, axis=-1, keepdims=True)
    return centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def layernorm(x: jax.Array, eps: float = 1e-5) -> jax.Array:
    """:func:`layernorm_fp32` (fp32 math, ``x.dtype`` out). Saves only ``x`` for backward; the
    statistics are recomputed."""
    return layernorm_fp32(x, eps).astype(x.dtype)


def _layernorm_fwd(x, eps):
    return layernorm(x, eps), x


def _layernorm_bwd(eps, x, dy):
    _, vjp = jax.vjp(lambda a: layernorm_fp32(a, eps), x.astype(jnp.float32))
    (dx,) = vjp(dy.astype(jnp.float32))
    return (dx.astype(x.dtype),)


layernorm.defvjp(_layernorm_fwd, _layernorm_bwd)


def _check_norm(kind: str, scale) -> None:
    if kind not in NORMS:
        raise ValueError(f"norm kind {kind!r}: expected one of {NORMS}")
    if (scale is None) != (kind == "layer"):
        need = "no weight (scale=None)" if kind == "layer" else "a weight"
        raise ValueError(f"norm kind {kind!r} takes {need}")


def norm_fp32(x, scale, eps, kind: str = "rms"):
    """The pre-norm ``kind`` in fp32: :func:`rmsnorm_fp32` with weight ``scale`` (``"rms"``) or
    :func:`layernorm_fp32` (``"layer"``; ``scale`` is ``None``)."""
    _check_norm(kind, scale)
    return rmsnorm_fp32(x, scale, eps) if kind == "rms" else layernorm_fp32(x, eps)


def norm(x: jax.Array, scale: jax.Array | None, eps: float, kind: str = "rms") -> jax.Array:
    """:func:`rmsnorm` (``"rms"``) or :func:`layernorm` (``"layer"``, ``scale`` ``None``): the
    differentiable :func:`norm_fp32`, saving only its input (and weight)."""
    _check_norm(kind, scale)
    return rmsnorm(x, scale, eps) if kind == "rms" else layernorm(x, eps)


@jax.custom_vjp
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """``silu(gate) * up`` (fp32 math, ``gate.dtype`` out); saves only ``gate`` and ``up``."""
    return swiglu_fp32(gate, up).astype(gate.dtype)


def _swiglu_fwd(gate, up):
    return swiglu(gate, up), (gate, up)


def _swiglu_bwd(residuals, dy):
    gate, up = residuals
    _, vjp = jax.vjp(swiglu_fp32, gate.astype(jnp.float32), up.astype(jnp.float32))
    dgate, dup = vjp(dy.astype(jnp.float32))
    return dgate.astype(gate.dtype), dup.astype(up.dtype)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def clip(x: jax.Array, limit: float) -> jax.Array:
    """``x`` clamped to ``[-limit, limit]`` (OLMo's ``clip_qkv``). Saves a bool mask (1 byte an
    element) instead of ``x``; the gradient passes where ``-limit <= x <= limit``, as torch's
    ``clamp``'s does."""
    return jnp.clip(x, -limit, limit)


def _clip_fwd(x, limit):
    return clip(x, limit), jnp.abs(x) <= limit


def _clip_bwd(limit, inside, dy):
    del limit
    return (jnp.where(inside, dy, jnp.zeros_like(dy)),)


clip.defvjp(_clip_fwd, _clip_bwd)


# --------------------------------------------------------------------------------------------
# Rotary position embedding (saves only the positions).


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Context extension of RoPE by rescaled frequencies (Hugging Face ``rope_scaling``).

    ``kind="linear"`` divides every frequency by ``factor`` (position interpolation);
    ``kind="llama3"`` (Llama 3.1) divides only the low frequencies, those whose wavelength
    exceeds ``original_max_len / low_freq_factor``, keeps those shorter than
    ``original_max_len / high_freq_factor``, and blends linearly in between.
    """

    kind: str = "linear"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 8192

    def __post_init__(self):
        if self.kind not in ("linear", "llama3"):
            raise ValueError(f"RopeScaling.kind={self.kind!r}: expected 'linear' or 'llama3'")
        if not self.factor > 0:
            raise ValueError(f"RopeScaling.factor must be > 0, got {self.factor}")
        if self.kind == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                f"RopeScaling: need 0 < low_freq_factor ({self.low_freq_factor}) < "
                f"high_freq_factor ({self.high_freq_factor})"
            )


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None):
    """The ``head_dim // 2`` angular frequencies ``theta^(-2i/head_dim)``, rescaled (fp32)."""
    half = head_dim // 2
    freqs = theta ** (-np.arange(half, dtype=np.float64) / half)
    if scaling is not None and scaling.kind == "linear":
        freqs = freqs / scaling.factor
    elif scaling is not None:  # llama3
        wavelen = 2 * np.pi / freqs
        low_wavelen = scaling.original_max_len / scaling.low_freq_factor
        high_wavelen = scaling.original_max_len / scaling.high_freq_factor
        smooth = (scaling.original_max_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        blended = (1 - smooth) * freqs / scaling.factor + smooth * freqs
        freqs = np.where(
            wavelen > low_wavelen,
            freqs / scaling.factor,
            np.where(wavelen < high_wavelen, freqs, blended),
        )
    return freqs.astype(np.float32)


def _rope_math(x, positions, theta, scaling=None):
    freqs = jnp.asarray(rope_frequencies(x.shape[-1], theta, scaling))
    angles = positions.astype(jnp.float32)[..., None] * freqs  # (B, T, half)
    cos, sin = jnp.cos(angles)[..., None, :], jnp.sin(angles)[..., None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def rope(
    x: jax.Array,
    positions: jax.Array,
    theta: float = 10000.0,
    scaling: RopeScaling | None = None,
) -> jax.Array:
    """Rotary embedding of ``x (B, T, H, D)`` at integer ``positions (B, T)``, rotating the two
    halves of ``D`` (Hugging Face Llama layout, so HF q/k weights load without permutation),
    with frequencies from :func:`rope_frequencies`. Backward rotates by the opposite angle, so
    only the positions are saved."""
    return _rope_math(x, positions, theta, scaling)


def _rope_fwd(x, positions, theta, scaling):
    return _rope_math(x, positions, theta, scaling), positions


def _rope_bwd(theta, scaling, positions, dy):
    return _rope_math(dy, -positions, theta, scaling), None


rope.defvjp(_rope_fwd, _rope_bwd)


# --------------------------------------------------------------------------------------------
# Attention core (BF16 in every policy).


def attention_implementation(dtype) -> str:
    """What :func:`attention` runs for inputs of ``dtype`` by default: ``"cudnn"`` on a GPU
    with bf16/fp16, else ``"reference"``."""
    on_gpu = jax.default_backend() == "gpu"
    return "cudnn" if on_gpu and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) else "reference"


def attention(q: jax.Array, k: jax.Array, v: jax.Array, implementation: str | None = None):
    """Causal attention, ``q (B, T, H, D)``, ``k, v (B, T, Hkv, D)`` with ``H % Hkv == 0``.

    ``implementation``: ``"cudnn"`` (``jax.nn.dot_product_attention``'s flash kernel, GPU),
    ``"reference"`` (:func:`_attention_reference`, any backend) or ``None``: cuDNN on a GPU
    with bf16/fp16 inputs, the reference elsewhere.
    """
    if q.shape[-2] % k.shape[-2]:
        raise ValueError(f"attention: {q.shape[-2]} query heads not a multiple of {k.shape[-2]}")
    if implementation is None:
        implementation = attention_implementation(q.dtype)
    if implementation == "cudnn":
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    if implementation not in (None, "reference"):
        raise ValueError(f"attention: unknown implementation {implementation!r}")
    return _attention_reference(q, k, v)


def _masked_attention(q, k, v, visible):
    """GQA attention in fp32 of ``q (B, Tq, H, D)`` over ``k, v (B, Tk, Hkv, D)`` where
    ``visible`` (broadcast against ``(B, 1, 1, Tq, Tk)``) allows; ``q``'s dtype out."""
    b, t, h, d = q.shape
    hkv = k.shape[-2]
    qg = q.reshape(b, t, hkv, h // hkv, d).astype(jnp.float32)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k.astype(jnp.float32)) / math.sqrt(d)
    p = jax.nn.softmax(jnp.where(visible, s, -jnp.inf), axis=-1)
    o = jnp.einsum("bhgqk,bkhd->bqhgd", p, v.astype(jnp.float32))
    return o.reshape(b, t, h, d).astype(q.dtype)


@jax.custom_vjp
def _attention_reference(q, k, v):
    """Flash-like reference: saves only ``q, k, v``; backward recomputes the probabilities."""
    return _attention_math(q, k, v)


def _attention_math(q, k, v):
    t = q.shape[1]
    return _masked_attention(q, k, v, jnp.tril(jnp.ones((t, t), bool)))


def _attention_reference_fwd(q, k, v):
    return _attention_math(q, k, v), (q, k, v)


def _attention_reference_bwd(residuals, do):
    return jax.vjp(_attention_math, *residuals)[1](do)


_attention_reference.defvjp(_attention_reference_fwd, _attention_reference_bwd)


def cached_attention(q, k_cache, v_cache, length, start):
    """Attention of new queries over a key/value cache (inference; no gradient).

    ``q (B, T, H, D)`` holds the queries of cache slots ``length .. length + T - 1``, whose keys
    and values are already written into ``k_cache, v_cache (B, S, Hkv, D)``. The query in slot
    ``i`` of row ``b`` sees the keys of slots ``j`` with ``start[b] <= j <= i``: ``start`` is
    each row's left padding (prompts of different lengths end in the same slot). Math in fp32,
    as :func:`attention`'s reference; returns ``q``'s dtype.
    """
    _, t, h, _ = q.shape
    hkv = k_cache.shape[-2]
    if h % hkv:
        raise ValueError(f"cached_attention: {h} query heads not a multiple of {hkv}")
    query_slot = (length + jnp.arange(t))[None, :, None]  # (1, T, 1)
    key_slot = jnp.arange(k_cache.shape[1])[None, None, :]  # (1, 1, S)
    # A padding query (slot before its row's start) sees only itself: its output, never read,
    # stays finite, so the keys and values it writes into the cache are finite too.
    own = (key_slot >= start[:, None, None]) | (key_slot == query_slot)
    visible = (key_slot <= query_slot) & own  # (B, T, S)
    return _masked_attention(q, k_cache, v_cache, visible[:, None, None])
