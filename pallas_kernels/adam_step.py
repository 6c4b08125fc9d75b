"""Fused FP8 Adam moment step: dequantize -> Adam in fp32 -> requantize, one pass over memory.

Design (how it composes with optax): ``scale_by_fp8_adam`` sees gradients and its own state,
never the learning rate, the weight decay or the parameters (later links of the chain apply
those), so the legal fusion is exactly that transformation: read ``g`` and the FP8 moments
(codes, ``amax`` and expansion exponent per group), write the Adam direction ``u`` and the new
FP8 moments. For each group of ``g`` elements along the last axis:

  m, v  = Q^-1(m_hat), Q^-1(v_hat)                  (range expansion inverted when expanded)
  m'    = b1 m + (1 - b1) g,   v' = b2 v + (1 - b2) g^2
  u     = (m' / bc1) / (sqrt(v' / bc2 + eps_root) + eps)
  m_hat', v_hat' = Q(m'), Q(v')                     (new amax, k per group)

Bytes per parameter: g 4 + u 4 + moments 2 x 2 x 1.04 = 12.2 (fp32 Adam's moment step: 20).
The per-group math is the reference's own (``coat_jax.quant.encode`` / ``decode``), traced in
the kernel,
so the kernel and the jnp path cannot drift apart; they agree to fp32 rounding of the
transcendentals (tested). Pallas Triton backend; ``interpret=True`` runs it on the CPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from coat_jax.quant import QuantizedArray, decode, encode
from pallas_kernels.tiling import block_shape

__all__ = ["AdamStepTuning", "fp8_adam_moments", "supported"]


@dataclasses.dataclass(frozen=True)
class AdamStepTuning:
    """Tile and launch knobs (block dims are powers of two for Triton)."""

    block_rows: int = 8
    block_cols: int = 512
    num_warps: int = 4
    num_stages: int = 1


def _blocks(mu: QuantizedArray, tuning: AdamStepTuning):
    """``(rows, cols, group, block_rows, block_cols)`` of a moment's 2-D view, or ``None``."""
    group = mu.data.shape[-1]
    cols = mu.data.shape[-2] * group
    rows = mu.data.size // max(cols, 1)
    if cols != mu.last_dim or mu.data.size == 0:
        return None
    blocks = block_shape(rows, cols, group, tuning.block_rows, tuning.block_cols)
    return None if blocks is None else (rows, cols, group, *blocks)


def supported(mu, nu, tuning: AdamStepTuning = AdamStepTuning()) -> bool:
    """Whether the kernel takes this pair of moment states (else use the reference)."""
    return (
        isinstance(mu, QuantizedArray)
        and isinstance(nu, QuantizedArray)
        and mu.per_group
        and nu.per_group
        and mu.expanded == nu.expanded
        and mu.data.shape == nu.data.shape
        and _blocks(mu, tuning) is not None
    )


def fp8_adam_moments(
    g: jax.Array,
    mu: QuantizedArray,
    nu: QuantizedArray,
    hyper: jax.Array,
    *,
    tuning: AdamStepTuning = AdamStepTuning(),
    interpret: bool = False,
):
    """One fused Adam moment step for one parameter.

    Args:
      g: gradient, the parameter's shape (any float dtype; ``u`` comes back in it).
      mu, nu: per-group FP8 moments laid out as ``scale_by_fp8_adam`` keeps them.
      hyper: fp32 ``[b1, 1 - b1, b2, 1 - b2, eps, eps_root, 1 - b1^t, 1 - b2^t]`` (``1 - b``
        computed by the caller, as the reference rounds it).

    Returns:
      ``(u, new_mu, new_nu)``.
    """
    if not supported(mu, nu, tuning):
        raise ValueError("fp8_adam_moments: unsupported layout; check supported() first")
    rows, cols, group, br, bc = _blocks(mu, tuning)
    expanded = mu.expanded
    n_groups = cols // group
    flat = lambda a: a.reshape(rows, -1)
    k_args = (flat(mu.k), flat(nu.k)) if expanded else ()
    hyper = jnp.asarray(hyper, jnp.float32).reshape(1, 8)
    outs = _call(
        flat(g), flat(mu.data), flat(mu.amax), flat(nu.data), flat(nu.amax), hyper, *k_args,
        static=(mu.fmt, nu.fmt, expanded, group, br, bc, tuning, interpret),
    )  # fmt: skip
    u, m_codes, m_amax, v_codes, v_amax = outs[:5]
    m_k, v_k = (outs[5], outs[6]) if expanded else (None, None)
    lead = mu.data.shape[:-2]
    rebuild = lambda codes, amax, k, fmt: QuantizedArray(
        codes.reshape(*lead, n_groups, group),
        amax.reshape(*lead, n_groups),
        None if k is None else k.reshape(*lead, n_groups),
        cols,
    )
    return (
        u.reshape(g.shape),
        rebuild(m_codes, m_amax, m_k, mu.fmt),
        rebuild(v_codes, v_amax, v_k, nu.fmt),
    )


