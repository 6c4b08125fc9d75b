r"""``log`` and ``exp2`` from integer bit operations and one polynomial: no MUFU instruction.

A Hopper SM evaluates 16 transcendental (MUFU: ``lg2.approx``, ``ex2.approx``, ``rcp``,
``sqrt``) results a clock against 128 fp32 multiply-adds, so a kernel that needs ten of them an
element (the fused FP8 AdamW update with range expansion: ``log`` and ``exp2`` to decode and
to encode each moment, a square root and a reciprocal for the direction) can be bound by that
unit while its other pipes idle. These functions move the work to the multiply-add pipe:

.. math::

  \ln x = e \ln 2 + u\,Q(u), \qquad x = 2^e (1 + u),\ 1 + u \in [\sqrt{1/2}, \sqrt 2),

with ``e`` and ``1 + u`` read from the bits of ``x`` (subnormal ``x`` scaled by :math:`2^{24}`
first) and ``Q`` of degree 7 (absolute error of :math:`u\,Q(u)` below :math:`7 \cdot 10^{-8}`);

.. math::

  2^t = 2^r (1 + f\,P(f)), \qquad r = \mathrm{round}(t),\ f = t - r \in [-1/2, 1/2],

with ``r`` rounded by adding :math:`1.5 \cdot 2^{23}` (no float-to-int conversion, another
slow instruction), :math:`2^r` added to the exponent bits and ``P`` of degree 4 (relative error
below :math:`2 \cdot 10^{-7}`, as ``ex2.approx.f32``'s). The coefficients are least-squares
fits on Chebyshev nodes, reweighted towards minimax, rounded to fp32; the tests measure both
bounds over fp32's range.

Special values as ``jnp.log`` / ``jnp.exp2`` treat them, except where noted: ``log(0) = -inf``,
``log(inf) = inf``, ``log(NaN) = NaN`` (``log`` of a negative number is not defined here: the
kernels pass magnitudes); ``exp2(t) = 0`` below ``t = -126`` (fp32's normal range; XLA's GPU
``exp2`` flushes there too), ``inf`` above 127, ``NaN`` for ``NaN``. ~20 instructions each
instead of one MUFU op and a multiply: whether that is faster depends on which unit binds,
measured by ``bench/adam_ablation.py``. Pure ``jnp``: the same code runs in a Pallas Triton
kernel, in interpret mode and in XLA.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["exp2", "log"]

_LN_2 = float(np.float32(np.log(2.0)))
_SQRT_HALF_BITS = 0x3F3504F3  # fp32 bits of sqrt(1/2)
_ROUNDER = 12582912.0  # 1.5 * 2^23: t + this rounds t to an integer in the low mantissa bits
_ROUNDER_BITS = 0x4B400000
_TINY = float(np.finfo(np.float32).tiny)

# ln(1 + u) = u Q(u) on [sqrt(1/2) - 1, sqrt(2) - 1]; Q's coefficients from u^0 up
_LOG_Q = (
    0.9999998211860657, -0.5000066757202148, 0.33336180448532104, -0.24959342181682587,
    0.1987304985523224, -0.17333480715751648, 0.16419969499111176, -0.1010216474533081,
)
# 2^f - 1 = f P(f) on [-1/2, 1/2]; P's coefficients from f^0 up
_EXP2_P = (
    0.6931470036506653, 0.24022242426872253, 0.05550733581185341, 0.009671512991189957,
    0.0013264728477224708,
)


def _horner(coefficients, x):
    acc = jnp.full_like(x, coefficients[-1])
    for c in coefficients[-2::-1]:
        acc = acc * x + c
    return acc


def _int_to_float(i):
    """An int32 ``|i| < 2^22`` as fp32 through the bits of ``1.5 * 2^23 + i`` (no conversion
    instruction)."""
    as_float = jax.lax.bitcast_convert_type(i + _ROUNDER_BITS, jnp.float32)
    return as_float - _ROUNDER


def log(x: jax.Array) -> jax.Array:
    """Natural logarithm of ``x >= 0`` (fp32), from its bits and a degree-8 polynomial."""
    x = jnp.asarray(x, jnp.float32)
    subnormal = x < _TINY
    scaled = jnp.where(subnormal, x * 2.0**24, x)
    bits = jax.lax.bitcast_convert_type(scaled, jnp.int32)
    e = (bits - _SQRT_HALF_BITS) >> 23  # so that 2^-e x lies in [sqrt(1/2), sqrt(2))
    u = jax.lax.bitcast_convert_type(bits - (e << 23), jnp.float32) - 1.0
    e = _int_to_float(e) - jnp.where(subnormal, 24.0, 0.0)
    y = e * _LN_2 + u * _horner(_LOG_Q, u)
    y = jnp.where(x < jnp.inf, y, x)  # inf and NaN as given
    return jnp.where(x == 0, -jnp.inf, y)


def exp2(t: jax.Array) -> jax.Array:
    """``2^t`` (fp32) from a degree-5 polynomial and the exponent bits; 0 below ``t = -126``."""
    t = jnp.asarray(t, jnp.float32)
    clipped = jnp.clip(t, -127.0, 127.0)  # NaN is restored below (Triton's clip drops it)
    # 2^22 < rounded < 2^24, so the max changes nothing; it stops XLA's simplifier from folding
    # (clipped + c) - c into clipped (it reassociates float adds of constants, found by the tests)
    rounded = jnp.maximum(clipped + _ROUNDER, 2.0**22)
    f = clipped - (rounded - _ROUNDER)
    p = 1.0 + f * _horner(_EXP2_P, f)
    r = jax.lax.bitcast_convert_type(rounded, jnp.int32) - _ROUNDER_BITS
    y = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(p, jnp.int32) + (r << 23),
                                     jnp.float32)  # fmt: skip
    y = jnp.where(t < -126.0, 0.0, y)
    y = jnp.where(t > 127.0, jnp.inf, y)
    return jnp.where(t == t, y, t)
