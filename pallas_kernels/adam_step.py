"""Fused FP8 Adam moment step: dequantize -> Adam in fp32 -> requantize, one pass over memory.

The kernel of ``scale_by_fp8_adam`` (``coat_jax.ops.optim``): that transformation sees the
gradients and its own state, never the learning rate, weight decay or parameters, so the legal
fusion is exactly it: read ``g`` and the FP8 moments (codes, ``amax`` and expansion exponent per
group), write the Adam direction ``u`` and the new FP8 moments. For each group of ``G`` elements
along the last axis:

  m, v  = Q^-1(m_hat), Q^-1(v_hat)                  (range expansion inverted when expanded)
  m', v' = coat_jax.core.adam.update_moments(g, m, v),  u = coat_jax.core.adam.direction(m', v')
  m_hat', v_hat' = Q(m'), Q(v')                     (new amax, k per group)

Bytes per parameter: g 4 + u 4 + moments 2 x 2 x 1.04 = 12.2 (fp32 Adam's moment step: 20).
:mod:`pallas_kernels.adam_update` fuses the rest of AdamW with the same per-tile math
(:func:`moment_update`) and tuning (:class:`AdamStepTuning`).

Layout: arrays are viewed in HBM as ``(n_groups, G)`` (a free reshape), a tile is
``(block_rows, G)``, one group per tile row, so the group reductions are row reductions. The
per-group math is the reference's own (``coat_jax.core.quant.encode`` / ``decode`` and
``coat_jax.core.adam``), traced here: kernel and reference cannot drift apart. On the GPU
``approx_math`` takes the expansion's per-element ``log`` and ``exp2`` from ``lg2.approx.f32``
(times ln 2) and ``ex2.approx.f32``, and the Adam direction's square root and division from
``sqrt.approx`` / ``rcp.approx`` (one MUFU op each, a few ulp) instead of libdevice's and IEEE
division (:func:`kernel_math`).
Layouts the kernel does not take (padded groups, a group size that is not a power of two) are
refused by :func:`supported`; callers run the reference there. Pallas Triton backend;
``interpret=True`` runs the same body on the CPU (with ``jnp.log`` / ``jnp.exp2``). Design
history and measurements: docs/pallas-backends.md.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from coat_jax.core import adam
from coat_jax.core.adam import AdamCoefficients
from coat_jax.core.quant import QuantizedArray, decode, encode
from pallas_kernels import dispatch
from pallas_kernels.tiling import pow2_divisor

_LN_2 = 0.6931471805599453

__all__ = [
    "AdamStepTuning",
    "fp8_adam_moments",
    "moment_update",
    "supported",
    "tuning_candidates",
]


@dataclasses.dataclass(frozen=True)
class AdamStepTuning:
    """Tile and launch knobs of the fused optimizer kernels (this module and adam_update).

    Attributes:
      block_rows: groups per program (a power of two; the tile is ``(block_rows, G)``).
      num_warps: Triton warps per program.
      num_stages: Triton software-pipelining depth (each program handles one tile, so this
        only matters if Triton pipelines the loads; swept anyway).
      approx_math: on the GPU take ``log`` / ``exp2`` from ``lg2.approx.f32`` /
        ``ex2.approx.f32`` and the Adam direction's square root and division from
        ``sqrt.approx`` / ``rcp.approx`` (:func:`kernel_math`); interpret mode always uses the
        reference's functions. (The direction's approximation measured no faster than IEEE
        division on an H200, 0.325 vs 0.302 ms, within run-to-run noise; it is what the
        2026-12-02 timings ran.)

    Defaults: the fastest full update on a 4096 x 11008 leaf in two of two runs on an H200
    (0.304 / 0.305 ms against 0.325 / 0.318 for 16 rows;
    ``bench/results/adam_ablation_h200_2026-12-02*.json``), as in the 2026-11-30 sweep
    (``kernel_sweep_adam_*_h200_2026-11-30.json``).
    """

    block_rows: int = 8
    num_warps: int = 4
    num_stages: int = 1
    approx_math: bool = True


def tuning_candidates() -> tuple[AdamStepTuning, ...]:
    """The tunings ``bench/kernel_sweep.py`` times: tile rows x warps x approximate or
    libdevice transcendentals."""
    grid = itertools.product((8, 16, 32, 64), (4, 8), (1,), (True, False))
    return tuple(AdamStepTuning(*c) for c in grid)


def _ptx_unary(instruction: str, x):
    """One PTX ``f32`` instruction (``"lg2.approx.f32"``...) applied elementwise in Triton."""
    (y,) = pl_triton.elementwise_inline_asm(
        f"{instruction} $0, $1;",
        args=[x.astype(jnp.float32)],
        constraints="=r,r",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)],
    )
    return y


@dataclasses.dataclass(frozen=True)
class KernelMath:
    """The per-element functions a kernel body evaluates: the expansion's natural ``log`` and
    ``exp2`` (``quant.encode`` / ``decode`` keywords, :attr:`expansion`) and the Adam
    ``direction(m, v, coefficients)``. The defaults are the reference's own."""

    log: Callable = jnp.log
    exp2: Callable = jnp.exp2
    direction: Callable = adam.direction

    @property
    def expansion(self) -> dict:
        return {"log": self.log, "exp2": self.exp2}


