r"""The Adam recurrence, written once, and the state of Adam with FP8 moments.

With gradient :math:`g`, moments :math:`m, v` (fp32) and step :math:`t` (1 on the first update):

.. math::

  m_t = \beta_1 m_{t-1} + (1 - \beta_1) g, \qquad v_t = \beta_2 v_{t-1} + (1 - \beta_2) g^2,
  \qquad u_t = \frac{m_t / (1 - \beta_1^t)}{\sqrt{v_t / (1 - \beta_2^t) + \epsilon_{root}}
  + \epsilon}.

:func:`update_moments` and :func:`direction` compute it in fp32 from :class:`AdamCoefficients`,
the fp32 scalars of one step, built by :func:`coefficients`. Every user of the recurrence calls
these two functions: ``coat_jax.ops.optim`` (the optax transformation), the fused update's
reference and both Pallas kernels (``pallas_kernels.adam_step``, ``pallas_kernels.adam_update``,
inside their tiles). Kernels receive the coefficients as one fp32 vector
(:func:`AdamCoefficients.vector`) so that ``1 - b`` is rounded once, on the host side, exactly
as the reference rounds it.

The bias corrections divide, as ``optax.scale_by_adam`` does (a product with the reciprocal
rounds differently).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from coat_jax.core import quant

__all__ = [
    "STATE_LAYOUT",
    "AdamCoefficients",
    "ScaleByFp8AdamState",
    "coefficients",
    "direction",
    "first_moment_gradient",
    "from_moments",
    "is_fp8",
    "loaded_second_moment",
    "moments",
    "stored_step",
    "update_moments",
]


class ScaleByFp8AdamState(NamedTuple):
    """State of :func:`coat_jax.scale_by_fp8_adam` (and of its fused update).

    Every field but ``count`` has the params' tree structure with one array per parameter, so
    whatever maps over the params (a ``PartitionSpec`` tree, flax's boxed or ``nnx.Variable``
    params, ``optax.tree_utils.tree_map_params``) maps over the state the same way.

    Attributes:
      count: int32, shape ``()``; number of updates applied.
      mu: first moments: FP8 codes with the parameter's own shape (per-group scaled along the
        last axis), or fp32 moments for parameters kept in fp32 (smaller than ``min_size``,
        0-d, or a format of ``None``).
      nu: second moments, laid out like ``mu``.
      mu_amax, nu_amax: fp32 group maxima, shape ``(*param.shape[:-1], n_groups)`` (``()``
        for 0-d parameters); zeros, unused, where the moment is fp32.
      mu_k, nu_k: uint8 codes ``16 k`` of the range-expansion exponents, shaped like the
        ``amax`` fields; ``None`` without range expansion.

    A group of codes is ``from_param_layout(mu, mu_amax, mu_k)``
    (:func:`coat_jax.core.quant.from_param_layout`); :func:`moments` reads the whole state so.
    This is layout 2 (:data:`STATE_LAYOUT`); layout 1 (coat-jax before 2026-12-01) kept
    :class:`~coat_jax.core.quant.QuantizedArray` leaves with codes ``(*lead, n_groups, size)``.
    """

    count: jax.Array
    mu: optax.Updates
    nu: optax.Updates
    mu_amax: optax.Updates
    nu_amax: optax.Updates
    mu_k: optax.Updates | None = None
    nu_k: optax.Updates | None = None


STATE_LAYOUT = 2
"""Version of :class:`ScaleByFp8AdamState`'s layout; checkpoints record it."""


def is_fp8(x) -> bool:
    """Whether a state leaf holds FP8 codes (else it is an fp32 moment)."""
    return jnp.dtype(x.dtype).itemsize == 1 and jnp.issubdtype(x.dtype, jnp.floating)


def _leaf(codes, amax, k):
    return quant.from_param_layout(codes, amax, k) if is_fp8(codes) else codes


def moments(state: ScaleByFp8AdamState, treedef) -> tuple[list, list]:
    """Each parameter's ``(mu, nu)`` in ``treedef``'s leaf order: a grouped
    :class:`~coat_jax.core.quant.QuantizedArray` where the state holds FP8 codes, else the fp32
    moment."""

    def flat(codes, amax, k):
        codes, amax = treedef.flatten_up_to(codes), treedef.flatten_up_to(amax)
        k = treedef.flatten_up_to(k) if k is not None else [None] * len(codes)
        return [_leaf(*t) for t in zip(codes, amax, k, strict=True)]

    return flat(state.mu, state.mu_amax, state.mu_k), flat(state.nu, state.nu_amax, state.nu_k)


def from_moments(state: ScaleByFp8AdamState, treedef, count, flat_mu, flat_nu):
    """The state holding ``count`` and new moments (as :func:`moments` returns them); fp32
    moments keep ``state``'s unused scales."""

    def split(flat, amax_tree, k_tree):
        old_amax = treedef.flatten_up_to(amax_tree)
        old_k = treedef.flatten_up_to(k_tree) if k_tree is not None else [None] * len(flat)
        parts = [
            quant.param_layout(m) if isinstance(m, quant.QuantizedArray) else (m, a, k)
            for m, a, k in zip(flat, old_amax, old_k, strict=True)
        ]
        codes, amax, k = ([p[i] for p in parts] for i in range(3))
        unflat = treedef.unflatten
        return unflat(codes), unflat(amax), None if k_tree is None else unflat(k)

    mu, mu_amax, mu_k = split(flat_mu, state.mu_amax, state.mu_k)
    nu, nu_amax, nu_k = split(flat_nu, state.nu_amax, state.nu_k)
    return ScaleByFp8AdamState(count, mu, nu, mu_amax, nu_amax, mu_k, nu_k)


