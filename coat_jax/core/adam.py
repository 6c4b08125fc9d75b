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

__all__ = [
    "AdamCoefficients",
    "ScaleByFp8AdamState",
    "coefficients",
    "direction",
    "update_moments",
]


class ScaleByFp8AdamState(NamedTuple):
    """State of :func:`coat_jax.scale_by_fp8_adam` (and of its fused update).

    Attributes:
      count: int32, shape ``()``; number of updates applied.
      mu: first moments, the params' tree structure. Each leaf is a
        :class:`~coat_jax.core.quant.QuantizedArray` (FP8 ``data`` of shape
        ``(*param.shape[:-1], n_groups, size)``, fp32 ``amax`` and, when expanded, uint8 ``k``
        of shape ``(*param.shape[:-1], n_groups)``) or an fp32 array of the param's shape.
      nu: second moments, laid out like ``mu``.
    """

    count: jax.Array
    mu: optax.Updates
    nu: optax.Updates


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


def update_moments(g, m, v, c: AdamCoefficients):
    """``(m', v')``: one step of the moment recurrences, fp32 ``g``, ``m``, ``v``."""
    m = c.one_minus_b1 * g + c.b1 * m
    v = c.one_minus_b2 * (g * g) + c.b2 * v
    return m, v


def direction(m, v, c: AdamCoefficients):
    """The bias-corrected Adam direction ``u`` from the new fp32 moments."""
    return (m / c.bc1) / (jnp.sqrt(v / c.bc2 + c.eps_root) + c.eps)