def _approx_direction(m, v, c: AdamCoefficients):
    """:func:`coat_jax.core.adam.direction` with the bias corrections as products with their
    (per-program) reciprocals and the square root and final division from ``sqrt.approx`` /
    ``rcp.approx``: 4 instructions an element instead of ~30 for three IEEE divisions and a
    square root, each within ~2 ulp (``v = inf`` still gives 0, NaN stays NaN)."""
    denominator = _ptx_unary("sqrt.approx.f32", v * (1.0 / c.bc2) + c.eps_root) + c.eps
    return (m * (1.0 / c.bc1)) * _ptx_unary("rcp.approx.f32", denominator)


def kernel_math(tuning: AdamStepTuning, interpret: bool) -> KernelMath:
    """On the GPU with ``approx_math``: one MUFU op for each ``log``, ``exp2``, square root and
    reciprocal (all handle 0, subnormals, inf and NaN as ``jnp``'s do); the reference's
    functions in interpret mode."""
    if tuning.approx_math and not interpret:
        return KernelMath(log=lambda x: _ptx_unary("lg2.approx.f32", x) * _LN_2,
                          exp2=functools.partial(_ptx_unary, "ex2.approx.f32"),
                          direction=_approx_direction)  # fmt: skip
    return KernelMath()


def group_rows(mu: QuantizedArray, tuning: AdamStepTuning) -> tuple[int, int, int] | None:
    """``(n_groups, G, block_rows)`` of a moment viewed as ``(n_groups, G)``, or ``None``
    when the kernel cannot take it (padded groups, a group size that is not a power of two)."""
    if not isinstance(mu, QuantizedArray) or not mu.per_group or mu.data.size == 0:
        return None
    group = mu.data.shape[-1]
    if group & (group - 1) or mu.data.shape[-2] * group != mu.last_dim:
        return None
    n = mu.data.size // group
    return n, group, pow2_divisor(n, tuning.block_rows)


def supported(mu, nu, tuning: AdamStepTuning = AdamStepTuning()) -> bool:
    """Whether the kernel takes this pair of moment states (else use the reference)."""
    return (
        group_rows(mu, tuning) is not None
        and isinstance(nu, QuantizedArray)
        and nu.per_group
        and mu.expanded == nu.expanded
        and mu.data.shape == nu.data.shape
    )


def moment_update(grad, m_state, v_state, coeffs: AdamCoefficients, *, mu_fmt, nu_fmt, expanded,
                  math):  # fmt: skip
    """The shared per-tile math: returns ``(u, (m codes, amax, k), (v codes, amax, k))``.

    ``grad`` is fp32 ``(rows, G)``; each state is ``(codes, amax, k code or None)`` with per-row
    ``amax`` / ``k``; ``coeffs`` the step's :class:`~coat_jax.core.adam.AdamCoefficients`;
    ``math`` the :class:`KernelMath` (:func:`kernel_math`).
    """
    m = decode(*m_state, mu_fmt, **math.expansion)
    v = adam.loaded_second_moment(decode(*v_state, nu_fmt, **math.expansion))
    m, v = adam.update_moments(grad, m, v, coeffs, g_m=adam.first_moment_gradient(grad))
    u = math.direction(m, v, coeffs)
    return (u, encode(m, mu_fmt, expanded, **math.expansion),
            encode(v, nu_fmt, expanded, **math.expansion))  # fmt: skip


def moment_specs(n: int, group: int, br: int, expanded: bool, mu_fmt, nu_fmt):
    """BlockSpecs and output shapes of the FP8 moment operands, in kernel argument order
    ``m codes, m amax, v codes, v amax[, m k, v k]``."""
    tile = pl.BlockSpec((br, group), lambda i: (i, 0))
    row = pl.BlockSpec((br,), lambda i: (i,))
    specs = [tile, row, tile, row] + ([row, row] if expanded else [])
    shapes = [
        jax.ShapeDtypeStruct((n, group), mu_fmt.dtype),
        jax.ShapeDtypeStruct((n,), jnp.float32),
        jax.ShapeDtypeStruct((n, group), nu_fmt.dtype),
        jax.ShapeDtypeStruct((n,), jnp.float32),
    ]
    if expanded:
        shapes += [jax.ShapeDtypeStruct((n,), jnp.uint8)] * 2
    return specs, shapes