class AdamCoefficients(NamedTuple):
    """The fp32 scalars of one Adam step (traced or concrete).

    Attributes:
      b1, one_minus_b1, b2, one_minus_b2: the decays and their complements (``1 - b``
        rounded once, from the Python value when it is one).
      eps, eps_root: added outside and inside the square root.
      bc1, bc2: bias corrections ``1 - b1^t``, ``1 - b2^t`` at the step being taken.
    """

    b1: jax.Array
    one_minus_b1: jax.Array
    b2: jax.Array
    one_minus_b2: jax.Array
    eps: jax.Array
    eps_root: jax.Array
    bc1: jax.Array
    bc2: jax.Array

    def vector(self) -> jax.Array:
        """The coefficients as one fp32 vector of 8, in field order (a kernel's operand)."""
        return jnp.stack([jnp.asarray(c, jnp.float32) for c in self])

    @classmethod
    def from_values(cls, values) -> AdamCoefficients:
        """Coefficients from 8 scalars in field order (a kernel reads its vector so)."""
        return cls(*values)


def coefficients(b1, b2, eps, eps_root, count) -> AdamCoefficients:
    """The coefficients of the step that makes ``count`` updates (``count`` >= 1)."""
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    return AdamCoefficients(
        b1=f32(b1),
        one_minus_b1=f32(1 - b1),
        b2=f32(b2),
        one_minus_b2=f32(1 - b2),
        eps=f32(eps),
        eps_root=f32(eps_root),
        bc1=1 - f32(b1) ** count,
        bc2=1 - f32(b2) ** count,
    )


def update_moments(g, m, v, c: AdamCoefficients, *, g_m=None):
    """``(m', v')``: one step of the moment recurrences, fp32 ``g``, ``m``, ``v`` (``m`` from
    ``g_m`` instead of ``g`` where given)."""
    m = c.one_minus_b1 * (g if g_m is None else g_m) + c.b1 * m
    v = c.one_minus_b2 * (g * g) + c.b2 * v
    return m, v


def direction(m, v, c: AdamCoefficients, *, g_m=None, nesterov_bc1=None):
    """The bias-corrected Adam direction ``u`` from the new fp32 moments. With
    ``nesterov_bc1`` (``1 - b1^(t+1)``) the numerator is Nesterov's, ``b1 m / (1 - b1^(t+1)) +
    (1 - b1) g / (1 - b1^t)`` (``g``: ``g_m``, the gradient the first moment took), as
    ``optax.scale_by_adam(nesterov=True)`` computes it."""
    if nesterov_bc1 is None:
        m_hat = m / c.bc1
    else:
        m_hat = c.b1 * (m / nesterov_bc1) + c.one_minus_b1 * (g_m / c.bc1)
    return m_hat / (jnp.sqrt(v / c.bc2 + c.eps_root) + c.eps)


def loaded_second_moment(v):
    """``v`` as read from FP8 storage: a NaN code stands for ``+inf``.

    ``v >= 0`` always, so a stored non-finite ``v`` is the ``+inf`` of an overflowed ``g**2``
    (``optax.adamw`` keeps ``v = inf`` there and updates that parameter by 0 from then on), or
    the NaN of a NaN gradient, which made ``m`` NaN too: reading it as ``+inf`` gives the
    parameter adamw's update in both cases.
    """
    return jnp.where(v == v, v, jnp.inf)  # comparisons only: kernel-friendly isnan


def first_moment_gradient(g):
    """The gradient as FP8 storage's first moment takes it: 0 where ``g`` is finite but
    ``g**2`` overflows.

    There ``v`` becomes ``+inf`` and every later update of the element is 0, as in
    ``optax.adamw``, whatever ``m`` holds; leaving such a ``g`` (1e30) out of ``m`` keeps it
    from setting its group's scale and costing the other elements their precision. NaN and
    +-Inf gradients still reach ``m`` (adamw's parameter becomes NaN there, and so does ours).
    A function of ``g`` alone, so the moment updates stay independent and fuse.
    """
    return jnp.where((g * g == jnp.inf) & (jnp.abs(g) < jnp.inf), 0.0, g)


def stored_step(g, mu, nu, c: AdamCoefficients, nesterov_bc1=None):
    """One Adam step on moments as stored: ``(u, new mu, new nu)``, fp32 ``u``.

    ``g`` is fp32; each moment is a per-group :class:`~coat_jax.core.quant.QuantizedArray`
    (decoded, stepped in fp32 and re-encoded in the same format, groups and expansion, with
    :func:`loaded_second_moment` / :func:`first_moment_gradient`) or a plain array (stepped in
    fp32 and stored back in its dtype, as ``optax.adamw`` steps it). ``nesterov_bc1``: see
    :func:`direction`. The reference of the Pallas moment kernels, whose tiles run the same
    functions.
    """
    fp8_m, fp8_v = isinstance(mu, quant.QuantizedArray), isinstance(nu, quant.QuantizedArray)
    m = quant.dequantize(mu) if fp8_m else mu.astype(jnp.float32)
    v = loaded_second_moment(quant.dequantize(nu)) if fp8_v else nu.astype(jnp.float32)
    g_m = first_moment_gradient(g) if fp8_m else g
    m, v = update_moments(g, m, v, c, g_m=g_m)
    u = direction(m, v, c, g_m=g_m, nesterov_bc1=nesterov_bc1)

    def store(x, like):
        if not isinstance(like, quant.QuantizedArray):
            return x.astype(like.dtype)
        size = like.data.shape[-1]
        return quant.quantize(x, like.fmt, group_size=size, expand=like.expanded)

    return u, store(m, mu), store(v, nu)