@functools.partial(jax.jit, static_argnames=("static",))
def _call(g, m_codes, m_amax, v_codes, v_amax, hyper, *ks, static):
    mu_fmt, nu_fmt, expanded, group, br, bc, tuning, interpret = static
    rows, cols = g.shape
    nb = bc // group
    shape3 = (br, nb, group)

    def kernel(*refs):
        n_in = 6 + (2 if expanded else 0)
        ins, outs = refs[:n_in], refs[n_in:]
        g_ref, mq_ref, ma_ref, vq_ref, va_ref, h_ref = ins[:6]
        mk_ref, vk_ref = (ins[6], ins[7]) if expanded else (None, None)
        b1, one_minus_b1, b2, one_minus_b2, eps, eps_root, bc1, bc2 = (
            h_ref[0, i] for i in range(8)
        )
        grad = g_ref[...].astype(jnp.float32).reshape(shape3)
        m = decode(mq_ref[...].reshape(shape3), ma_ref[...],
                   mk_ref[...] if expanded else None, mu_fmt)  # fmt: skip
        v = decode(vq_ref[...].reshape(shape3), va_ref[...],
                   vk_ref[...] if expanded else None, nu_fmt)  # fmt: skip
        m = one_minus_b1 * grad + b1 * m
        v = one_minus_b2 * (grad * grad) + b2 * v
        u = (m / bc1) / (jnp.sqrt(v / bc2 + eps_root) + eps)
        outs[0][...] = u.reshape(br, bc).astype(outs[0].dtype)
        for (codes, amax, k), base in ((encode(m, mu_fmt, expanded), 1),
                                       (encode(v, nu_fmt, expanded), 3)):  # fmt: skip
            outs[base][...] = codes.reshape(br, bc)
            outs[base + 1][...] = amax
            if expanded:
                outs[5 if base == 1 else 6][...] = k

    tile = pl.BlockSpec((br, bc), lambda i, j: (i, j))
    per_group = pl.BlockSpec((br, nb), lambda i, j: (i, j))
    in_specs = [tile, tile, per_group, tile, per_group, pl.BlockSpec((1, 8), lambda i, j: (0, 0))]
    out_specs = [tile, tile, per_group, tile, per_group]
    out_shape = [
        jax.ShapeDtypeStruct((rows, cols), g.dtype),
        jax.ShapeDtypeStruct((rows, cols), mu_fmt.dtype),
        jax.ShapeDtypeStruct((rows, cols // group), jnp.float32),
        jax.ShapeDtypeStruct((rows, cols), nu_fmt.dtype),
        jax.ShapeDtypeStruct((rows, cols // group), jnp.float32),
    ]
    if expanded:
        in_specs += [per_group, per_group]
        out_specs += [per_group, per_group]
        out_shape += [jax.ShapeDtypeStruct((rows, cols // group), jnp.uint8)] * 2
    return pl.pallas_call(
        kernel,
        grid=(rows // br, cols // bc),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pl_triton.CompilerParams(
            num_warps=tuning.num_warps, num_stages=tuning.num_stages
        ),
        interpret=interpret,
    )(g, m_codes, m_amax, v_codes, v_amax, hyper, *ks)
