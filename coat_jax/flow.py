r"""FP8 precision flow: differentiable ops whose residuals for backward are FP8 (COAT, section 5).

Each op is a ``jax.custom_vjp`` with its forward, backward and ``defvjp`` side by side, so what
backward reads is explicit. Conventions (per COAT):

* GEMM operands are quantized **per tensor** just in time (scale from the current ``amax``):
  activations and weights in E4M3 for the forward, output gradients in E5M2 for the backward;
  products accumulate in fp32 (:func:`fp8_gemm`, the one place a backend plugs in).
* Inputs of non-linear layers are saved in **1x16 groups** along the hidden axis, E4M3.

Ops, with what each saves for backward (``T`` tokens, ``h`` hidden, ``f`` MLP width):

=========================  =================================================================
``fp8_project``            ``x @ W_i`` for several ``W_i``; saves ``x`` FP8 per tensor (T h
                           bytes) and the FP8 weights. The TransformerEngine-like linear.
``fp8_norm_project``       ``rmsnorm(x) @ W_i``; saves ``x`` FP8 1x16 (1.25 T h bytes) and the
                           normed input's scale; the GEMM operand is recomputed in backward.
``fp8_swiglu_project``     ``(silu(g) * u) @ W``; saves ``g``, ``u`` FP8 1x16 and one scale; the
                           GEMM operand is recomputed in backward.
``rmsnorm``, ``swiglu``    BF16 references that save only their inputs (the honest baseline).
``rope``                   rotary embedding; saves only the integer positions.
``attention``              causal GQA attention; cuDNN flash attention on a GPU, elsewhere a
                           reference that saves only ``q, k, v`` (recomputes in backward).
=========================  =================================================================

The COAT forward consumes the dequantized FP8 input (as COAT's FP8 kernels do), so backward's
recomputation reproduces the forward's GEMM operand exactly (same values, same saved scale).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from coat_jax.formats import E4M3, E5M2
from coat_jax.quant import QuantizedArray, dequantize, quantize

__all__ = [
    "ACT_GROUP",
    "attention",
    "fp8_gemm",
    "fp8_norm_project",
    "fp8_project",
    "fp8_swiglu_project",
    "RopeScaling",
    "rmsnorm",
    "rope",
    "rope_frequencies",
    "swiglu",
]

ACT_GROUP = 16
"""Group size of FP8 activations saved for non-linear layers (1x16 along the hidden axis)."""


# --------------------------------------------------------------------------------------------
# The GEMM: one function behind which the backend (XLA cuBLASLt FP8 or Pallas) is chosen.


def fp8_gemm(
    a: QuantizedArray, b: QuantizedArray, contract: tuple[int, int], out_dtype=jnp.float32
) -> jax.Array:
    """``sum_k a[..., k] b[k, ...]`` of two per-tensor FP8 operands, in ``out_dtype``.

    FP8 codes feed ``lax.dot_general`` directly with fp32 accumulation, the pattern that XLA
    rewrites into a cuBLASLt FP8 GEMM on Hopper; the two scales multiply the fp32 product and
    the cast to ``out_dtype`` joins the GEMM's epilogue there. With ``COAT_JAX_GEMM=pallas``
    (or ``auto`` and a measured win, :func:`pallas_kernels.dispatch.gemm_backend`) on a Hopper
    GPU the Pallas wgmma kernel runs instead (:mod:`pallas_kernels.fp8_matmul`; operands moved
    to K-major first, a copy for each operand whose contracted axis is not its last).

    Args:
      a, b: per-tensor :class:`QuantizedArray` operands.
      contract: the contracted axis of ``a`` and of ``b``.
      out_dtype: dtype of the result.
    """
    ca, cb = contract[0] % a.data.ndim, contract[1] % b.data.ndim
    k = a.data.shape[ca]
    m, n = a.data.size // max(k, 1), b.data.size // max(k, 1)
    if jnp.dtype(out_dtype) in _PALLAS_OUT and _gemm_backend((m, k, n)) == "pallas":
        from pallas_kernels.fp8_matmul import fp8_dot_general

        return fp8_dot_general(a.data, b.data, a.scale * b.scale, (ca, cb), out_dtype)
    dims = (((ca,), (cb,)), ((), ()))
    out = jax.lax.dot_general(a.data, b.data, dims, preferred_element_type=jnp.float32)
    return (out * (a.scale * b.scale)).astype(out_dtype)


_PALLAS_OUT = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def _gemm_backend(shape) -> str:
    from pallas_kernels.dispatch import gemm_backend

    return gemm_backend(shape)


def _quantize_grad(dy):
    return quantize(dy, E5M2)


def _matrix(x):
    """Collapses all leading axes: ``(..., K) -> (M, K)``."""
    return x.reshape(-1, x.shape[-1])


def _project_backward(xq: QuantizedArray, wqs, douts, w_dtypes):
    """Shared backward of a projection ``y_i = x @ W_i``: ``(dx, (dW_i, ...))``.

    ``dx`` comes in the output gradients' dtype (summed in fp32 over several kernels), each
    ``dW_i`` in its kernel's dtype.
    """
    dx_dtype = douts[0].dtype
    term_dtype = dx_dtype if len(wqs) == 1 else jnp.float32
    dx = None
    dws = []
    x2 = QuantizedArray(_matrix(xq.data), xq.amax)
    for wq, dy, dtype in zip(wqs, douts, w_dtypes, strict=True):
        dyq = _quantize_grad(dy)
        term = fp8_gemm(dyq, wq, contract=(-1, 1), out_dtype=term_dtype)
        dx = term if dx is None else dx + term
        dy2 = QuantizedArray(_matrix(dyq.data), dyq.amax)
        dws.append(fp8_gemm(x2, dy2, contract=(0, 0), out_dtype=dtype))
    return dx.astype(dx_dtype), tuple(dws)


def _dtypes(arrays) -> tuple:
    return tuple(jnp.dtype(a.dtype) for a in arrays)


# --------------------------------------------------------------------------------------------
# fp8_project: the TransformerEngine-like FP8 linear (saves its input in FP8, per tensor).


def fp8_project(x: jax.Array, kernels: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """``(x @ W_1, x @ W_2, ...)`` in FP8, quantizing ``x`` once; outputs in ``x.dtype``.

    Args:
      x: activations ``(..., K)``.
      kernels: weights ``(K, N_i)`` in any float dtype (gradients come back in that dtype).
    """
    _check_project(x, kernels)
    return _fp8_project(_dtypes(kernels), x, tuple(kernels))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_project(w_dtypes, x, kernels):
    return _fp8_project_fwd(w_dtypes, x, kernels)[0]


def _fp8_project_fwd(w_dtypes, x, kernels):
    del w_dtypes
    xq = quantize(x, E4M3)
    wqs = tuple(quantize(w, E4M3) for w in kernels)
    outs = tuple(fp8_gemm(xq, wq, contract=(-1, 0), out_dtype=x.dtype) for wq in wqs)
    return outs, (xq, wqs)


def _fp8_project_bwd(w_dtypes, residuals, douts):
    xq, wqs = residuals
    dx, dws = _project_backward(xq, wqs, douts, w_dtypes)
    return dx.astype(douts[0].dtype), dws


_fp8_project.defvjp(_fp8_project_fwd, _fp8_project_bwd)


# --------------------------------------------------------------------------------------------
# rmsnorm / swiglu references (BF16 baseline; save only their inputs).


def _rmsnorm_math(x, scale, eps):
    x = x.astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * rstd * scale.astype(jnp.float32)


def _swiglu_math(gate, up):
    gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
    return jax.nn.silu(gate) * up


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rmsnorm(x: jax.Array, scale: jax.Array, eps: float = 1e-6) -> jax.Array:
    r"""``x / sqrt(mean(x^2) + eps) * scale`` over the last axis (fp32 math, ``x.dtype`` out).

    Saves only ``x`` (and ``scale``) for backward; the statistics are recomputed.
    """
    return _rmsnorm_math(x, scale, eps).astype(x.dtype)


def _rmsnorm_fwd(x, scale, eps):
    return rmsnorm(x, scale, eps), (x, scale)


def _rmsnorm_bwd(eps, residuals, dy):
    x, scale = residuals
    _, vjp = jax.vjp(lambda a, s: _rmsnorm_math(a, s, eps), x.astype(jnp.float32), scale)
    dx, dscale = vjp(dy.astype(jnp.float32))
    return dx.astype(x.dtype), dscale.astype(scale.dtype)


rmsnorm.defvjp(_rmsnorm_fwd, _rmsnorm_bwd)


@jax.custom_vjp
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """``silu(gate) * up`` (fp32 math, ``gate.dtype`` out); saves only ``gate`` and ``up``."""
    return _swiglu_math(gate, up).astype(gate.dtype)


def _swiglu_fwd(gate, up):
    return swiglu(gate, up), (gate, up)


def _swiglu_bwd(residuals, dy):
    gate, up = residuals
    _, vjp = jax.vjp(_swiglu_math, gate.astype(jnp.float32), up.astype(jnp.float32))
    dgate, dup = vjp(dy.astype(jnp.float32))
    return dgate.astype(gate.dtype), dup.astype(up.dtype)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


# --------------------------------------------------------------------------------------------
# COAT fused ops: FP8 1x16 inputs saved, FP8 per-tensor GEMM operands recomputed in backward.


def _save_1x16(x):
    return quantize(x, E4M3, group_size=ACT_GROUP)


def fp8_norm_project(
    x: jax.Array, norm_scale: jax.Array, kernels: tuple[jax.Array, ...], eps: float = 1e-6
) -> tuple[jax.Array, ...]:
    """``(rmsnorm(x) @ W_1, ...)`` with ``x`` saved as FP8 1x16 groups; outputs in ``x.dtype``.

    Args:
      x: residual stream ``(..., h)``; ``h`` must be a multiple of :data:`ACT_GROUP`.
      norm_scale: RMSNorm weight ``(h,)``.
      kernels: projection weights ``(h, N_i)``.
      eps: RMSNorm epsilon.
    """
    _check_project(x, kernels)
    _check_groups(x, "fp8_norm_project: x")
    return _fp8_norm_project(eps, _dtypes(kernels), x, norm_scale, tuple(kernels))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fp8_norm_project(eps, w_dtypes, x, norm_scale, kernels):
    return _fp8_norm_project_fwd(eps, w_dtypes, x, norm_scale, kernels)[0]


def _fp8_norm_project_fwd(eps, w_dtypes, x, norm_scale, kernels):
    del w_dtypes
    xg = _save_1x16(x)
    y = _rmsnorm_math(dequantize(xg, x.dtype), norm_scale, eps).astype(x.dtype)
    yq = quantize(y, E4M3)
    wqs = tuple(quantize(w, E4M3) for w in kernels)
    outs = tuple(fp8_gemm(yq, wq, contract=(-1, 0), out_dtype=x.dtype) for wq in wqs)
    return outs, (xg, norm_scale, yq.amax, wqs)


def _fp8_norm_project_bwd(eps, w_dtypes, residuals, douts):
    xg, norm_scale, y_amax, wqs = residuals
    dtype = douts[0].dtype
    norm = lambda a, s: _rmsnorm_math(a, s, eps).astype(dtype)
    y, norm_vjp = jax.vjp(norm, dequantize(xg, dtype), norm_scale)
    yq = quantize(y, E4M3, amax=y_amax)
    dy, dws = _project_backward(yq, wqs, douts, w_dtypes)
    dx, dscale = norm_vjp(dy)
    return dx.astype(douts[0].dtype), dscale.astype(norm_scale.dtype), dws


_fp8_norm_project.defvjp(_fp8_norm_project_fwd, _fp8_norm_project_bwd)


def fp8_swiglu_project(gate: jax.Array, up: jax.Array, kernel: jax.Array) -> jax.Array:
    """``(silu(gate) * up) @ W`` with ``gate``, ``up`` saved as FP8 1x16 groups.

    Args:
      gate, up: ``(..., f)``; ``f`` must be a multiple of :data:`ACT_GROUP`.
      kernel: down-projection weight ``(f, h)``.
    """
    if gate.shape != up.shape:
        raise ValueError(f"fp8_swiglu_project: gate {gate.shape} and up {up.shape} differ")
    _check_project(gate, (kernel,))
    _check_groups(gate, "fp8_swiglu_project: gate")
    return _fp8_swiglu_project(jnp.dtype(kernel.dtype), gate, up, kernel)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_swiglu_project(w_dtype, gate, up, kernel):
    return _fp8_swiglu_project_fwd(w_dtype, gate, up, kernel)[0]


def _fp8_swiglu_project_fwd(w_dtype, gate, up, kernel):
    del w_dtype
    gq, uq = _save_1x16(gate), _save_1x16(up)
    dtype = gate.dtype
    h = _swiglu_math(dequantize(gq, dtype), dequantize(uq, dtype)).astype(dtype)
    hq, wq = quantize(h, E4M3), quantize(kernel, E4M3)
    out = fp8_gemm(hq, wq, contract=(-1, 0), out_dtype=dtype)
    return out, (gq, uq, hq.amax, wq)


def _fp8_swiglu_project_bwd(w_dtype, residuals, dout):
    gq, uq, h_amax, wq = residuals
    dtype = dout.dtype
    swiglu = lambda g, u: _swiglu_math(g, u).astype(dtype)
    h, swiglu_vjp = jax.vjp(swiglu, dequantize(gq, dtype), dequantize(uq, dtype))
    hq = quantize(h, E4M3, amax=h_amax)
    dh, (dw,) = _project_backward(hq, (wq,), (dout,), (w_dtype,))
    dgate, dup = swiglu_vjp(dh)
    return dgate.astype(dout.dtype), dup.astype(dout.dtype), dw


_fp8_swiglu_project.defvjp(_fp8_swiglu_project_fwd, _fp8_swiglu_project_bwd)


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


def attention(q: jax.Array, k: jax.Array, v: jax.Array, implementation: str | None = None):
    """Causal attention, ``q (B, T, H, D)``, ``k, v (B, T, Hkv, D)`` with ``H % Hkv == 0``.

    ``implementation``: ``"cudnn"`` (``jax.nn.dot_product_attention``'s flash kernel, GPU),
    ``"reference"`` (:func:`_attention_reference`, any backend) or ``None``: cuDNN on a GPU
    with bf16/fp16 inputs, the reference elsewhere.
    """
    if q.shape[-2] % k.shape[-2]:
        raise ValueError(f"attention: {q.shape[-2]} query heads not a multiple of {k.shape[-2]}")
    if implementation is None:
        on_gpu = jax.default_backend() == "gpu"
        implementation = "cudnn" if on_gpu and q.dtype in (jnp.bfloat16, jnp.float16) else None
    if implementation == "cudnn":
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    if implementation not in (None, "reference"):
        raise ValueError(f"attention: unknown implementation {implementation!r}")
    return _attention_reference(q, k, v)


def _attention_scores(q, k):
    b, t, h, d = q.shape
    hkv = k.shape[-2]
    qg = q.reshape(b, t, hkv, h // hkv, d).astype(jnp.float32)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k.astype(jnp.float32)) / math.sqrt(d)
    causal = jnp.tril(jnp.ones((t, t), bool))
    return jnp.where(causal, s, -jnp.inf)


@jax.custom_vjp
def _attention_reference(q, k, v):
    """Flash-like reference: saves only ``q, k, v``; backward recomputes the probabilities."""
    return _attention_math(q, k, v)


def _attention_math(q, k, v):
    b, t, h, d = q.shape
    p = jax.nn.softmax(_attention_scores(q, k), axis=-1)
    o = jnp.einsum("bhgqk,bkhd->bqhgd", p, v.astype(jnp.float32))
    return o.reshape(b, t, h, d).astype(q.dtype)


def _attention_reference_fwd(q, k, v):
    return _attention_math(q, k, v), (q, k, v)


def _attention_reference_bwd(residuals, do):
    return jax.vjp(_attention_math, *residuals)[1](do)


_attention_reference.defvjp(_attention_reference_fwd, _attention_reference_bwd)


# --------------------------------------------------------------------------------------------
# Input checks (shapes are static: these run at trace time, before any work).


def _check_project(x, kernels):
    if not kernels:
        raise ValueError("projection needs at least one kernel")
    for w in kernels:
        if w.ndim != 2 or w.shape[0] != x.shape[-1]:
            raise ValueError(
                f"projection: x has last axis {x.shape[-1]} but a kernel has shape {w.shape}"
            )


def _check_groups(x, what):
    if x.shape[-1] % ACT_GROUP:
        raise ValueError(
            f"{what} last axis {x.shape[-1]} is not a multiple of the FP8 group size {ACT_GROUP}"
        )
