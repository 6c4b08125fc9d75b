r"""Global-norm clipping by the previous step's norm: clipping that needs no gradient but its own.

``optax.clip_by_global_norm`` scales step :math:`t`'s gradients by

.. math::

  s_t = \min\left(1, \frac{c}{\lVert g_t \rVert}\right),

a function of every gradient of the step: no parameter can be updated before the last gradient
exists, so a train step holds all of them at once (Llama-2-7B: 13.5 GB in BF16). This
transformation scales by the norm of the step before,

.. math::

  s_t = \min\left(1, \frac{c}{\lVert g_{t-1} \rVert}\right), \qquad s_0 = 1,

and keeps :math:`\lVert g_t \rVert` (fp32) in its state for the next step. Each parameter's
update then depends on its own gradient and on scalars known before the backward pass, and
XLA's scheduler is free to apply it as soon as that gradient exists and free the gradient
(``train.py``: ``config.optimizer.update_in_backward``).

What changes against ``clip_by_global_norm``: a spike is clipped one step late (the step after
a large norm is scaled down instead of the large one); while norms stay below ``c`` both are
the identity. The norm is taken in fp32 (bf16 gradients' squares summed in fp32).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

__all__ = ["ClipByPreviousNormState", "clip_by_previous_global_norm", "clip_scale", "norm_fp32"]


class ClipByPreviousNormState(NamedTuple):
    """``norm``: the global norm of the previous step's gradients (0 before the first)."""

    norm: jax.Array


def norm_fp32(tree) -> jax.Array:
    """``optax.tree.norm`` (the global L2 norm) with every leaf read as fp32."""
    return optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), tree))


def clip_scale(norm, max_norm) -> jax.Array:
    """``min(1, max_norm / norm)`` in fp32, 1 where ``norm < max_norm`` (a zero norm too)."""
    norm = jnp.asarray(norm, jnp.float32)
    return jnp.where(norm < max_norm, jnp.float32(1.0), max_norm / norm)


def clip_by_previous_global_norm(max_norm: float) -> optax.GradientTransformation:
    """Scales the updates by ``min(1, max_norm / ||previous step's updates||)``.

    Args:
      max_norm: the threshold ``c`` (> 0).

    Returns:
      An optax transformation; its state is a :class:`ClipByPreviousNormState`.

    Raises:
      ValueError: ``max_norm`` not > 0.
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")

    def init(params):
        del params
        return ClipByPreviousNormState(jnp.zeros((), jnp.float32))

    def update(updates, state, params=None):
        del params
        scale = clip_scale(state.norm, max_norm)  # exactly 1 where nothing is clipped
        clipped = jax.tree.map(lambda g: (g * scale).astype(g.dtype), updates)
        return clipped, ClipByPreviousNormState(norm_fp32(updates))

    return optax.GradientTransformation(init, update)
