r"""An fp32 master weight as a BF16 part the model reads and a remainder the optimizer keeps.

A float32 :math:`w` with bit pattern :math:`b` (an unsigned 32-bit integer) splits into

.. math::

   h = \left\lfloor (b + 2^{15}) / 2^{16} \right\rfloor \bmod 2^{16}, \qquad
   r = b - 2^{16} h \in [-2^{15}, 2^{15}),

all modulo :math:`2^{32}`. :math:`h`, read as a bfloat16, is :math:`w` rounded to the nearest
BF16 value, ties away from zero (:func:`bf16_part`); :math:`r` fits an int16 and
:math:`b = 2^{16} h + r` (mod :math:`2^{32}`) gives back every bit of :math:`w`, whatever it
holds (NaN payloads included). Round-to-nearest-even would need :math:`r = +2^{15}` and
:math:`-2^{15}` for two patterns with the same :math:`h`: one value too many for 16 bits, hence
ties away from zero. Weights + remainder: 4 bytes, as fp32, of which the forward reads 2.

The lossy 8-bit residual keeps :math:`r` rounded to a multiple of :math:`2^8`:
:math:`r_8 = \min(\lfloor (r + 2^7) / 2^8 \rfloor, 127)` (to nearest, ties up), so the rebuilt
weight is off by at most 1.5/256 of its BF16 spacing: under :math:`2^{-15}` relative (16
significant bits instead of fp32's 24; 3 bytes a weight). Updates smaller than that are lost.

``REMAINDER_BITS``: 16 (exact) or 8 (lossy).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = [
    "REMAINDER_BITS",
    "REMAINDER_DTYPES",
    "bf16_part",
    "join",
    "remainder_bits",
    "remainder_dtype",
    "split",
    "split_bits",
]

REMAINDER_DTYPES = {16: jnp.dtype(jnp.int16), 8: jnp.dtype(jnp.int8)}
"""Remainder bits -> the remainder's dtype."""
REMAINDER_BITS = tuple(REMAINDER_DTYPES)


def remainder_dtype(bits: int):
    """``int16`` for ``bits=16``, ``int8`` for ``bits=8``."""
    if bits not in REMAINDER_BITS:
        raise ValueError(f"remainder bits must be one of {REMAINDER_BITS}, got {bits!r}")
    return REMAINDER_DTYPES[bits]


def remainder_bits(dtype) -> int:
    """The inverse of :func:`remainder_dtype`: 16 for ``int16``, 8 for ``int8``.

    Raises:
      TypeError: any other dtype.
    """
    for bits, remainder in REMAINDER_DTYPES.items():
        if jnp.dtype(dtype) == remainder:
            return bits
    raise TypeError(f"a master-weight remainder must be int16 or int8, got {jnp.dtype(dtype)}")


def _high(bits32: jax.Array) -> jax.Array:
    return (bits32 + jnp.uint32(1 << 15)) >> 16  # uint32 arithmetic wraps (mod 2^32)


def bf16_part(w: jax.Array) -> jax.Array:
    """``w`` (fp32) rounded to the nearest bfloat16, ties away from zero: the BF16 weight
    :func:`split` keeps (differs from ``w.astype(bfloat16)`` only on exact ties)."""
    bits32 = jax.lax.bitcast_convert_type(w.astype(jnp.float32), jnp.uint32)
    return jax.lax.bitcast_convert_type(_high(bits32).astype(jnp.uint16), jnp.bfloat16)


def split(w: jax.Array, bits: int = 16) -> tuple[jax.Array, jax.Array]:
    """``(bf16 part, remainder)`` of fp32 ``w``: :func:`join` rebuilds ``w`` bit for bit with
    ``bits=16`` (int16 remainder), to under 2^-15 relative with ``bits=8`` (int8).

    ``w`` passes an optimization barrier first, so XLA splits it as a materialized fp32 array:
    on an H200 (jax 0.11.2, 2026-12-02) XLA returned all-zero remainders (correct BF16 parts)
    for a split fused with the arithmetic that produced ``w`` (``jit(lambda w: split(w *
    1.0001))``), and exact ones for a ``w`` read from memory. Inside a Pallas kernel use
    :func:`split_bits` (the same integer arithmetic, no barrier)."""
    return split_bits(jax.lax.optimization_barrier(w), bits)


def split_bits(w: jax.Array, bits: int = 16) -> tuple[jax.Array, jax.Array]:
    """:func:`split`'s integer arithmetic on the bits of ``w``, without its barrier (for kernel
    bodies, which read ``w`` from registers)."""
    dtype = remainder_dtype(bits)
    bits32 = jax.lax.bitcast_convert_type(w.astype(jnp.float32), jnp.uint32)
    high = _high(bits32)
    r = jax.lax.bitcast_convert_type(bits32 - (high << 16), jnp.int32)  # in [-2^15, 2^15)
    if bits == 8:  # nearest multiple of 2^8, ties up; integer ops only (Triton has no round)
        r = jnp.minimum((r + 128) >> 8, 127)
    hi = jax.lax.bitcast_convert_type(high.astype(jnp.uint16), jnp.bfloat16)
    return hi, r.astype(dtype)


def join(hi: jax.Array, remainder: jax.Array) -> jax.Array:
    """The fp32 weight of a BF16 part and its :func:`split` remainder (int16 or int8)."""
    bits = remainder_bits(remainder.dtype)
    high = jax.lax.bitcast_convert_type(hi.astype(jnp.bfloat16), jnp.uint16).astype(jnp.uint32)
    r = remainder.astype(jnp.int32)
    if bits == 8:
        r = r * 256
    bits32 = (high << 16) + jax.lax.bitcast_convert_type(r, jnp.uint32)  # wraps mod 2^32
    return jax.lax.bitcast_convert_type(bits32, jnp.float32)
