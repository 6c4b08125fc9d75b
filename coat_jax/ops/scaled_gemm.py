r"""FP8 GEMMs with finer scales than one per tensor: per row, and DeepSeek-V3's blocks.

A GEMM operand is a matrix ``(R, K)`` with its contracted axis ``K`` last (K-major). Its FP8
codes are scaled per **group** of ``K``: the groups of :func:`coat_jax.core.quant.group_layout`
(``n = ceil(K / g)`` balanced groups of at most ``g`` elements), and an operand is stored as a
per-group :class:`~coat_jax.core.quant.QuantizedArray` (``data (R, n, size)``, ``amax (R, n)``).
Two operands that share the group layout of ``K`` multiply as

.. math::

   C_{mn} = \sum_{j} s^a_{mj}\, s^b_{nj} \sum_{k \in \text{group } j} q^a_{mk}\, q^b_{nk},
   \qquad s = a_{max} / q_{max},

each group's partial sum leaving the FP8 product in fp32 and scaled there ("fp32 promotion"
every ``g`` of ``K``: the reduced-precision accumulation of a tensor core never spans more than
one group). The scaling granularities of :class:`~coat_jax.core.recipe.Fp8Recipe` ``scaling``:

==========  ======================================  ======================================
scaling     activations and output gradients        weights
==========  ======================================  ======================================
``row``     one scale per row (``g = K``)           one scale per output channel (``g = K``)
``block``   1x128 tiles (``g = 128``)               128x128 blocks: the tile maxima of 128
                                                    rows share one scale (DeepSeek-V3)
==========  ======================================  ======================================

``row`` is one FP8 GEMM whose output is scaled by an outer product (no promotion inside K);
``block`` contracts ``n`` groups. The weight-gradient GEMM ``X^T dY`` contracts tokens, so its
operands are ``X^T`` and ``dY^T`` quantized along the token axis (128x1 tiles of ``X`` and
``dY`` in DeepSeek-V3's terms).

Rows whose group maximum is 0 get codes 0 (as :func:`coat_jax.core.quant.quantize`); a NaN or Inf
element stays non-finite in the product.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from coat_jax.core.formats import Fp8Format
from coat_jax.core.quant import QuantizedArray, dequantize, encode, finite_amax, to_groups

__all__ = ["BLOCK", "OPERAND_ROLES", "dequantize_operand", "quantize_operand", "scaled_matmul"]

BLOCK = 128
"""Tile length along ``K`` and block height of weights of ``scaling="block"``."""

OPERAND_ROLES = ("activation", "weight")

_PROMOTION_BYTES = 1 << 28
"""Largest fp32 buffer of per-group partial products (``n x M x N``) contracted at once; more
groups than fit are contracted in chunks (a loop) so that memory stays bounded."""


def _group_size(scaling: str, k: int) -> int:
    if scaling == "row":
        return max(k, 1)
    if scaling == "block":
        return BLOCK
    raise ValueError(f"scaling={scaling!r}: expected 'row' or 'block' (per tensor is fp8_gemm's)")


def quantize_operand(x: jax.Array, fmt: Fp8Format, scaling: str, role: str) -> QuantizedArray:
    """FP8 codes and scales of a GEMM operand ``x (R, K)`` (contracted axis last).

    Args:
      x: the operand, any float dtype; ``K`` is its last axis.
      fmt: FP8 format.
      scaling: ``"row"`` or ``"block"`` (module docstring).
      role: ``"activation"`` (activations and gradients: one scale per row and group) or
        ``"weight"`` (with ``"block"``: one scale per 128 rows and group; with ``"row"`` the
        same as an activation).

    Returns:
      A per-group :class:`QuantizedArray` (``data (R, n, size)``, ``amax (R, n)``: for weight
      blocks every row carries its block's maximum).
    """
    if x.ndim != 2:
        raise ValueError(f"quantize_operand needs a matrix (R, K), got shape {x.shape}")
    if role not in OPERAND_ROLES:
        raise ValueError(f"role={role!r}: expected one of {OPERAND_ROLES}")
    groups = to_groups(x.astype(jnp.float32), _group_size(scaling, x.shape[-1]))
    amax = finite_amax(groups, axis=-1)
    if role == "weight" and scaling == "block":
        amax = _block_max(amax, BLOCK)
    codes, amax, _ = encode(groups, fmt, False, per_group=True, amax=amax)
    return QuantizedArray(codes, amax, None, x.shape[-1])


def _block_max(amax: jax.Array, rows: int) -> jax.Array:
    """Row maxima ``(R, n)`` -> the maximum over each run of ``rows`` rows, repeated per row."""
    r = amax.shape[0]
    blocks = -(-r // rows)
    padded = jnp.pad(amax, ((0, blocks * rows - r), (0, 0)))
    block = jnp.max(padded.reshape(blocks, rows, -1), axis=1)
    return jnp.repeat(block, rows, axis=0)[:r]


def scaled_matmul(
    a: QuantizedArray, b: QuantizedArray, out_dtype=jnp.float32, *,
    partials_in_out_dtype: bool = False,
) -> jax.Array:  # fmt: skip
    """``C (M, N)`` of operands ``a (M, K)`` and ``b (N, K)`` from :func:`quantize_operand`
    with the same group layout of ``K``: each group's FP8 product in fp32, scaled by
    ``s^a_{mj} s^b_{nj}`` and summed in fp32 (module docstring).

    ``partials_in_out_dtype``: the contraction that sums over ``K`` (the GEMM for row scales,
    the sum over groups for blocks contracted in one chunk) emits ``out_dtype``, so that the
    partial sums of a sharded ``K`` are reduced across devices in ``out_dtype``
    (:func:`coat_jax.ops.flow.fp8_gemm`); row scales then multiply after one rounding to it."""
    if not (a.per_group and b.per_group) or a.data.ndim != 3 or b.data.ndim != 3:
        raise ValueError("scaled_matmul needs two grouped operands from quantize_operand")
    if a.data.shape[1:] != b.data.shape[1:] or a.last_dim != b.last_dim:
        raise ValueError(
            f"scaled_matmul: operands group K differently: {a.data.shape} vs {b.data.shape}"
        )
    sa, sb = a.scale, b.scale  # (M, n), (N, n)
    (m, n, _), nb = a.data.shape, b.data.shape[0]
    partial_dtype = out_dtype if partials_in_out_dtype else jnp.float32
    if n == 1:
        out = jax.lax.dot_general(
            a.data[:, 0], b.data[:, 0], (((1,), (1,)), ((), ())),
            preferred_element_type=partial_dtype,
        ).astype(jnp.float32)  # fmt: skip
        return (out * sa[:, 0, None] * sb[None, :, 0]).astype(out_dtype)
    chunk = max(1, min(n, _PROMOTION_BYTES // max(4 * m * nb, 1)))
    steps = -(-n // chunk)
    pad = steps * chunk - n
    ca, cb = a.data, b.data
    if pad:  # zero codes and scales add nothing
        ca = jnp.pad(ca, ((0, 0), (0, pad), (0, 0)))
        cb = jnp.pad(cb, ((0, 0), (0, pad), (0, 0)))
        sa, sb = jnp.pad(sa, ((0, 0), (0, pad))), jnp.pad(sb, ((0, 0), (0, pad)))

    def part(i, dtype=jnp.float32):
        sl = lambda t: jax.lax.dynamic_slice_in_dim(t, i * chunk, chunk, axis=1)
        prod = jax.lax.dot_general(
            sl(ca), sl(cb), (((2,), (2,)), ((1,), (1,))), preferred_element_type=jnp.float32
        )  # (chunk, M, N): one fp32 product per group
        # HIGHEST: on a GPU an fp32 einsum at default precision runs as TF32 (10-bit
        # mantissas), which would undo the fp32 promotion this sum is for
        return jnp.einsum("jmn,mj,nj->mn", prod, sl(sa), sl(sb), preferred_element_type=dtype,
                          precision=jax.lax.Precision.HIGHEST)  # fmt: skip

    if steps == 1:
        return part(0, partial_dtype).astype(out_dtype)
    total = jax.lax.fori_loop(1, steps, lambda i, acc: acc + part(i), part(0))
    return total.astype(out_dtype)


def dequantize_operand(q: QuantizedArray) -> jax.Array:
    """The fp32 matrix ``(R, K)`` an operand represents (for error reports and tests)."""
    return dequantize(q, jnp.float32)
