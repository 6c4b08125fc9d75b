r"""FP8 quantized arrays: a pytree container and the reference quantize / dequantize.

Granularities:

* **per tensor**: one ``amax`` for the whole array; ``data`` keeps the array's shape.
* **per group along the last axis**: the last axis (length ``L``) is cut into
  ``n = ceil(L / group_size)`` groups of ``ceil(L / n) <= group_size`` elements, zero-padded at
  the end. ``data`` has shape ``(*lead, n, size)`` and ``amax`` has ``(*lead, n)``, so the
  quantized array keeps the original leading shape and shards like the original. Balanced
  groups waste at most ``n - 1`` padding elements per row (a last axis of 130 with
  ``group_size=128`` gives 2 groups of 65, not 2 of 128).

Plain scaling maps a group to :math:`q = x \cdot q_{max} / a_{max}` and back with
:math:`x = q \cdot a_{max} / q_{max}`; with dynamic range expansion (:mod:`coat_jax.core.expansion`)
:math:`q = \mathrm{sign}(x)\, q_{max} (|x| / a_{max})^k` and ``k`` is stored per group.

Error bound (tested): in the scaled domain the error is the format's rounding error,
``|q - q_true| <= 2^-(m+1) max(|q_true|, smallest_normal)`` (:meth:`Fp8Format.rounding_bound`),
which for plain scaling is a relative error of 2^-4 (E4M3) or 2^-3 (E5M2) above
``amax * smallest_normal / max`` and an absolute error below it.

The scale convention is ``amax`` (fp32): ``scale = amax / fmt.max`` is derived. Storing
``amax`` makes a group of equal magnitudes round-trip exactly.
"""

from __future__ import annotations

import dataclasses
import operator

import jax
import jax.numpy as jnp
import numpy as np

from coat_jax.core import expansion
from coat_jax.core.formats import Fp8Format, get_format

__all__ = [
    "QuantizedArray",
    "decode",
    "dequantize",
    "encode",
    "finite_amax",
    "from_groups",
    "from_param_layout",
    "group_layout",
    "param_layout",
    "pow2_amax",
    "quantize",
    "scales_shape",
    "to_groups",
]


