"""FP8 quantize / dequantize kernels: per group along the last axis, and per tensor in two stages.

Pallas with the Triton backend (see docs/pallas-backends.md for why not Mosaic GPU for these
memory-bound kernels): the same source runs on a Hopper GPU and, with ``interpret=True``, on
the CPU. The specification is the jnp reference in :mod:`coat_jax.core.quant`; the kernels
trace its own ``encode`` / ``decode`` on their tiles, so FP8 codes and scales are bitwise equal
to it.

* :func:`quantize_per_group`: one pass; each block of ``(block_rows, block_cols)`` elements
  is viewed as ``(block_rows, block_cols / g, g)``, reduced to the group maxima and scaled.
* :func:`quantize_per_tensor`: COAT's "group scaling": a first kernel writes one partial
  ``max |x|`` per block, a tiny reduction gives the tensor's ``amax``, a second kernel scales
  and casts. (In a fused producer the first stage rides along the producing kernel.)
* :func:`dequantize_per_group`: codes times ``amax / fmt.max`` per group.
* :func:`quantize_transpose_per_tensor`: per-tensor codes of a matrix in row-major and in
  K-major (transposed) layout from one read of it, given ``amax`` (e.g. from the producer's
  partial max), as a backward GEMM needs both.

Shapes the kernels cannot take (a last axis that is not a multiple of the group size, a group
size that is not a power of two) fall back to the reference without error.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from coat_jax.core.formats import Fp8Format, get_format
from coat_jax.core.quant import QuantizedArray, decode, dequantize, encode, quantize
from pallas_kernels import dispatch
from pallas_kernels.tiling import block_shape

__all__ = [
    "QuantizeTuning",
    "TRANSPOSE_TUNING",
    "quantize_tuning_candidates",
    "transpose_tuning_candidates",
    "dequantize_per_group",
    "quantize_per_group",
    "quantize_per_tensor",
    "quantize_transpose_per_tensor",
]


@dataclasses.dataclass(frozen=True)
class QuantizeTuning:
    """Tile and launch knobs (block dims must be powers of two for Triton). ``transpose_codes``
    (:func:`quantize_transpose_per_tensor` only): the transposed output is the tile's 1-byte
    codes transposed, instead of the transposed input tile (fp32 in registers) encoded again."""

    block_rows: int = 32
    block_cols: int = 512
    num_warps: int = 4
    num_stages: int = 1
    transpose_codes: bool = False


TRANSPOSE_TUNING = QuantizeTuning(block_rows=64, block_cols=256, num_warps=4)
"""Default tile of :func:`quantize_transpose_per_tensor`. Inside a 2-layer 7B COAT step at
batch 8 (H100, jax 0.11.2, 2026-12-07, ``bench/results/profiles_b8_grad_transpose_h100_
2026-12-07.tgz``) it moves 2.8 TB/s on 16384 x 4096 and 2.7 TB/s on 16384 x 11008 (bf16 in, E5M2
codes in both layouts), against 1.4-1.7 TB/s for XLA's fusions. The same day's tile sweep
(``kernel_sweep_transpose*_h100_2026-12-07.json``) timed launches, not the kernel (1.1-1.3
TB/s for every tile), so its ranking is weak evidence; 64 x 256 was its best on both shapes."""


def quantize_tuning_candidates() -> tuple[QuantizeTuning, ...]:
    """The tunings ``bench/kernel_sweep.py`` times: tile rows x tile columns x warps."""
    grid = itertools.product((8, 32), (256, 512, 1024), (4, 8), (1,))
    return tuple(QuantizeTuning(*c) for c in grid)


def transpose_tuning_candidates() -> tuple[QuantizeTuning, ...]:
    """The tunings ``bench/kernel_sweep.py`` times for :func:`quantize_transpose_per_tensor`:
    tiles whose transposed copy is not too narrow a row of 1-byte codes (rows x columns up to
    128 x 512), x warps, x what is transposed (the input tile or its codes)."""
    grid = itertools.product((32, 64, 128), (64, 128, 256, 512), (4, 8), (1,), (False, True))
    return tuple(QuantizeTuning(*c) for c in grid if c[0] * c[1] <= 32768)


def _blocks(rows: int, cols: int, group: int, tuning: QuantizeTuning) -> tuple[int, int] | None:
    """``(block_rows, block_cols)`` for a ``(rows, cols)`` view, or ``None`` if unsupported."""
    return block_shape(rows, cols, group, tuning.block_rows, tuning.block_cols)


def _params(tuning: QuantizeTuning):
    return pl_triton.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages)


def check_args(x, group_size) -> None:
    """The per-group quantize kernels' argument checks (TypeError / ValueError, one line)."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"quantize needs a floating-point array, got dtype {x.dtype}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if x.ndim == 0:
        raise ValueError("per-group quantization needs an array with at least one axis")


