"""What backward keeps: bytes of the residuals a function saves for its VJP.

``jax.vjp`` returns the backward function as a pytree whose leaves are exactly the residuals
saved by the forward (custom_vjp residuals included), so their bytes are what the policy under
test keeps alive between forward and backward, before XLA's buffer reuse.
"""

from __future__ import annotations

import jax

__all__ = [
    "activation_bytes_per_example",
    "saved_activation_bytes_abstract",
    "saved_residual_bytes",
]


def saved_residual_bytes(f, *args) -> int:
    """Bytes of the residuals ``jax.vjp(f, *args)`` saves (each distinct array once).

    Inputs that backward reads count too: they must stay alive until backward.
    """
    _, vjp_fn = jax.vjp(f, *args)
    unique = {id(x): x for x in jax.tree.leaves(vjp_fn)}
    return sum(x.nbytes for x in unique.values())


def activation_bytes_per_example(make_args, f) -> int:
    """Residual bytes that scale with the batch: the difference between batch 2 and batch 1.

    Args:
      make_args: ``batch -> args`` of ``f``; only the batch-dependent arguments may change.
      f: the function whose residuals to measure.
    """
    return saved_residual_bytes(f, *make_args(2)) - saved_residual_bytes(f, *make_args(1))


def saved_activation_bytes_abstract(f, *args, batch_dims: tuple[int, ...]) -> int:
    """Bytes of the residuals ``jax.vjp(f, *args)`` saves whose leading dims are ``batch_dims``,
    from shapes alone (``jax.eval_shape``: nothing is computed or allocated)."""
    residuals = jax.eval_shape(lambda *a: jax.vjp(f, *a)[1], *args)
    n = len(batch_dims)
    return sum(
        r.size * r.dtype.itemsize
        for r in jax.tree.leaves(residuals)
        if r.ndim >= n and tuple(r.shape[:n]) == tuple(batch_dims)
    )
