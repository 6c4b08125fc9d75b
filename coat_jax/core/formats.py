"""FP8 formats as small frozen descriptors, and the saturating cast into them.

Two formats of the OCP FP8 specification are used (as ``ml_dtypes`` / ``jnp`` dtypes):

========  ==========================  ========  ==============  ====================
name      dtype                       max       smallest normal  smallest subnormal
========  ==========================  ========  ==============  ====================
``e4m3``  ``jnp.float8_e4m3fn``       448       2^-6            2^-9
``e5m2``  ``jnp.float8_e5m2``         57344     2^-14           2^-16
========  ==========================  ========  ==============  ====================

Rounding to nearest gives, for a value ``s`` already scaled into the format's range,
``|s - round(s)| <= 2^-(m+1) * max(|s|, smallest_normal)`` with ``m`` mantissa bits
(:meth:`Fp8Format.rounding_bound`). Values beyond ``max`` must be clipped before the cast:
``float8_e4m3fn`` has no infinity and turns them into NaN.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes

__all__ = ["E4M3", "E5M2", "Fp8Format", "get_format", "saturating_cast"]


@dataclasses.dataclass(frozen=True)
class Fp8Format:
    """An FP8 number format.

    Attributes:
      name: short name, ``"e4m3"`` or ``"e5m2"``.
      dtype: the JAX dtype that stores it.
      max: largest finite magnitude.
      smallest_normal: smallest positive normal magnitude.
      mantissa_bits: explicit mantissa bits (3 or 2).
    """

    name: str
    dtype: jnp.dtype
    max: float
    smallest_normal: float
    mantissa_bits: int

    @property
    def expansion_target_range(self) -> float:
        """Max/min ratio that dynamic range expansion aims for: ``max**2 / 2``.

        This is the reference implementation's ``448**2 / 2`` for E4M3, applied to each format.
        """
        return self.max * self.max / 2.0

    def rounding_bound(self, scaled: jax.Array) -> jax.Array:
        """Largest rounding error of a value already scaled into ``[-max, max]``."""
        half_ulp = 2.0 ** -(self.mantissa_bits + 1)
        return half_ulp * jnp.maximum(jnp.abs(scaled), self.smallest_normal)


def _format(name: str, dtype) -> Fp8Format:
    info = ml_dtypes.finfo(dtype)
    return Fp8Format(
        name=name,
        dtype=jnp.dtype(dtype),
        max=float(info.max),
        smallest_normal=float(info.smallest_normal),
        mantissa_bits=int(info.nmant),
    )


E4M3 = _format("e4m3", jnp.float8_e4m3fn)
E5M2 = _format("e5m2", jnp.float8_e5m2)
_BY_NAME = {E4M3.name: E4M3, E5M2.name: E5M2}
_BY_DTYPE = {E4M3.dtype: E4M3, E5M2.dtype: E5M2}


def get_format(spec: str | Fp8Format | jnp.dtype) -> Fp8Format:
    """Returns the format named by ``spec`` (a name, a descriptor or an FP8 dtype).

    Raises:
      ValueError: ``spec`` names no supported FP8 format.
    """
    if isinstance(spec, Fp8Format):
        return spec
    if isinstance(spec, str):
        fmt = _BY_NAME.get(spec.lower())
        if fmt is None:
            raise ValueError(f"unknown FP8 format {spec!r}; expected one of {sorted(_BY_NAME)}")
        return fmt
    try:
        return _BY_DTYPE[jnp.dtype(spec)]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown FP8 format {spec!r}; expected one of {sorted(_BY_NAME)} or their dtypes"
        ) from None


def saturating_cast(scaled: jax.Array, fmt: Fp8Format) -> jax.Array:
    """Clips to ``[-fmt.max, fmt.max]`` and casts (round to nearest even).

    NaN stays NaN under XLA; Triton lowers the clip to fmin / fmax, which drop NaN, so a
    kernel that must keep NaN marks it after the clip (:func:`coat_jax.core.quant.encode`).
    """
    return jnp.clip(scaled, -fmt.max, fmt.max).astype(fmt.dtype)