def _check_backend(interpret: bool) -> None:
    dispatch.check_compiled(interpret, "pallas_kernels.quantize")


def quantize_per_group(
    x: jax.Array,
    fmt: str | Fp8Format = "e4m3",
    group_size: int = 16,
    *,
    tuning: QuantizeTuning = QuantizeTuning(),
    interpret: bool = False,
) -> QuantizedArray:
    """Kernel twin of ``coat_jax.quantize(x, fmt, group_size=group_size)`` (bitwise equal)."""
    fmt = get_format(fmt)
    check_args(x, group_size)
    _check_backend(interpret)
    cols = x.shape[-1]
    rows = x.size // max(cols, 1)
    blocks = _blocks(rows, cols, group_size, tuning) if x.size else None
    if blocks is None:
        return quantize(x, fmt, group_size=group_size)
    br, bc = blocks
    n_groups = cols // group_size
    codes, amax = _quantize_groups_call(
        x.reshape(rows, cols), fmt, group_size, br, bc, tuning, interpret
    )
    lead = x.shape[:-1]
    return QuantizedArray(
        codes.reshape(*lead, n_groups, group_size), amax.reshape(*lead, n_groups), None, cols
    )


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5, 6))
def _quantize_groups_call(x2, fmt, group, br, bc, tuning, interpret):
    rows, cols = x2.shape

    def kernel(x_ref, q_ref, amax_ref):
        codes, amax, _ = encode(x_ref[...].reshape(br, bc // group, group), fmt, False)
        q_ref[...] = codes.reshape(br, bc)
        amax_ref[...] = amax

    return pl.pallas_call(
        kernel,
        grid=(rows // br, cols // bc),
        in_specs=[pl.BlockSpec((br, bc), lambda i, j: (i, j))],
        out_specs=[
            pl.BlockSpec((br, bc), lambda i, j: (i, j)),
            pl.BlockSpec((br, bc // group), lambda i, j: (i, j)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((rows, cols), fmt.dtype),
            jax.ShapeDtypeStruct((rows, cols // group), jnp.float32),
        ],
        compiler_params=_params(tuning),
        interpret=interpret,
    )(x2)


def dequantize_per_group(
    q: QuantizedArray,
    dtype=jnp.float32,
    *,
    tuning: QuantizeTuning = QuantizeTuning(),
    interpret: bool = False,
) -> jax.Array:
    """Kernel twin of ``coat_jax.dequantize(q, dtype)`` for plain per-group arrays."""
    _check_backend(interpret)
    if not q.per_group or q.expanded:
        return dequantize(q, dtype)
    group = q.data.shape[-1]
    n_groups = q.data.shape[-2]
    cols = n_groups * group
    rows = q.data.size // max(cols, 1)
    blocks = _blocks(rows, cols, group, tuning) if q.data.size else None
    if blocks is None or cols != q.last_dim:
        return dequantize(q, dtype)
    br, bc = blocks
    out = _dequantize_groups_call(
        q.data.reshape(rows, cols), q.amax.reshape(rows, n_groups), q.fmt, group, br, bc,
        jnp.dtype(dtype), tuning, interpret,
    )  # fmt: skip
    return out.reshape(*q.data.shape[:-2], cols)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6, 7, 8))
def _dequantize_groups_call(codes, amax, fmt, group, br, bc, dtype, tuning, interpret):
    rows, cols = codes.shape

    def kernel(q_ref, amax_ref, x_ref):
        x = decode(q_ref[...].reshape(br, bc // group, group), amax_ref[...], None, fmt)
        x_ref[...] = x.reshape(br, bc).astype(dtype)

    return pl.pallas_call(
        kernel,
        grid=(rows // br, cols // bc),
        in_specs=[
            pl.BlockSpec((br, bc), lambda i, j: (i, j)),
            pl.BlockSpec((br, bc // group), lambda i, j: (i, j)),
        ],
        out_specs=pl.BlockSpec((br, bc), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((rows, cols), dtype),
        compiler_params=_params(tuning),
        interpret=interpret,
    )(codes, amax)


def quantize_per_tensor(
    x: jax.Array,
    fmt: str | Fp8Format = "e4m3",
    *,
    tuning: QuantizeTuning = QuantizeTuning(),
    interpret: bool = False,
) -> QuantizedArray:
    """Kernel twin of ``coat_jax.quantize(x, fmt)`` (per tensor), in two stages."""
    fmt = get_format(fmt)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"quantize needs a floating-point array, got dtype {x.dtype}")
    _check_backend(interpret)
    cols = x.shape[-1] if x.ndim else 1
    rows = x.size // max(cols, 1)
    blocks = _blocks(rows, cols, 1, tuning) if x.size else None
    if blocks is None or blocks[1] < 16:
        return quantize(x, fmt)
    br, bc = blocks
    x2 = x.reshape(rows, cols)
    partial_max = _block_amax_call(x2, br, bc, tuning, interpret)
    amax = jnp.max(partial_max)
    codes = _scale_call(x2, amax.reshape(1, 1), fmt, br, bc, tuning, interpret)
    return QuantizedArray(codes.reshape(x.shape), amax)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _block_amax_call(x2, br, bc, tuning, interpret):
    rows, cols = x2.shape

    def kernel(x_ref, m_ref):
        m_ref[...] = jnp.max(jnp.abs(x_ref[...].astype(jnp.float32)), keepdims=True).reshape(1, 1)

    return pl.pallas_call(
        kernel,
        grid=(rows // br, cols // bc),
        in_specs=[pl.BlockSpec((br, bc), lambda i, j: (i, j))],
        out_specs=pl.BlockSpec((1, 1), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((rows // br, cols // bc), jnp.float32),
        compiler_params=_params(tuning),
        interpret=interpret,
    )(x2)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6))
def _scale_call(x2, amax, fmt, br, bc, tuning, interpret):
    rows, cols = x2.shape

    def kernel(x_ref, amax_ref, q_ref):
        q_ref[...] = encode(x_ref[...], fmt, False, per_group=False, amax=amax_ref[0, 0])[0]

    return pl.pallas_call(
        kernel,
        grid=(rows // br, cols // bc),
        in_specs=[
            pl.BlockSpec((br, bc), lambda i, j: (i, j)),
            pl.BlockSpec((1, 1), lambda i, j: (0, 0)),
        ],
        out_specs=pl.BlockSpec((br, bc), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((rows, cols), fmt.dtype),
        compiler_params=_params(tuning),
        interpret=interpret,
    )(x2, amax)


def quantize_transpose_per_tensor(
    x: jax.Array,
    amax: jax.Array,
    fmt: str | Fp8Format = "e4m3",
    *,
    tuning: QuantizeTuning = TRANSPOSE_TUNING,
    interpret: bool = False,
) -> tuple[QuantizedArray, QuantizedArray]:
    """``(Q(x), Q(x)^T)`` per tensor with the given ``amax``, one pass over ``x``.

    ``q = sat(x * fmt.max / amax)`` (``amax == 0`` scales by ``fmt.max``), written as ``x``'s
    ``(R, C)`` codes and as the ``(C, R)`` transposed codes: bitwise equal to
    ``coat_jax.quantize(x, fmt, amax=amax)`` and its transpose. Reads ``R C`` elements once,
    writes ``2 R C`` bytes. Shapes the kernel cannot tile fall back to the reference.

    Args:
      x: a 2-D floating-point array.
      amax: fp32 scalar, the scale's ``max |x|``; values beyond it saturate.
      fmt: FP8 format.
      tuning: tile and launch knobs (the transposed tile is ``(block_cols, block_rows)``).
      interpret: run in Pallas interpret mode.
    """
    fmt = get_format(fmt)
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.ndim != 2:
        raise ValueError(f"quantize_transpose needs a 2-D float array, got {x.dtype}{x.shape}")
    _check_backend(interpret)
    amax = jnp.asarray(amax, jnp.float32)
    blocks = _blocks(*x.shape, 1, tuning) if x.size else None
    if blocks is None or blocks[1] < 16:
        q = quantize(x, fmt, amax=amax)
        return q, QuantizedArray(q.data.T, q.amax)
    codes, codes_t = _transpose_call(x, amax.reshape(1, 1), fmt, *blocks, tuning, interpret)
    return QuantizedArray(codes, amax), QuantizedArray(codes_t, amax)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6))
def _transpose_call(x2, amax, fmt, br, bc, tuning, interpret):
    rows, cols = x2.shape

    def kernel(x_ref, amax_ref, q_ref, qt_ref):
        x = x_ref[...]
        a = amax_ref[0, 0]
        codes = encode(x, fmt, False, per_group=False, amax=a)[0]
        q_ref[...] = codes
        if tuning.transpose_codes:
            qt_ref[...] = codes.T
        else:  # elementwise: the same codes
            qt_ref[...] = encode(x.T, fmt, False, per_group=False, amax=a)[0]

    return pl.pallas_call(
        kernel,
        grid=(rows // br, cols // bc),
        in_specs=[
            pl.BlockSpec((br, bc), lambda i, j: (i, j)),
            pl.BlockSpec((1, 1), lambda i, j: (0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((br, bc), lambda i, j: (i, j)),
            pl.BlockSpec((bc, br), lambda i, j: (j, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((rows, cols), fmt.dtype),
            jax.ShapeDtypeStruct((cols, rows), fmt.dtype),
        ],
        compiler_params=_params(tuning),
        interpret=interpret,
    )(x2, amax)
