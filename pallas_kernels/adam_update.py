r"""Full-fusion FP8 AdamW on one parameter: the parameter, its gradient and FP8 moments in,
the new parameter and moments out, one pass over memory.

With :math:`s` the clip scale (1 without clipping), :math:`\eta` the learning rate,
:math:`\lambda` the weight decay where the leaf is decayed (0 elsewhere) and :math:`Q` /
:math:`Q^{-1}` the per-group FP8 (range-expanded) quantization:

.. math::

  g &= s\,\nabla, \quad (m, v) = \mathrm{update\_moments}(g, Q^{-1}(\hat m), Q^{-1}(\hat v)),
  \quad u = \mathrm{cast}_{\nabla}(\mathrm{direction}(m, v)), \\
  \theta' &= \theta + (-\eta)\,(u + \lambda \theta), \quad \hat m' = Q(m), \ \hat v' = Q(v),

with the recurrence of :mod:`coat_jax.core.adam`. This is exactly what ``optax.chain(
scale_by_fp8_adam(...), optax.add_decayed_weights(wd, mask), optax.scale_by_learning_rate(lr))``
followed by ``optax.apply_updates`` computes for the leaf (``u`` is rounded to the gradient's
dtype as the chain does), without materialising ``u`` or the update. Bytes per parameter: param
read + write 8, fp32 gradient 4 (bf16: 2), moments read + write 2 x 2 x 1.04 = 4.2: 16.2
(14.2 with bf16 gradients), against ``optax.adamw``'s 28.

BF16 master weights (:mod:`coat_jax.core.master`): with ``remainder`` the parameter comes as
its BF16 part and int16 (or int8) remainder; the kernel rebuilds :math:`\theta` from both,
updates it as above and writes both parts back (:math:`\theta'` never leaves the chip): 4 (or
3) bytes read and written per parameter instead of 8, and no fp32 copy in memory.

:func:`leaf_kernel` is the Pallas Triton kernel (the tile layout, per-tile math and tuning of
:mod:`pallas_kernels.adam_step`); :func:`leaf_reference` its jnp twin, op for op as the chain
computes. The whole-tree update, its dispatch between the two and its per-shard runs under a
mesh are ``coat_jax.ops.fused_update``. Both take the step's scalars as one fp32 vector
(:func:`update_vector`). A step marked skipped (its ``skip``, a traced flag such as "the loss
is not finite") returns every input unchanged (the kernel's outputs alias its inputs and a
skipped program touches neither), so that a trainer can guard the update without keeping a
copy of the old state. On the GPU the kernel's transcendentals, square root and division are
one-instruction approximations (``pallas_kernels.adam_step.kernel_math``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from coat_jax.core import adam, master
from coat_jax.core.adam import AdamCoefficients
from pallas_kernels import adam_step, dispatch
from pallas_kernels.adam_step import AdamStepTuning

__all__ = [
    "N_HYPER",
    "kernel_takes",
    "leaf_kernel",
    "leaf_reference",
    "leaf_reference_parts",
    "unless",
    "update_vector",
]

_TUNING = AdamStepTuning()
N_HYPER = 16
"""Length of the step's fp32 vector: the 8 Adam coefficients, -lr, weight decay, clip scale,
the skip flag, zero padding."""


def update_vector(coeffs: AdamCoefficients, learning_rate, weight_decay, clip_scale,
                  skip=False) -> jax.Array:  # fmt: skip
    """The fp32 vector of one step's scalars that :func:`leaf_kernel` and
    :func:`leaf_reference` read: ``coeffs``, ``-learning_rate``, ``weight_decay``,
    ``clip_scale``, ``skip`` (a bool, traced or not: 1 returns every input unchanged),
    then zeros up to :data:`N_HYPER`."""
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    rest = [-1 * f32(learning_rate), f32(weight_decay), f32(clip_scale), f32(skip)]
    return jnp.concatenate([coeffs.vector(), jnp.stack(rest), jnp.zeros(N_HYPER - 12, jnp.float32)])


def _read_vector(h):
    """``(coefficients, -lr, weight decay, clip scale, skip)`` from :func:`update_vector`'s
    layout; ``skip`` a bool."""
    return AdamCoefficients.from_values(h[i] for i in range(8)), h[8], h[9], h[10], h[11] != 0


def unless(skip, old, new):
    """``new``, or ``old`` where the step is skipped: leaf by leaf (``None`` stays ``None``)."""
    return jax.tree.map(lambda o, n: jnp.where(skip, o, n), old, new)


def _step(p, u, neg_lr, wd, decay: bool, grad_dtype):
    """``p + (-lr) (u + wd p)`` in the dtypes the chain uses: on undecayed leaves optax scales
    ``u`` by the learning rate in ``u``'s dtype, the gradient's (a no-op for fp32)."""
    if decay:
        return p + neg_lr * (u + wd * p)
    low = lambda x: x.astype(grad_dtype).astype(jnp.float32)
    return p + low(low(neg_lr) * u)


def leaf_reference(p, g, mu, nu, hyper, decay: bool):
    """The jnp (XLA-fused) update of one leaf, op for op as the optax chain computes it.

    ``mu`` / ``nu`` are QuantizedArrays or fp32 arrays (small parameters); ``hyper`` is
    :func:`update_vector`'s. Returns ``(new_p, new_mu, new_nu)``.
    """
    coeffs, neg_lr, wd, clip, skip = _read_vector(hyper)
    u, new_mu, new_nu = adam.stored_step(g.astype(jnp.float32) * clip, mu, nu, coeffs)
    u = u.astype(g.dtype).astype(jnp.float32)
    new_p = _step(p, u, neg_lr, wd, decay, g.dtype).astype(p.dtype)
    return unless(skip, (p, mu, nu), (new_p, new_mu, new_nu))


def leaf_reference_parts(hi, remainder, g, mu, nu, hyper, decay: bool):
    """:func:`leaf_reference` on the weight rebuilt from its BF16 part ``hi`` and
    ``remainder`` (:mod:`coat_jax.core.master`); returns ``(new_hi, new_remainder, new_mu,
    new_nu)``, the remainder with as many bits as it came with."""
    new_p, new_mu, new_nu = leaf_reference(master.join(hi, remainder), g, mu, nu, hyper, decay)
    parts = master.split(new_p, master.remainder_bits(remainder.dtype))
    return (*unless(_read_vector(hyper)[-1], (hi, remainder), parts), new_mu, new_nu)


def kernel_takes(p, g, mu, nu, tuning: AdamStepTuning = _TUNING, remainder=None) -> bool:
    """Whether :func:`leaf_kernel` takes this leaf (else run :func:`leaf_reference`): an fp32
    ``p``, or a BF16 ``p`` with its ``remainder`` (int16 or int8, ``p``'s shape)."""
    if remainder is None:
        weight = p.dtype == jnp.float32
    else:
        weight = (p.dtype == jnp.bfloat16 and remainder.shape == p.shape
                  and remainder.dtype in master.REMAINDER_DTYPES.values())  # fmt: skip
    return (
        adam_step.supported(mu, nu, tuning)
        and weight
        and p.shape == g.shape == mu.shape
        and mu.data.shape[-1] == nu.data.shape[-1]
    )


def leaf_kernel(p, g, mu, nu, hyper, decay: bool, *, remainder=None, tuning=_TUNING,
                interpret=False):  # fmt: skip
    """The fused kernel on one leaf (layouts :func:`adam_step.supported` takes, fp32 ``p``, or
    BF16 ``p`` with its master-weight ``remainder``).

    Returns ``(new_p, new_mu, new_nu)``, with a remainder ``(new_p, new_remainder, new_mu,
    new_nu)``; the outputs alias the inputs' arrays.
    """
    if not kernel_takes(p, g, mu, nu, tuning, remainder):
        raise ValueError("adam_update.leaf_kernel: unsupported layout; use leaf_reference")
    dispatch.check_compiled(interpret, "pallas_kernels.adam_update")
    n, group, br = adam_step.group_rows(mu, tuning)
    weight = (p.reshape(n, group),)
    if remainder is not None:
        weight += (remainder.reshape(n, group),)
    outs = _call(
        *weight, g.reshape(n, group), jnp.asarray(hyper, jnp.float32).reshape(1, -1),
        *adam_step.moment_operands(mu, nu, n, group),
        static=(mu.fmt, nu.fmt, mu.expanded, br, bool(decay), tuning, interpret, len(weight)),
    )  # fmt: skip
    k = len(weight)
    new_mu, new_nu = adam_step.rebuild(mu, outs[k:])
    return (*(o.reshape(p.shape) for o in outs[:k]), new_mu, new_nu)


@functools.partial(jax.jit, static_argnames=("static",))
def _call(*arrays, static):
    mu_fmt, nu_fmt, expanded, br, decay, tuning, interpret, k = static
    weight, (g, hyper), moments = arrays[:k], arrays[k : k + 2], arrays[k + 2 :]
    n, group = weight[0].shape
    bits = master.remainder_bits(weight[1].dtype) if k == 2 else None
    math = adam_step.kernel_math(tuning, interpret)
    specs, shapes = adam_step.moment_specs(n, group, br, expanded, mu_fmt, nu_fmt)
    n_mom = len(specs)

    def kernel(*refs):
        w_refs, (g_ref, h_ref), ins = refs[:k], refs[k : k + 2], refs[k + 2 : k + 2 + n_mom]
        outs = refs[k + 2 + n_mom :]
        coeffs, neg_lr, wd, clip, skip = _read_vector([h_ref[0, i] for i in range(12)])

        # A skipped step reads and writes nothing: the outputs alias the inputs (XLA copies an
        # input it cannot donate first), so they already hold the old values.
        @pl.when(jnp.logical_not(skip))
        def _():
            m_state, v_state = adam_step.read_moments(ins, expanded)
            u, new_m, new_v = adam_step.moment_update(
                g_ref[...].astype(jnp.float32) * clip, m_state, v_state, coeffs,
                mu_fmt=mu_fmt, nu_fmt=nu_fmt, expanded=expanded, math=math,
            )  # fmt: skip
            u = u.astype(g.dtype).astype(jnp.float32)  # the chain's u has the gradient's dtype
            w = tuple(r[...] for r in w_refs)
            new_p = _step(w[0] if bits is None else master.join(*w), u, neg_lr, wd, decay,
                          g.dtype)  # fmt: skip
            # the new weight leaves the chip as its two parts only (BF16 master weights)
            new_w = (new_p,) if bits is None else master.split_bits(new_p, bits)
            for ref, value in zip(outs[:k], new_w, strict=True):
                ref[...] = value
            adam_step.write_moments(outs[k:], new_m, new_v, expanded)

    tile = pl.BlockSpec((br, group), lambda i: (i, 0))
    weight_shapes = [jax.ShapeDtypeStruct((n, group), w.dtype) for w in weight]
    return pl.pallas_call(
        kernel,
        grid=(n // br,),
        in_specs=[*[tile] * k, tile, pl.BlockSpec((1, N_HYPER), lambda i: (0, 0)), *specs],
        out_specs=[*[tile] * k, *specs],
        out_shape=[*weight_shapes, *shapes],
        input_output_aliases={**{j: j for j in range(k)},
                              **{k + 2 + j: k + j for j in range(n_mom)}},  # fmt: skip
        compiler_params=adam_step.compiler_params(tuning),
        interpret=interpret,
    )(*weight, g, hyper, *moments)