@dataclasses.dataclass(frozen=True)
class QuantizedArray:
    """An FP8 array with its scales; a pytree that passes through jit, vmap and orbax.

    Attributes:
      data: FP8 codes. Per tensor: the original shape. Per group: ``(*lead, n_groups, size)``.
      amax: fp32 ``max |x|`` per tensor (shape ``()``) or per group (``(*lead, n_groups)``).
      k: uint8 code ``16 k`` of the expansion exponent, shaped like ``amax``; ``None`` when the
        array is not range-expanded.
      last_dim: static; the original length of the last axis for the per-group layout, ``None``
        per tensor.
    """

    data: jax.Array
    amax: jax.Array
    k: jax.Array | None = None
    last_dim: int | None = None

    @property
    def fmt(self) -> Fp8Format:
        return get_format(self.data.dtype)

    @property
    def per_group(self) -> bool:
        return self.last_dim is not None

    @property
    def expanded(self) -> bool:
        return self.k is not None

    @property
    def scale(self) -> jax.Array:
        """Dequantization multiplier ``amax / fmt.max`` of plain scaling."""
        return self.amax / self.fmt.max

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the array this represents."""
        if not self.per_group:
            return tuple(self.data.shape)
        return (*self.data.shape[:-2], self.last_dim)

    @property
    def nbytes(self) -> int:
        """Bytes stored: codes, scales and exponents."""
        leaves = jax.tree.leaves(self)
        return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in leaves)


jax.tree_util.register_dataclass(
    QuantizedArray, data_fields=["data", "amax", "k"], meta_fields=["last_dim"]
)


def group_layout(last_dim: int, group_size: int) -> tuple[int, int]:
    """``(n_groups, size)`` of the balanced per-group layout of a last axis of ``last_dim``."""
    if last_dim == 0:
        return 0, 1
    n_groups = -(-last_dim // group_size)
    return n_groups, -(-last_dim // n_groups)


def scales_shape(shape, group_size: int) -> tuple[int, ...]:
    """Shape of the per-group ``amax`` / ``k`` of an array of ``shape`` grouped along its last
    axis: ``(*shape[:-1], n_groups)``; ``()`` for a 0-d shape."""
    shape = tuple(shape)
    if not shape:
        return ()
    return (*shape[:-1], group_layout(shape[-1], group_size)[0])


def to_groups(x: jax.Array, group_size: int) -> jax.Array:
    """Zero-pads the last axis and reshapes it to ``(n_groups, size)``."""
    n_groups, size = group_layout(x.shape[-1], group_size)
    pad = n_groups * size - x.shape[-1]
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x.reshape(*x.shape[:-1], n_groups, size)


def from_groups(x: jax.Array, last_dim: int) -> jax.Array:
    """Inverse of :func:`to_groups`."""
    flat = x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])
    return flat if flat.shape[-1] == last_dim else flat[..., :last_dim]


def _check_group_size(group_size) -> int:
    if isinstance(group_size, bool):
        raise TypeError(f"group_size must be a positive int, got {group_size!r}")
    try:
        group_size = operator.index(group_size)
    except TypeError:
        raise TypeError(
            f"group_size must be a static positive int, got {type(group_size).__name__}"
        ) from None
    if group_size <= 0:
        raise ValueError(f"group_size must be positive, got {group_size}")
    return group_size


def quantize(
    x: jax.Array,
    fmt: str | Fp8Format = "e4m3",
    *,
    group_size: int | None = None,
    expand: bool = False,
    amax: jax.Array | None = None,
) -> QuantizedArray:
    """Quantizes ``x`` to FP8 per tensor (``group_size=None``) or per group of the last axis.

    Args:
      x: a floating-point array.
      fmt: ``"e4m3"``, ``"e5m2"`` or an :class:`Fp8Format`.
      group_size: largest group along the last axis; ``None`` scales the whole tensor at once.
      expand: apply dynamic range expansion per group (per tensor when ``group_size=None``).
      amax: use this ``max |x|`` (shaped like the result's ``amax``) instead of measuring it,
        e.g. to requantize a recomputed tensor exactly as before; plain scaling only.

    Returns:
      A :class:`QuantizedArray`; :func:`dequantize` inverts it.

    Raises:
      TypeError: ``x`` is not floating point, or ``group_size`` is not an int.
      ValueError: unknown format, ``group_size <= 0``, or per-group on a 0-d array.
    """
    fmt = get_format(fmt)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"quantize needs a floating-point array, got dtype {x.dtype}")
    last_dim = None
    if group_size is not None:
        group_size = _check_group_size(group_size)
        if x.ndim == 0:
            raise ValueError("per-group quantization needs an array with at least one axis")
        last_dim = x.shape[-1]
        x = to_groups(x, group_size)
    if amax is not None and expand:
        raise ValueError("quantize: a given amax is only supported without expansion")
    codes, amax, k_code = encode(x, fmt, expand, per_group=group_size is not None, amax=amax)
    return QuantizedArray(codes, amax, k_code, last_dim)


def zeros(shape, fmt: str | Fp8Format, group_size: int, expand: bool = False) -> QuantizedArray:
    """``quantize(jnp.zeros(shape), fmt, group_size=group_size, expand=expand)``, built from one
    zero group broadcast to the layout: no reduction over a large constant for XLA to fold
    (folding those made a jitted optimizer init of a 7B model take minutes to compile)."""
    fmt = get_format(fmt)
    group_size = _check_group_size(group_size)
    size = group_layout(shape[-1], group_size)[1]
    codes, amax, k = encode(jnp.zeros((size,), jnp.float32), fmt, expand)
    lead = scales_shape(shape, group_size)
    fill = lambda v: jnp.broadcast_to(v, lead)
    return QuantizedArray(
        jnp.zeros((*lead, size), codes.dtype), fill(amax), None if k is None else fill(k), shape[-1]
    )


TINY_AMAX = 2.0**-64
"""Group maxima below this are scaled up by 2^64 before ``fmax / amax`` (see :func:`encode`)."""


def finite_amax(x, axis=None, keepdims: bool = False) -> jax.Array:
    """``max |x|`` over the finite elements along ``axis`` (all by default), fp32; 0 where none
    is. Comparisons only (a kernel-friendly ``isfinite``): the Pallas kernels call it on tiles."""
    a = jnp.abs(x.astype(jnp.float32))
    return jnp.max(jnp.where(a < jnp.inf, a, 0.0), axis=axis, keepdims=keepdims)


def pow2_amax(amax, fmt: str | Fp8Format) -> jax.Array:
    r"""The smallest :math:`q_{max} 2^k \ge a_{max}`: ``amax`` with its scale rounded up to a
    power of two.

    Quantizing with it, :math:`q = x \cdot 2^{-k}` and ``scale = 2^k`` are exact in fp32, so a
    product of two such operands' codes times their scales rounds only where the GEMM rounds
    (a BF16 GEMM product scaled afterwards equals the fp32 product scaled and rounded once).
    The codes use at most half the format's range less at the top (E4M3 flushes to zero below
    ``2^-9 scale`` instead of ``2^-9 amax / 448``, at most a factor 2). Idempotent; 0 stays 0,
    and where ``amax / fmt.max`` is below fp32's normal range (``amax < 5e-36`` for E4M3) or the
    power of two would overflow fp32, ``amax`` is left as it is (exact scaling).
    """
    fmt = get_format(fmt)
    amax = jnp.asarray(amax, jnp.float32)
    ratio = amax / np.float32(fmt.max)
    bits = jax.lax.bitcast_convert_type(ratio, jnp.int32)
    exponent, mantissa = bits & 0x7F800000, bits & 0x007FFFFF
    # a power of two already, or the next one up: the exponent field plus one
    up = jnp.where(mantissa == 0, exponent, exponent + 0x00800000)
    out = np.float32(fmt.max) * jax.lax.bitcast_convert_type(up, jnp.float32)
    out = jnp.where(out < amax, out * 2, out)  # the division's rounding fell to a power of two
    normal = ratio >= np.float32(np.finfo(np.float32).tiny)
    return jnp.where(normal & (out < np.float32(np.inf)), out, amax)


def encode(x, fmt: Fp8Format, expand: bool, *, per_group: bool = True, amax=None,
           log=jnp.log, exp2=jnp.exp2):  # fmt: skip
    """The scaling math of :func:`quantize` on an array already laid out in groups.

    With ``per_group`` the groups run along the last axis, else the whole array is one group.
    Returns ``(codes, amax, k code or None)``. A NaN or +-Inf element is stored as the format's
    NaN code and left out of its group's statistics: it stays non-finite, its neighbours keep
    their precision. The Pallas kernels call this on their tiles, so kernel and reference cannot
    drift apart (``log`` / ``exp2``: the natural log and power of two the expansion takes per
    element).
    """
    axes = -1 if per_group else tuple(range(x.ndim))
    bcast = (..., None) if per_group else ()
    x = x.astype(jnp.float32)

    def cast(scaled, nan_where_not_finite):
        # the marker is 0, or NaN where x is not finite: added after the clip (Triton's clip
        # drops NaN), it marks non-finite elements without a mask (a select that XLA's GPU
        # fusion materialised as an extra array, 30% slower)
        marked = jnp.clip(scaled, -fmt.max, fmt.max) + nan_where_not_finite
        return marked.astype(fmt.dtype)

    if expand:
        amax, amin = expansion.group_range(x, axis=axes)
        k = expansion.expansion_exponent(amax, amin, fmt, log=log)
        scaled = expansion.expanded_encode(x, amax[bcast], k[bcast], fmt, log=log, exp2=exp2)
        return cast(scaled, x - x), amax, expansion.encode_k(k)
    if amax is None:
        amax = finite_amax(x, axis=axes)
    amax = jnp.asarray(amax, jnp.float32)
    # fmax / amax per group, then a product: XLA turns a division by a broadcast scale
    # into a product with its reciprocal, which flushes to zero for amax > 2^126. Below
    # TINY_AMAX, fmax / amax would overflow fp32 (amax < fmax / 3.4e38): x and amax are first
    # scaled up by 2^64 (exact; 1 elsewhere, so the common case is unchanged bit for bit).
    safe = jnp.where(amax > 0, amax, 1.0)
    pre = jnp.where(safe < TINY_AMAX, np.float32(2.0**64), np.float32(1.0))
    factor = fmt.max / (safe * pre)
    scaled = (x * pre[bcast]) * factor[bcast]
    # scaled - scaled, not x - x: a finite x scales to at most fmt.max (amax is its finite
    # maximum), and a third read of x made XLA materialise a transposed fp32 copy of each
    # weight before its quantize fusion (7B FP8-linear step 6% slower on an H200, 2026-12-04)
    return cast(scaled, scaled - scaled), amax, None


def decode(codes, amax, k, fmt: Fp8Format, *, per_group: bool = True, log=jnp.log,
           exp2=jnp.exp2):  # fmt: skip
    """The inverse math of :func:`encode` (fp32), on codes laid out in groups."""
    codes = codes.astype(jnp.float32)
    bcast = (..., None) if per_group else ()
    if k is not None:
        k = expansion.decode_k(k)[bcast]
        return expansion.expanded_decode(codes, amax[bcast], k, fmt, log=log, exp2=exp2)
    # As in encode, a group maximum below TINY_AMAX is scaled up by 2^64 and the product back
    # down: under jit XLA folds (codes / fmax) * amax into codes * (amax / fmax), which is
    # subnormal there and flushed to zero (found by tests/test_quant.py's property tests).
    amax = jnp.asarray(amax, jnp.float32)[bcast]
    pre = jnp.where(amax < TINY_AMAX, np.float32(2.0**64), np.float32(1.0))
    return ((codes / fmt.max) * (amax * pre)) * (1.0 / pre)


def dequantize(q: QuantizedArray, dtype=jnp.float32) -> jax.Array:
    """Returns the array ``q`` represents, in ``dtype`` (math in fp32)."""
    x = decode(q.data, q.amax, q.k, q.fmt, per_group=q.per_group)
    if q.per_group:
        x = from_groups(x, q.last_dim)
    return x.astype(dtype)


def param_layout(q: QuantizedArray) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """``(codes, amax, k)`` of a per-group array with the codes in the array's own shape.

    The optimizer states keep this layout: codes shaped like their parameter (so any
    ``PartitionSpec`` of the parameter applies to them), ``amax`` / ``k`` shaped
    ``(*lead, n_groups)``. :func:`from_param_layout` inverts it.
    """
    if not q.per_group:
        raise ValueError("param_layout needs a per-group QuantizedArray")
    return from_groups(q.data, q.last_dim), q.amax, q.k


def from_param_layout(codes: jax.Array, amax: jax.Array, k: jax.Array | None) -> QuantizedArray:
    """The :class:`QuantizedArray` of codes in their array's shape and per-group ``amax`` /
    ``k`` of shape ``(*lead, n_groups)``; the group size follows from the two shapes."""
    last_dim, n_groups = codes.shape[-1], amax.shape[-1]
    size = -(-last_dim // n_groups) if n_groups else 1
    if codes.shape[:-1] != amax.shape[:-1] or n_groups * size - last_dim >= max(size, 1):
        raise ValueError(
            f"codes of shape {codes.shape} do not split into the {n_groups} groups of amax "
            f"{amax.shape}"
        )
    pad = n_groups * size - last_dim
    if pad:
        codes = jnp.pad(codes, [(0, 0)] * (codes.ndim - 1) + [(0, pad)])
    return QuantizedArray(codes.reshape(*codes.shape[:-1], n_groups, size), amax, k, last_dim)
