"""Per-group FP8 quantize in Pallas with the Mosaic GPU backend (Hopper), an alternative to the
Triton kernel in :mod:`pallas_kernels.quantize`.

``quantize_per_group_mgpu(x, fmt, g)`` is the kernel twin of ``coat_jax.quantize(x, fmt,
group_size=g)`` without range expansion: per group of ``g`` elements along the last axis
``amax = max |x|`` and ``codes = sat(x * (fmt.max / amax))`` (``amax == 0``: factor
``fmt.max``), the math of :func:`coat_jax.core.quant.encode` op for op, so codes and ``amax`` are
bitwise equal to the reference.

Layout (docs/pallas-backends.md, "Mosaic GPU"): the input is viewed in HBM as ``(R C / g, g)``,
one group per row (a free reshape), so a group reduction is a row reduction of a
``(block_rows, g)`` tile in the WGMMA register layout (``block_rows % 64 == 0``, ``g % 8 ==
0``). Each CTA of a ``plgpu.kernel`` grid takes a contiguous band of rows and streams it through
an ``emit_pipeline`` (TMA loads into shared memory, ``max_concurrent_steps`` deep, TMA stores
of the codes and the per-group ``amax``). Blocks are contiguous in HBM, so the copies are bulk
(not tensor-map) copies.

Shapes the kernel cannot take (a last axis that is not a multiple of ``g``, a group size that
is not a multiple of 16, a row count no block of >= 64 rows divides) fall back to the
reference. Compiled only: Mosaic GPU's ``plgpu.load`` has no interpret rule, so off a Hopper GPU
the function raises ``ValueError`` (use the reference or the Triton kernel's interpret mode).
``bench/kernels.py`` times this module (results: docs/pallas-backends.md); nothing selects it
by default.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from coat_jax.core.formats import Fp8Format, get_format
from coat_jax.core.quant import TINY_AMAX, QuantizedArray, quantize
from pallas_kernels import dispatch, mgpu
from pallas_kernels.mgpu import pl, plgpu
from pallas_kernels.quantize import check_args

__all__ = [
    "MgpuQuantizeTuning",
    "block_plan",
    "mgpu_tuning_candidates",
    "quantize_per_group_mgpu",
]

MIN_BLOCK_ROWS = 64
"""Rows of the smallest block: the WGMMA register layout tiles rows by 64."""
MAX_BLOCK_ROWS = 256
"""Rows of the largest block: Pallas' TMA copies are tiled, at most 256 elements per dim."""


