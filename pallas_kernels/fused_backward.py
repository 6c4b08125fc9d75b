r"""An element-wise op's backward from its FP8-saved inputs, in one pass: COAT's SwiGLU backward.

COAT's SwiGLU op ``h = f(g, u)`` (:func:`coat_jax.ops.flow.fp8_swiglu_project`) saves its
inputs as FP8 1x16 groups and multiplies ``h`` by the down projection. Its backward needs two
things from those saved inputs, both element-wise: ``h`` again, quantized per tensor with the
forward's ``amax`` (the weight-gradient GEMM's operand, the forward's codes exactly), and the
input gradients ``f``'s vector-Jacobian product gives from the down projection's input gradient
``dh``. Written as XLA ops, the dequantized inputs were written in BF16 between the fusions
that read them (a 2-layer 7B profile on an H100: 0.12 ms a tensor a layer, beside 0.36 ms for
the gradients' fusion). Here one kernel over row tiles reads the saved codes, their group
maxima and ``dh``, and writes

.. math::
    h_q = Q_{a_h}(f(Q^{-1}(g_q), Q^{-1}(u_q))), \qquad
    (\bar g, \bar u) = \mathrm{vjp}_f(Q^{-1}(g_q), Q^{-1}(u_q))(dh), \qquad
    m_{\bar x} = \max_{\text{tile}} |\bar x| \ (\text{finite elements})

(``a_h`` the forward's ``amax`` of ``h``): the per-tile maxima of the gradients, reduced by a
tiny ``max`` afterwards, are what their per-tensor E5M2 scales need, so no pass over them
measures it again. Traffic per element: ``1.25`` per saved input and ``2`` for ``dh`` read,
``1`` for ``h_q`` and ``2`` per gradient written.

Codes, gradients and maxima are those of the jnp reference
(:func:`operand_and_grads_reference`, what :mod:`coat_jax.ops.flow` computes without the
kernel): both trace :mod:`coat_jax.core.quant`'s ``decode`` / ``encode``, the same ``f`` and
JAX's own ``vjp`` of it. Shapes the kernel cannot tile fall back to the reference without
error. Pallas with the Triton backend, as :mod:`pallas_kernels.fused_quantize`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from coat_jax.core.formats import Fp8Format
from coat_jax.core.quant import QuantizedArray, decode, dequantize, encode, finite_amax, quantize
from pallas_kernels import dispatch
from pallas_kernels.tiling import block_shape

__all__ = ["FusedBackwardTuning", "operand_and_grads", "operand_and_grads_reference"]


@dataclasses.dataclass(frozen=True)
class FusedBackwardTuning:
    """Tile and launch knobs (block dims powers of two)."""

    block_rows: int = 16
    block_cols: int = 1024
    num_warps: int = 8
    num_stages: int = 1


def operand_and_grads_reference(saved: tuple[QuantizedArray, ...], dy: jax.Array, fn: Callable,
                                *, operand_fmt: Fp8Format, operand_amax: jax.Array):  # fmt: skip
    """``(y quantized per tensor with operand_amax, input gradients, their finite maxima)`` of
    ``y = fn(dequantized saved inputs)`` for the output gradient ``dy``; the inputs are
    dequantized to ``dy.dtype`` and their gradients come in it."""
    xs = tuple(dequantize(q, dy.dtype) for q in saved)
    y, vjp = jax.vjp(fn, *xs)
    grads = tuple(g.astype(dy.dtype) for g in vjp(dy))
    return quantize(y, operand_fmt, amax=operand_amax), grads, tuple(map(finite_amax, grads))


def operand_and_grads(
    saved: tuple[QuantizedArray, ...],
    dy: jax.Array,
    fn: Callable,
    *,
    operand_fmt: Fp8Format,
    operand_amax: jax.Array,
    tuning: FusedBackwardTuning = FusedBackwardTuning(),
    interpret: bool = False,
    amax_of: Callable | None = None,
) -> tuple[QuantizedArray, tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """The kernel's twin of :func:`operand_and_grads_reference` on matrices ``(rows, cols)``.

    Args:
      saved: the op's inputs as per-group :class:`QuantizedArray` of matrices (codes
        ``(rows, cols // group, group)``, maxima ``(rows, cols // group)``), one format.
      dy: the output gradient ``(rows, cols)``; its dtype is the inputs' and gradients'.
      fn: the element-wise op on tiles; returns ``dy.dtype``.
      operand_fmt: format of ``y``'s per-tensor codes.
      operand_amax: the ``amax`` ``y`` is quantized with (the forward's).
      tuning: tile and launch knobs.
      interpret: run the kernel in Pallas interpret mode (any backend).
      amax_of: each gradient's ``amax`` from the maximum of its tile maxima (on one shard of a
        tensor split over devices: a ``pmax`` over them).
    """
    dispatch.check_compiled(interpret, "pallas_kernels.fused_backward")
    n, (rows, cols), dtype = len(saved), dy.shape, dy.dtype
    fmt, group = saved[0].fmt, saved[0].data.shape[-1]
    blocks = block_shape(rows, cols, group, tuning.block_rows, tuning.block_cols) if rows else None
    if blocks is None or any(q.k is not None or q.last_dim != cols for q in saved):
        yq, grads, maxima = operand_and_grads_reference(saved, dy, fn, operand_fmt=operand_fmt,
                                                        operand_amax=operand_amax)  # fmt: skip
        return yq, grads, maxima if amax_of is None else tuple(map(amax_of, maxima))
    br, bc = blocks
    grid = (rows // br, cols // bc)
    tile = pl.BlockSpec((br, bc), lambda i, j: (i, j))
    group_tile = pl.BlockSpec((br, bc // group), lambda i, j: (i, j))
    scalar = pl.BlockSpec((1, 1), lambda i, j: (0, 0))
    tile_max = pl.BlockSpec((1, 1), lambda i, j: (i, j))

    def kernel(*refs):
        c_refs, a_refs, g_refs, m_refs = refs[:n], refs[n : 2 * n], refs[-2 * n : -n], refs[-n:]
        dy_ref, amax_ref, y_ref = refs[2 * n : 2 * n + 3]
        xs = []
        for c_ref, a_ref in zip(c_refs, a_refs, strict=True):
            x = decode(c_ref[...].reshape(br, bc // group, group), a_ref[...], None, fmt)
            xs.append(x.reshape(br, bc).astype(dtype))
        y, vjp = jax.vjp(fn, *xs)
        y_ref[...] = encode(y, operand_fmt, False, per_group=False, amax=amax_ref[0, 0])[0]
        for g, g_ref, m_ref in zip(vjp(dy_ref[...]), g_refs, m_refs, strict=True):
            g = g.astype(dtype)
            g_ref[...] = g
            m_ref[...] = finite_amax(g, keepdims=True).reshape(1, 1)

    matrix = lambda dt: jax.ShapeDtypeStruct((rows, cols), dt)
    y_codes, *outs = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[tile] * n + [group_tile] * n + [tile, scalar],
        out_specs=[tile] * (n + 1) + [tile_max] * n,
        out_shape=[matrix(operand_fmt.dtype)] + [matrix(dtype)] * n
        + [jax.ShapeDtypeStruct(grid, jnp.float32)] * n,
        compiler_params=pl_triton.CompilerParams(num_warps=tuning.num_warps,
                                                 num_stages=tuning.num_stages),  # fmt: skip
        interpret=interpret,
    )(*(q.data.reshape(rows, cols) for q in saved), *(q.amax for q in saved), dy,
      jnp.asarray(operand_amax, jnp.float32).reshape(1, 1))  # fmt: skip
    grads, partial_maxima = tuple(outs[:n]), outs[n:]
    maxima = tuple(jnp.max(m) for m in partial_maxima)
    if amax_of is not None:
        maxima = tuple(map(amax_of, maxima))
    return QuantizedArray(y_codes, jnp.asarray(operand_amax, jnp.float32)), grads, maxima
