r"""Dynamic range expansion (COAT, arXiv 2410.19313, section 4).

A group of Adam moments spans a small dynamic range (max/min ~1e3 for m, ~10 for v) while an
FP8 format spans ~1e5 (E4M3). Before quantizing, COAT maps each group through

.. math::

  f(x) = \mathrm{sign}(x) \left|\frac{x}{c}\right|^k, \qquad
  c = \sqrt{m_x} \sqrt{m_n}, \qquad
  k = \frac{\log R}{\log(m_x / m_n)},

with :math:`m_x = \max |x|`, :math:`m_n = \min_{x \ne 0} |x|` over the group and a target range
:math:`R` (``448**2 / 2`` for E4M3), then scales by :math:`s = (m_x / c)^k / q_{max}` and casts.
The expanded group spans :math:`(m_x/m_n)^k = R` instead of :math:`m_x/m_n`.

**The centre cancels.** Quantized value and its inverse reduce to

.. math::

  q = \frac{f(x)}{s} = \mathrm{sign}(x)\, q_{max} \left(\frac{|x|}{m_x}\right)^k, \qquad
  x = \mathrm{sign}(q)\, m_x \left(\frac{|q|}{q_{max}}\right)^{1/k},

so a group is fully described by :math:`(m_x, k)`. coat-jax stores exactly that: ``amax`` in
fp32 and ``k`` as a uint8 code (``k = code / 16``), 5 bytes a group instead of the reference's 12
(scale, k, c in fp32). The ratios stay in ``[0, 1]``, so nothing overflows for any finite input,
and a group whose nonzero values are all equal (one value, ``m_x == m_n``) round-trips exactly.
:func:`expand` / :func:`contract` keep the reference's form with :math:`c` for tests and reading.

**The exponent.** ``k`` is rounded *down* to a multiple of 1/16 (as the reference does, so the
expanded range never exceeds :math:`R`) and clamped to ``[K_MIN, K_MAX] = [1/16, 255/16]``:

* ``m_x / m_n`` tiny (equal values, one nonzero value, or an all-zero group): ``k = K_MAX``.
  Relative precision in x is the format's divided by ``k``, so a large ``k`` only helps.
* ``m_x / m_n > R**16`` (more than ~80 decades for E4M3, impossible with fp32 ``m`` or ``v``
  except through denormals): ``k = K_MIN``. Values compress, stay finite and keep their sign.
* ``k < 1`` compresses a group wider than the format (e.g. 1e-30 .. 1e30) so that its small
  values are not flushed to zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from coat_jax.core.formats import Fp8Format

__all__ = [
    "K_MAX",
    "K_MIN",
    "K_STEP",
    "contract",
    "decode_k",
    "encode_k",
    "expand",
    "expanded_decode",
    "expanded_encode",
    "expansion_centre",
    "expansion_exponent",
    "group_range",
]

K_STEP = 1.0 / 16.0
K_MIN = 1 * K_STEP
K_MAX = 255 * K_STEP
_TINY = float(jnp.finfo(jnp.float32).tiny)
_LOG2_E = 1.4426950408889634
# Below this k a decoded 2^t may leave fp32's normal range (E5M2's smallest code is 2^-16 of
# its max: t >= -16 / k > -64 for k >= 1/4).
_K_COMPRESS = 0.25


def group_range(x: jax.Array, axis: int = -1) -> tuple[jax.Array, jax.Array]:
    """Returns ``(max |x|, min of the nonzero |x|)`` over the finite elements along ``axis``.

    fp32. NaN and +-Inf elements are left out (an element that is not finite is stored as the
    format's NaN code by :func:`coat_jax.core.quant.encode`, so it does not cost its group's
    precision); both are 0 where the group has no finite nonzero element.
    """
    a = jnp.abs(x.astype(jnp.float32))
    a = jnp.where(a < jnp.inf, a, 0.0)  # comparisons only: kernel-friendly isfinite
    amax = jnp.max(a, axis=axis)
    amin = jnp.min(jnp.where(a > 0, a, jnp.inf), axis=axis)
    return amax, jnp.where(amin < jnp.inf, amin, 0.0)


def expansion_exponent(amax: jax.Array, amin: jax.Array, fmt: Fp8Format, *,
                       log=jnp.log) -> jax.Array:  # fmt: skip
    """``k = floor16(log R / log(amax / amin))`` clamped to ``[K_MIN, K_MAX]`` (fp32).

    ``log`` is the natural logarithm to use (kernels may pass a hardware approximation; the
    encoder takes ``log amax`` with the same function, so the two are one computation).
    """
    log_ratio = log(amax) - log(amin)  # no overflow from amax / amin
    degenerate = (amin <= 0) | ~(log_ratio > 0)  # all-zero, single value, equal values
    safe_log_ratio = jnp.where(degenerate, 1.0, log_ratio)
    # (log R / K_STEP) / r rounds as (log R / r) / K_STEP does: K_STEP is a power of two
    sixteenths = float(np.float32(np.log(fmt.expansion_target_range))) / K_STEP
    k = jnp.floor(sixteenths / safe_log_ratio) * K_STEP
    k = jnp.where(degenerate, K_MAX, k)
    return jnp.clip(k, K_MIN, K_MAX).astype(jnp.float32)


def encode_k(k: jax.Array) -> jax.Array:
    """Stores ``k`` (a multiple of 1/16 in ``[K_MIN, K_MAX]``) as a uint8 code ``16 k``."""
    return jnp.floor(k / K_STEP + 0.5).astype(jnp.uint8)  # round; Triton lacks lax.round


def decode_k(code: jax.Array) -> jax.Array:
    """Inverse of :func:`encode_k`."""
    return code.astype(jnp.float32) * K_STEP


def expanded_encode(
    x: jax.Array, amax: jax.Array, k: jax.Array, fmt: Fp8Format, *, log=jnp.log, exp2=jnp.exp2
) -> jax.Array:
    """``sign(x) * fmt.max * 2^(k log2(e) (ln|x| - ln amax))``: expansion and absmax scaling in one.

    fp32; ``amax`` and ``k`` broadcast against ``x`` (per-group values shaped ``(..., 1)``, so
    ``ln amax`` and ``k log2(e)`` are computed once a group); groups with ``amax == 0`` map to
    0. Per element one ``log`` and one ``exp2`` and no division: the ratio ``|x| / amax`` is
    never formed, so ratios below fp32's normal range (a group spanning more than 38 decades)
    need no second path. ``|x| == amax`` encodes to exactly ``fmt.max``, 0 to 0 (``ln 0 =
    -inf``), a non-finite ``x`` to ``+-inf`` (the caller stores it as NaN). No product feeds a
    sum, so XLA's multiply-add contraction (under jit, not eagerly) cannot change a bit. ``log``
    (natural) and ``exp2`` are the functions to use per element (kernels pass hardware
    approximations).
    """
    x = x.astype(jnp.float32)
    log_ratio = log(jnp.abs(x)) - log(jnp.where(amax > 0, amax, 1.0))
    magnitude = fmt.max * exp2(log_ratio * (k * _LOG2_E))
    return jnp.where(x < 0, -magnitude, magnitude)


def expanded_decode(
    q: jax.Array, amax: jax.Array, k: jax.Array, fmt: Fp8Format, *, log=jnp.log, exp2=jnp.exp2
) -> jax.Array:
    """Inverse of :func:`expanded_encode`: ``sign(q) * amax * 2^((ln|q| - ln fmax) log2(e) / k)``.

    fp32. Per element one ``log`` and one ``exp2``; ``log2(e) / k`` and the choice below are
    per group. ``|q| == fmt.max`` decodes to exactly ``amax``. Groups with ``k < 1/4`` (ranges
    wider than the format, where ``2^t`` could leave fp32's range) move a power of two of
    ``amax`` inside the power; elsewhere that shift is 0, so a multiply-add contraction of
    ``t + shift`` cannot change a bit.
    """
    q = q.astype(jnp.float32)
    a = jnp.abs(q)
    ln_fmax = float(np.float32(np.log(fmt.max)))  # a constant: jit, eager and kernels agree
    t = (log(a) - ln_fmax) * (_LOG2_E / k)
    # Per group: 2^t amax = 2^(t + e) (amax 2^-e), e the power-of-two exponent of amax clipped to
    # +-120, when k < 1/4; there 2^t alone may underflow (t down to -285) or 2^(t + log2 amax)
    # overflow (amax near fp32's max). The clip keeps 2^-e clear of fp32's bottom (XLA's exp2
    # returns 0 at 2^-126); the earlier +-100 let 2^(t + e) flush to zero for amax > 2^100
    # (found by tests/test_quant.py's hypothesis run). e and 2^-e come from amax's bits.
    compress = k < _K_COMPRESS
    e = jnp.clip(_binary_exponent(amax), -120, 120)
    shift = jnp.where(compress, e.astype(jnp.float32), 0.0)
    mult = jnp.where(compress, amax * _power_of_two(-e), amax)
    magnitude = jnp.where(a == fmt.max, amax, exp2(t + shift) * mult)  # exact at the top
    # A nonzero code whose value lands below fp32's normal range (k < 1 groups spanning ~38
    # decades) decodes to the smallest normal (or amax, if smaller), not to a denormal that
    # XLA flushes to 0: found by tests/test_quant.py's hypothesis run ([1.0, 1.86e-38], e4m3).
    floor = jnp.where(a > 0, jnp.minimum(_TINY, amax), 0.0)
    # a select, not jnp.maximum: Pallas Triton lowers max to IEEE maxNum, which returns the
    # floor for a NaN code's NaN magnitude (the fused moment kernel read a NaN second moment
    # as a finite one on the H200, 2026-12-04; tests/triton_semantics.py)
    magnitude = jnp.where(magnitude < floor, floor, magnitude)
    return jnp.where(q < 0, -magnitude, magnitude)


def _binary_exponent(x: jax.Array) -> jax.Array:
    """``floor(log2 x)`` of a positive normal fp32 ``x`` from its exponent bits (int32; -127
    for 0 and subnormals)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return ((bits >> 23) & 0xFF) - 127


def _power_of_two(e: jax.Array) -> jax.Array:
    """``2^e`` (fp32) for an int32 ``e`` in ``[-126, 127]``, built from its bits."""
    return jax.lax.bitcast_convert_type((e + 127) << 23, jnp.float32)


def expansion_centre(amax: jax.Array, amin: jax.Array) -> jax.Array:
    """The reference's centre ``c = sqrt(amax) * sqrt(amin)`` (``amax`` when ``amin`` is 0)."""
    return jnp.where(amin > 0, jnp.sqrt(amax) * jnp.sqrt(amin), amax)


def expand(x: jax.Array, k: jax.Array, c: jax.Array) -> jax.Array:
    """The reference's ``f(x) = sign(x) |x / c|^k`` (kept for tests and reading)."""
    return jnp.sign(x) * jnp.power(jnp.abs(x / c), k)


def contract(y: jax.Array, k: jax.Array, c: jax.Array) -> jax.Array:
    """The reference's ``f^-1(y) = sign(y) |y|^(1/k) c``."""
    return jnp.sign(y) * jnp.power(jnp.abs(y), 1.0 / k) * c
