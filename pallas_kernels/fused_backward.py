r"""A COAT op's backward from its FP8-saved inputs, in one pass: SwiGLU's and the norms'.

COAT's SwiGLU and norm-project ops (:mod:`coat_jax.ops.flow`) save the inputs of ``y = f(x,
...)`` as FP8 1x16 groups and multiply ``y`` by the next projection's weights. Their backward
needs two things from those saved inputs: ``y`` again, quantized per tensor with the forward's
``amax`` (the weight-gradient GEMM's operand, the forward's codes exactly), and the input
gradients ``f``'s vector-Jacobian product gives from that projection's input gradient ``dy``
(and, for an RMSNorm, its weight's). Written as XLA ops, the dequantized inputs were written
in BF16 between the fusions that read them (a 2-layer 7B profile on an H100: 0.12 ms a tensor
a layer for SwiGLU's, beside 0.36 ms for its gradients' fusion). Here one kernel over row tiles
(whole rows for a norm) reads the saved codes, their group maxima, the weight and ``dy``, and
writes

.. math::
    y_q = Q_{a_y}(f(Q^{-1}(x_q), w)), \qquad
    (\bar x, \bar w_{\text{tile}}) = \mathrm{vjp}_f(Q^{-1}(x_q), w)(dy), \qquad
    m_{\bar x} = \max_{\text{tile}} |\bar x| \ (\text{finite elements})

(``a_y`` the forward's ``amax`` of ``y``): the per-tile maxima of the gradients, reduced by a
tiny ``max`` afterwards, are what their per-tensor E5M2 scales need (the fused MLP,
:func:`coat_jax.ops.flow.fp8_mlp`, reads them), and the weight's gradient is the sum of the
tiles' fp32 partial sums over their rows. Traffic per element of SwiGLU: ``1.25`` per saved
input and ``2`` for ``dy`` read, ``1`` for ``y_q`` and ``2`` per gradient written.

Codes, gradients and maxima are those of the jnp reference
(:func:`operand_and_grads_reference`, what :mod:`coat_jax.ops.flow` computes without the
kernel): both trace :mod:`coat_jax.core.quant`'s ``decode`` / ``encode``, the same ``f`` and
JAX's own ``vjp`` of it (a norm's means over a tile's rows may be reduced in another order
than over the whole array, and the weight's sums are). Shapes the kernel cannot tile fall back
to the reference without error. Pallas with the Triton backend, as
:mod:`pallas_kernels.fused_quantize`.
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
from pallas_kernels.tiling import block_shape, pow2_divisor

__all__ = ["FusedBackwardTuning", "operand_and_grads", "operand_and_grads_reference"]


@dataclasses.dataclass(frozen=True)
class FusedBackwardTuning:
    """Tile and launch knobs (block dims powers of two; ``max_cols`` bounds whole-row tiles,
    which hold at most ``block_rows x block_cols`` elements; an op with a weight walks
    ``rows_per_program`` rows a program, tile by tile, so that its weight's gradient has one
    fp32 row of partial sums a program)."""

    block_rows: int = 16
    block_cols: int = 1024
    max_cols: int = 8192
    rows_per_program: int = 32
    num_warps: int = 8
    num_stages: int = 1


def operand_and_grads_reference(saved: tuple[QuantizedArray, ...], dy: jax.Array, fn: Callable,
                                extras=(), *, operand_fmt: Fp8Format, operand_amax):  # fmt: skip
    """``(y quantized per tensor with operand_amax, input gradients, their finite maxima,
    the extras' gradients)`` of ``y = fn(dequantized saved inputs..., extras (1, cols)...)``
    for the output gradient ``dy``; the inputs are dequantized to ``dy.dtype`` and their
    gradients come in it, the extras' in theirs (summed over the rows in fp32)."""
    yq, grads, maxima, extra_grads = _reference(saved, dy, fn, extras, operand_fmt, operand_amax)
    extra_grads = tuple(g.astype(e.dtype) for g, e in zip(extra_grads, extras, strict=True))
    return yq, grads, maxima, extra_grads


def _reference(saved, dy, fn, extras, operand_fmt, operand_amax):
    """:func:`operand_and_grads_reference` with the extras' gradients in fp32."""
    xs = tuple(dequantize(q, dy.dtype) for q in saved)
    es = tuple(e.reshape(1, -1).astype(jnp.float32) for e in extras)
    y, vjp = jax.vjp(fn, *xs, *es)
    cots = vjp(dy)
    grads = tuple(g.astype(dy.dtype) for g in cots[: len(xs)])
    extra_grads = tuple(g.reshape(e.shape) for g, e in zip(cots[len(xs) :], extras, strict=True))
    return (quantize(y, operand_fmt, amax=operand_amax), grads, tuple(map(finite_amax, grads)),
            extra_grads)  # fmt: skip


def operand_and_grads(
    saved: tuple[QuantizedArray, ...],
    dy: jax.Array,
    fn: Callable,
    extras: tuple[jax.Array, ...] = (),
    *,
    operand_fmt: Fp8Format,
    operand_amax: jax.Array,
    whole_rows: bool = False,
    tuning: FusedBackwardTuning = FusedBackwardTuning(),
    interpret: bool = False,
    amax_of: Callable | None = None,
    sum_of: Callable | None = None,
) -> tuple[QuantizedArray, tuple[jax.Array, ...], tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """The kernel's twin of :func:`operand_and_grads_reference` on matrices ``(rows, cols)``.

    Args:
      saved: the op's inputs as per-group :class:`QuantizedArray` of matrices (codes
        ``(rows, cols // group, group)``, maxima ``(rows, cols // group)``), one format.
      dy: the output gradient ``(rows, cols)``; its dtype is the inputs' and gradients'.
      fn: the op on tiles; returns ``dy.dtype``.
      extras: vectors ``(cols,)`` ``fn`` reads beside the inputs (a norm's weight), read in
        fp32 by the kernel; their gradients are the sums over the rows of fp32 partial sums
        over each tile's rows, in the extras' dtypes.
      operand_fmt: format of ``y``'s per-tensor codes.
      operand_amax: the ``amax`` ``y`` is quantized with (the forward's).
      whole_rows: ``fn`` reduces over a row (tiles span whole rows).
      tuning: tile and launch knobs.
      interpret: run the kernel in Pallas interpret mode (any backend).
      amax_of: each gradient's ``amax`` from the maximum of its tile maxima (on one shard of a
        tensor split over devices: a ``pmax`` over them).
      sum_of: each extra's fp32 gradient from the sum of its tile sums (on one shard of the
        rows: a ``psum`` over the row shards), before it is cast to the extra's dtype.
    """
    dispatch.check_compiled(interpret, "pallas_kernels.fused_backward")
    yq, grads, maxima, sums = _kernel_or_reference(
        saved, dy, fn, extras, operand_fmt, operand_amax, whole_rows, tuning, interpret)
    amax_of, sum_of = amax_of or (lambda x: x), sum_of or (lambda x: x)
    extra_grads = tuple(sum_of(g).astype(e.dtype) for g, e in zip(sums, extras, strict=True))
    return yq, grads, tuple(map(amax_of, maxima)), extra_grads


def _kernel_or_reference(saved, dy, fn, extras, operand_fmt, operand_amax, whole_rows, tuning,
                         interpret):  # fmt: skip
    """:func:`_reference`'s results from the kernel (maxima and fp32 sums of this array), or
    from :func:`_reference` where the kernel cannot tile the shape."""
    n, m, (rows, cols), dtype = len(saved), len(extras), dy.shape, dy.dtype
    fmt, group = saved[0].fmt, saved[0].data.shape[-1]
    max_cols = tuning.max_cols if whole_rows else tuning.block_cols
    # a whole-row tile holds no more elements than a block_rows x block_cols one
    max_rows = max(1, tuning.block_rows * tuning.block_cols // cols) if whole_rows else \
        tuning.block_rows  # fmt: skip
    blocks = block_shape(rows, cols, group, max_rows, max_cols) if rows else None
    if (blocks is None or (whole_rows and blocks[1] != cols)
            or any(q.k is not None or q.last_dim != cols for q in saved)):  # fmt: skip
        return _reference(saved, dy, fn, extras, operand_fmt, operand_amax)
    br, bc = blocks
    # with a weight, a program walks rb rows in tiles of br, summing its gradient as it goes:
    # one fp32 row of partial sums a program, not a tile
    rb = pow2_divisor(rows, max(br, tuning.rows_per_program)) if m else br
    grid = (rows // rb, cols // bc)
    tile = pl.BlockSpec((rb, bc), lambda i, j: (i, j))
    group_tile = pl.BlockSpec((rb, bc // group), lambda i, j: (i, j))
    vector = pl.BlockSpec((1, bc), lambda i, j: (0, j))
    scalar = pl.BlockSpec((1, 1), lambda i, j: (0, 0))
    tile_max = pl.BlockSpec((1, 1), lambda i, j: (i, j))

    def kernel(*refs):
        c_refs, a_refs, e_refs = refs[:n], refs[n : 2 * n], refs[2 * n : 2 * n + m]
        dy_ref, amax_ref, y_ref = refs[2 * n + m : 2 * n + m + 3]  # then the outputs
        outs = refs[2 * n + m + 3 :]
        g_refs, mx_refs, s_refs = outs[:n], outs[n : 2 * n], outs[2 * n :]
        es = tuple(e[...].astype(jnp.float32) for e in e_refs)

        def rows_tile(k, carry):  # rows [k br, (k + 1) br) of the program's block
            maxima, sums = carry
            r = slice(None) if rb == br else pl.ds(pl.multiple_of(k * br, br), br)
            xs = []
            for c_ref, a_ref in zip(c_refs, a_refs, strict=True):
                x = decode(c_ref[r, :].reshape(br, bc // group, group), a_ref[r, :], None, fmt)
                xs.append(x.reshape(br, bc).astype(dtype))
            y, vjp = jax.vjp(fn, *xs, *es)
            y_ref[r, :] = encode(y, operand_fmt, False, per_group=False, amax=amax_ref[0, 0])[0]
            cots = vjp(dy_ref[r, :])
            new_maxima = []
            for g, g_ref, mx in zip(cots[:n], g_refs, maxima, strict=True):
                g = g.astype(dtype)
                g_ref[r, :] = g
                new_maxima.append(jnp.maximum(mx, finite_amax(g)))
            new_sums = tuple(s + g.reshape(1, bc) for s, g in zip(sums, cots[n:], strict=True))
            return tuple(new_maxima), new_sums

        init = ((jnp.float32(0),) * n, (jnp.zeros((1, bc), jnp.float32),) * m)
        if rb == br:
            maxima, sums = rows_tile(0, init)
        else:
            maxima, sums = jax.lax.fori_loop(0, rb // br, rows_tile, init)
        for mx, mx_ref in zip(maxima, mx_refs, strict=True):
            mx_ref[...] = jnp.reshape(mx, (1, 1))
        for sm, s_ref in zip(sums, s_refs, strict=True):
            s_ref[...] = sm

    matrix = lambda dt: jax.ShapeDtypeStruct((rows, cols), dt)
    y_codes, *outs = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[tile] * n + [group_tile] * n + [vector] * m + [tile, scalar],
        out_specs=[tile] * (n + 1) + [tile_max] * n
        + [pl.BlockSpec((1, bc), lambda i, j: (i, j))] * m,
        out_shape=[matrix(operand_fmt.dtype)] + [matrix(dtype)] * n
        + [jax.ShapeDtypeStruct(grid, jnp.float32)] * n
        + [jax.ShapeDtypeStruct((grid[0], cols), jnp.float32)] * m,
        compiler_params=pl_triton.CompilerParams(num_warps=tuning.num_warps,
                                                 num_stages=tuning.num_stages),  # fmt: skip
        interpret=interpret,
    )(*(q.data.reshape(rows, cols) for q in saved), *(q.amax for q in saved),
      *(e.reshape(1, cols) for e in extras), dy,
      jnp.asarray(operand_amax, jnp.float32).reshape(1, 1))  # fmt: skip
    grads, partial_maxima, partial_sums = tuple(outs[:n]), outs[n : 2 * n], outs[2 * n :]
    yq = QuantizedArray(y_codes, jnp.asarray(operand_amax, jnp.float32))
    return yq, grads, tuple(map(jnp.max, partial_maxima)), tuple(p.sum(0) for p in partial_sums)