def moment_operands(mu: QuantizedArray, nu: QuantizedArray, n: int, group: int):
    """The moments' arrays in ``moment_specs`` order, viewed as ``(n, G)`` / ``(n,)``."""
    ops = [mu.data.reshape(n, group), mu.amax.reshape(n), nu.data.reshape(n, group)]
    ops.append(nu.amax.reshape(n))
    if mu.expanded:
        ops += [mu.k.reshape(n), nu.k.reshape(n)]
    return ops


def read_moments(refs, expanded: bool):
    """Loads the moment refs (``moment_specs`` order) as two ``(codes, amax, k)`` triples."""
    mq, ma, vq, va = (r[...] for r in refs[:4])
    mk, vk = (refs[4][...], refs[5][...]) if expanded else (None, None)
    return (mq, ma, mk), (vq, va, vk)


def write_moments(refs, new_m, new_v, expanded: bool) -> None:
    """Stores two ``(codes, amax, k)`` triples into refs in ``moment_specs`` order."""
    (mq, ma, mk), (vq, va, vk) = new_m, new_v
    refs[0][...], refs[1][...], refs[2][...], refs[3][...] = mq, ma, vq, va
    if expanded:
        refs[4][...], refs[5][...] = mk, vk


def rebuild(mu: QuantizedArray, outs) -> tuple[QuantizedArray, QuantizedArray]:
    """New ``(mu, nu)`` from kernel outputs in ``moment_specs`` order, shaped like ``mu``."""
    lead = mu.amax.shape
    k_m, k_v = (outs[4].reshape(lead), outs[5].reshape(lead)) if mu.expanded else (None, None)
    new = lambda codes, amax, k: QuantizedArray(
        codes.reshape(mu.data.shape), amax.reshape(lead), k, mu.last_dim
    )
    return new(outs[0], outs[1], k_m), new(outs[2], outs[3], k_v)


def compiler_params(tuning: AdamStepTuning):
    return pl_triton.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages)


def fp8_adam_moments(
    g: jax.Array,
    mu: QuantizedArray,
    nu: QuantizedArray,
    coeffs: AdamCoefficients,
    *,
    tuning: AdamStepTuning = AdamStepTuning(),
    interpret: bool = False,
):
    """One fused Adam moment step for one parameter.

    Args:
      g: gradient, the parameter's shape (any float dtype; ``u`` comes back in it).
      mu, nu: per-group FP8 moments laid out as ``scale_by_fp8_adam`` keeps them.
      coeffs: the step's :class:`~coat_jax.core.adam.AdamCoefficients`.
      tuning: tile and launch knobs.
      interpret: run in Pallas interpret mode (any backend).

    Returns:
      ``(u, new_mu, new_nu)``.

    Raises:
      ValueError: a layout :func:`supported` rejects, or compiled mode off a Hopper GPU.
    """
    if not supported(mu, nu, tuning):
        raise ValueError("fp8_adam_moments: unsupported layout; check supported() first")
    dispatch.check_compiled(interpret, "pallas_kernels.adam_step")
    n, group, br = group_rows(mu, tuning)
    outs = _call(
        g.reshape(n, group), coeffs.vector().reshape(1, 8), *moment_operands(mu, nu, n, group),
        static=(mu.fmt, nu.fmt, mu.expanded, br, tuning, interpret),
    )  # fmt: skip
    new_mu, new_nu = rebuild(mu, outs[1:])
    return outs[0].reshape(g.shape), new_mu, new_nu


@functools.partial(jax.jit, static_argnames=("static",))
def _call(g, coeffs, *moments, static):
    mu_fmt, nu_fmt, expanded, br, tuning, interpret = static
    n, group = g.shape
    math = kernel_math(tuning, interpret)
    specs, shapes = moment_specs(n, group, br, expanded, mu_fmt, nu_fmt)
    n_mom = len(specs)

    def kernel(g_ref, h_ref, *refs):
        ins, outs = refs[:n_mom], refs[n_mom:]
        coeffs = AdamCoefficients.from_values(h_ref[0, i] for i in range(8))
        m_state, v_state = read_moments(ins, expanded)
        u, new_m, new_v = moment_update(
            g_ref[...].astype(jnp.float32), m_state, v_state, coeffs,
            mu_fmt=mu_fmt, nu_fmt=nu_fmt, expanded=expanded, math=math,
        )  # fmt: skip
        outs[0][...] = u.astype(outs[0].dtype)
        write_moments(outs[1:], new_m, new_v, expanded)

    tile = pl.BlockSpec((br, group), lambda i: (i, 0))
    return pl.pallas_call(
        kernel,
        grid=(n // br,),
        in_specs=[tile, pl.BlockSpec((1, 8), lambda i: (0, 0)), *specs],
        out_specs=[tile, *specs],
        out_shape=[jax.ShapeDtypeStruct((n, group), g.dtype), *shapes],
        compiler_params=compiler_params(tuning),
        interpret=interpret,
    )(g, coeffs, *moments)