@dataclasses.dataclass(frozen=True)
class MgpuQuantizeTuning:
    """Knobs of the Mosaic GPU per-group quantize.

    Attributes:
      block_rows: groups (rows of the ``(R C / g, g)`` view) per pipeline step, a multiple of
        64 and at most 256 (one TMA box); ``None``: ``block_elems // g`` clipped to [64, 256].
        Halved (down to 64) until it divides the row count.
      block_elems: elements per step when ``block_rows`` is ``None`` (8192: 32 KiB of fp32).
      max_concurrent_steps: pipeline depth (shared memory per CTA: ``depth x block_rows x
        (g x (itemsize + 1) + 4)`` bytes, at most 227 KiB).
      ctas_per_sm: the grid has up to ``ctas_per_sm x SMs`` CTAs (the largest count that
        divides the number of blocks), each streaming a contiguous band of rows.
    """

    block_rows: int | None = None
    block_elems: int = 8192
    max_concurrent_steps: int = 4
    ctas_per_sm: int = 2

    def rows_for(self, group: int) -> int:
        if self.block_rows is not None:
            return self.block_rows
        return min(MAX_BLOCK_ROWS, max(MIN_BLOCK_ROWS, self.block_elems // group))


def mgpu_tuning_candidates() -> tuple[MgpuQuantizeTuning, ...]:
    """Tunings worth timing on a GPU (block size x depth x CTAs per SM)."""
    return tuple(
        MgpuQuantizeTuning(None, e, d, c)
        for e, d, c in [(8192, 4, 2), (8192, 4, 1), (4096, 4, 2), (8192, 2, 2), (4096, 5, 1)]
    )


SMEM_LIMIT = 232_448
"""Shared memory one CTA may use on Hopper (227 KiB)."""


def smem_bytes(block_rows: int, group: int, in_dtype, depth: int) -> int:
    """Shared memory of the pipeline's buffers: ``depth`` slots of the input block, the code
    block and the block's ``amax``."""
    return depth * block_rows * (group * (jnp.dtype(in_dtype).itemsize + 1) + 4)


def block_plan(
    n_rows: int, group: int, in_dtype, tuning: MgpuQuantizeTuning, num_sms: int
) -> tuple[int, int] | None:
    """``(block_rows, n_ctas)`` for ``n_rows`` groups of ``group`` elements, or ``None`` when
    the kernel cannot take the shape (the caller falls back to the reference)."""
    if group % 16 or group > 256 or n_rows <= 0:
        return None
    br = tuning.rows_for(group)
    if br % MIN_BLOCK_ROWS or br > MAX_BLOCK_ROWS:
        raise ValueError(f"{tuning}: block_rows must be a multiple of 64, at most 256")
    while br > MIN_BLOCK_ROWS and n_rows % br:
        br //= 2
    if n_rows % br or br % MIN_BLOCK_ROWS:
        return None
    if smem_bytes(br, group, in_dtype, tuning.max_concurrent_steps) > SMEM_LIMIT:
        raise ValueError(f"{tuning}: {br} rows x {group} x depth exceed 227 KiB shared memory")
    blocks = n_rows // br
    cap = max(1, num_sms * tuning.ctas_per_sm)
    n_ctas = max(d for d in range(1, min(blocks, cap) + 1) if blocks % d == 0)
    return br, n_ctas


def _build_kernel(n_rows, group, in_dtype, fmt: Fp8Format, br, depth, n_ctas):
    """The ``plgpu.kernel`` for an ``(n_rows, group)`` view (``n_rows % (br * n_ctas) == 0``)."""
    rows_per_cta = n_rows // n_ctas
    steps = rows_per_cta // br
    fmax = fmt.max

    def body(_, x_smem, q_smem, amax_smem):
        # encode(x, fmt, False) on one (br, g) tile, one group per row
        x = mgpu.load(x_smem, plgpu.Layout.WGMMA, optimized=False).astype(jnp.float32)
        amax = jnp.max(jnp.abs(x), axis=1)
        safe = jnp.where(amax > 0, amax, 1.0)
        pre = jnp.where(safe < TINY_AMAX, np.float32(2.0**64), np.float32(1.0))
        factor = fmax / (safe * pre)
        bcast = lambda v: lax.broadcast_in_dim(v, (br, group), (0,))
        scaled = (x * bcast(pre)) * bcast(factor)
        q_smem[...] = jnp.clip(scaled, -fmax, fmax).astype(fmt.dtype)
        amax_smem[...] = amax

    def kernel(x_gmem, q_gmem, amax_gmem):
        # built inside the kernel: emit_pipeline makes its grid into arrays, which must be
        # traced with the kernel, not captured as constants
        pipeline = plgpu.emit_pipeline(
            body,
            grid=(steps,),
            in_specs=[plgpu.BlockSpec((br, group), lambda i: (i, 0))],
            out_specs=[
                plgpu.BlockSpec((br, group), lambda i: (i, 0)),
                plgpu.BlockSpec((br,), lambda i: (i,)),
            ],
            max_concurrent_steps=depth,
        )
        band = pl.ds(lax.axis_index("cta") * rows_per_cta, rows_per_cta)
        pipeline(x_gmem.at[band], q_gmem.at[band], amax_gmem.at[band])

    return plgpu.kernel(
        kernel,
        out_type=(
            jax.ShapeDtypeStruct((n_rows, group), fmt.dtype),
            jax.ShapeDtypeStruct((n_rows,), jnp.float32),
        ),
        grid=(n_ctas,),
        grid_names=("cta",),
    )


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5))
def _quantize_call(x, fmt, group, br, depth, n_ctas):
    """Codes ``(..., n_groups, group)`` and ``amax (..., n_groups)`` of ``x`` (last axis a
    multiple of ``group``). The ``(n_rows, group)`` views are reshapes inside this jit, so XLA
    makes them bitcasts around the kernel rather than copies."""
    n_rows = x.size // group
    lead, n_groups = x.shape[:-1], x.shape[-1] // group
    call = _build_kernel(n_rows, group, x.dtype, fmt, br, depth, n_ctas)
    codes, amax = call(x.reshape(n_rows, group))
    return codes.reshape(*lead, n_groups, group), amax.reshape(*lead, n_groups)


def quantize_per_group_mgpu(
    x: jax.Array,
    fmt: str | Fp8Format = "e4m3",
    group_size: int = 16,
    *,
    tuning: MgpuQuantizeTuning = MgpuQuantizeTuning(),
) -> QuantizedArray:
    """Kernel twin of ``coat_jax.quantize(x, fmt, group_size=group_size)`` (bitwise equal).

    Args:
      x: floating-point array (fp32 or bf16 on the fast path), groups along the last axis.
      fmt: ``"e4m3"`` / ``"e5m2"`` or an :class:`~coat_jax.core.formats.Fp8Format`.
      group_size: elements per group (a multiple of 16, at most 256, on the kernel path).
      tuning: block and pipeline knobs.

    Raises:
      ValueError: off a Hopper GPU, for a bad ``group_size`` or a tuning that does not fit.
      TypeError: a non-floating ``x``.
    """
    fmt = get_format(fmt)
    check_args(x, group_size)
    dispatch.check_compiled(False, "pallas_kernels.quantize_mgpu")
    mgpu.require("pallas_kernels.quantize_mgpu")
    cols = x.shape[-1]
    plan = None
    if x.size and cols % group_size == 0:
        n_rows = x.size // group_size
        plan = block_plan(n_rows, group_size, x.dtype, tuning, mgpu.num_sms())
    if plan is None:
        return quantize(x, fmt, group_size=group_size)
    br, n_ctas = plan
    depth = tuning.max_concurrent_steps
    codes, amax = _quantize_call(x, fmt, group_size, br, depth, n_ctas)
    return QuantizedArray(codes, amax, None, cols)
