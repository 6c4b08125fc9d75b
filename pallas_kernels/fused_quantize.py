r"""Quantization inside its producer: the forward of COAT's norm and SwiGLU ops in two passes.

COAT's non-linear ops save their inputs as FP8 1x16 groups and feed the next GEMM a per-tensor
FP8 operand computed from those saved inputs (:mod:`coat_jax.ops.flow`). Written as separate
XLA ops that is: quantize the inputs, dequantize them, apply the op, take ``max |y|`` over the
tensor, quantize ``y``. Here it is two kernels over row tiles, with the op ``f`` traced on the
tiles (the paper's "group scaling": the tensor's ``amax`` from per-tile maxima):

1. **save**: read the inputs :math:`x_i`; write their FP8 codes and per-group maxima
   :math:`Q_{1\times16}(x_i)`; compute :math:`y = f(Q^{-1}(\ldots))` in registers and write only
   :math:`\max |y|` of the tile (finite elements).
2. **operand**: a tiny reduction gives :math:`a = \max_{tiles}`; read the saved codes again
   (1 byte an element instead of the inputs' 2), recompute :math:`y` and write its per-tensor
   codes :math:`Q_a(y)`; ``y`` itself is never written.

Traffic per element of one input: 2 (read) + 1.25 (saved) + 1.25 (re-read) + 1 (operand) bytes.
Codes and scales are those of the jnp reference (:func:`save_and_operand_reference`, which is
what :mod:`coat_jax.ops.flow` computes without the kernels): both trace
:mod:`coat_jax.core.quant`'s ``encode`` / ``decode`` and the same ``f``; ``y`` may differ in
the last bit where ``f`` reduces over a row in another order (RMSNorm's mean).

``f`` sees each decoded input tile ``(br, bc)`` in the inputs' dtype and each extra vector as
``(1, bc)`` (the norm's weight). A norm needs whole rows in a tile (``whole_rows``: the hidden
size must be a power of two up to ``max_cols``); SwiGLU is element-wise and tiles freely. Shapes
the kernels cannot tile fall back to the reference without error. Pallas with the Triton
backend, as :mod:`pallas_kernels.quantize`.
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

__all__ = ["FusedQuantizeTuning", "save_and_operand", "save_and_operand_reference"]


@dataclasses.dataclass(frozen=True)
class FusedQuantizeTuning:
    """Tile and launch knobs (block dims powers of two; ``max_cols`` bounds whole-row tiles)."""

    block_rows: int = 16
    block_cols: int = 1024
    max_cols: int = 8192
    num_warps: int = 8
    num_stages: int = 1


def save_and_operand_reference(inputs, fn: Callable, extras=(), *, saved_fmt: Fp8Format,
                               group: int, operand_fmt: Fp8Format, amax_of=None):  # fmt: skip
    """``(saved inputs, operand)``: each input quantized in 1x``group`` groups, and
    ``y = fn(dequantized inputs..., extras (1, cols)...)`` quantized per tensor (``amax_of``:
    see :func:`save_and_operand`)."""
    saved = tuple(quantize(x, saved_fmt, group_size=group) for x in inputs)
    y = fn(*(dequantize(q, x.dtype) for q, x in zip(saved, inputs, strict=True)),
           *(e.reshape(1, -1) for e in extras))  # fmt: skip
    if amax_of is None:
        return saved, quantize(y, operand_fmt)
    return saved, quantize(y, operand_fmt, amax=amax_of(finite_amax(y)))


def save_and_operand(
    inputs: tuple[jax.Array, ...],
    fn: Callable,
    extras: tuple[jax.Array, ...] = (),
    *,
    saved_fmt: Fp8Format,
    group: int,
    operand_fmt: Fp8Format,
    whole_rows: bool,
    tuning: FusedQuantizeTuning = FusedQuantizeTuning(),
    interpret: bool = False,
    amax_of: Callable | None = None,
) -> tuple[tuple[QuantizedArray, ...], QuantizedArray]:
    """The kernels' twin of :func:`save_and_operand_reference` on matrices ``(rows, cols)``.

    Args:
      inputs: same-shape, same-dtype matrices (the op's inputs).
      fn: the op on tiles (module docstring); returns the inputs' dtype.
      extras: vectors ``(cols,)`` ``fn`` reads beside the inputs.
      saved_fmt, group: format and group size of the saved copies.
      operand_fmt: format of the per-tensor operand.
      whole_rows: ``fn`` reduces over a row (tiles span whole rows).
      tuning: tile and launch knobs.
      interpret: run the kernels in Pallas interpret mode (any backend).
      amax_of: the tensor's ``amax`` from this array's (``max`` of the tile maxima, or of
        ``|y|``, a scalar): on one shard of a tensor split over devices, a ``pmax`` over them.
    """
    dispatch.check_compiled(interpret, "pallas_kernels.fused_quantize")
    reference = lambda: save_and_operand_reference(
        inputs, fn, extras, saved_fmt=saved_fmt, group=group, operand_fmt=operand_fmt,
        amax_of=amax_of,
    )  # fmt: skip
    rows, cols = inputs[0].shape
    max_cols = tuning.max_cols if whole_rows else tuning.block_cols
    blocks = block_shape(rows, cols, group, tuning.block_rows, max_cols) if rows else None
    if blocks is None or (whole_rows and blocks[1] != cols):
        return reference()
    br, bc = blocks
    grid = (rows // br, cols // bc)
    tile = pl.BlockSpec((br, bc), lambda i, j: (i, j))
    group_tile = pl.BlockSpec((br, bc // group), lambda i, j: (i, j))
    vector = pl.BlockSpec((1, bc), lambda i, j: (0, j))
    params = pl_triton.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages)
    n, dtype = len(inputs), inputs[0].dtype
    extras2 = tuple(e.reshape(1, cols) for e in extras)

    def decoded(codes, amax):
        x = decode(codes.reshape(br, bc // group, group), amax, None, saved_fmt)
        return x.reshape(br, bc).astype(dtype)

    def save_kernel(*refs):
        x_refs, e_refs = refs[:n], refs[n : n + len(extras)]
        q_refs, a_refs, m_ref = refs[-2 * n - 1 : -n - 1], refs[-n - 1 : -1], refs[-1]
        xs = []
        for x_ref, q_ref, a_ref in zip(x_refs, q_refs, a_refs, strict=True):
            codes, amax, _ = encode(x_ref[...].reshape(br, bc // group, group), saved_fmt, False)
            q_ref[...] = codes.reshape(br, bc)
            a_ref[...] = amax
            xs.append(decoded(codes, amax))
        y = fn(*xs, *(e[...] for e in e_refs))
        m_ref[...] = finite_amax(y, keepdims=True).reshape(1, 1)

    outs = jax.ShapeDtypeStruct((rows, cols), saved_fmt.dtype)
    scales = jax.ShapeDtypeStruct((rows, cols // group), jnp.float32)
    *saved, partial_max = pl.pallas_call(
        save_kernel,
        grid=grid,
        in_specs=[tile] * n + [vector] * len(extras),
        out_specs=[tile] * n + [group_tile] * n + [pl.BlockSpec((1, 1), lambda i, j: (i, j))],
        out_shape=[outs] * n + [scales] * n + [jax.ShapeDtypeStruct(grid, jnp.float32)],
        compiler_params=params,
        interpret=interpret,
    )(*inputs, *extras2)
    codes, amaxes = saved[:n], saved[n:]
    amax = jnp.max(partial_max) if amax_of is None else amax_of(jnp.max(partial_max))

    def operand_kernel(*refs):
        c_refs, a_refs = refs[:n], refs[n : 2 * n]
        e_refs, amax_ref, y_ref = refs[2 * n : -2], refs[-2], refs[-1]
        xs = [decoded(c[...], a[...]) for c, a in zip(c_refs, a_refs, strict=True)]
        y = fn(*xs, *(e[...] for e in e_refs))
        y_ref[...] = encode(y, operand_fmt, False, per_group=False, amax=amax_ref[0, 0])[0]

    y_codes = pl.pallas_call(
        operand_kernel,
        grid=grid,
        in_specs=[tile] * n + [group_tile] * n + [vector] * len(extras)
        + [pl.BlockSpec((1, 1), lambda i, j: (0, 0))],
        out_specs=tile,
        out_shape=jax.ShapeDtypeStruct((rows, cols), operand_fmt.dtype),
        compiler_params=params,
        interpret=interpret,
    )(*codes, *amaxes, *extras2, amax.reshape(1, 1))
    saved_q = tuple(
        QuantizedArray(c.reshape(rows, cols // group, group), a, None, cols)
        for c, a in zip(codes, amaxes, strict=True)
    )
    return saved_q, QuantizedArray(y_codes, amax)
