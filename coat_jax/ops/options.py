"""Options shared by the FP8 optimizers (``fp8_adamw``, ``fp8_state``): defaults and checks.

Sizes that shape the state (``group_size``, ``min_size``) must be static Python ints; their
``None`` defaults keep them out of ``optax.inject_hyperparams``' numeric hyperparameters.
"""

from __future__ import annotations

import operator

import jax

from coat_jax.core.formats import get_format

__all__ = ["DEFAULT_GROUP_SIZE", "DEFAULT_MIN_SIZE", "check_format", "static_int"]

DEFAULT_GROUP_SIZE = 128
"""Largest quantization group along a parameter's last axis."""
DEFAULT_MIN_SIZE = 16384
"""Parameters with fewer elements keep fp32 moments: norm scales and biases up to hidden 16k."""


def check_format(name, what: str):
    """The :class:`~coat_jax.core.formats.Fp8Format` named ``name`` (``None`` passes through);
    a bad name raises a ValueError prefixed by ``what``."""
    if name is None:
        return None
    try:
        return get_format(name)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None


def static_int(value, what: str, minimum: int, default: int) -> int:
    """``value`` as a static Python int ``>= minimum`` (``None``: ``default``). A traced or
    array value (``optax.inject_hyperparams`` makes numbers arrays) is refused saying how to
    keep it static."""
    if value is None:
        return default
    if isinstance(value, (bool, jax.Array)):
        raise TypeError(
            f"{what} must be a static Python int, got {type(value).__name__}; with "
            "optax.inject_hyperparams pass static_args=('group_size', 'min_size')"
        )
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__}") from None
    if value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value}")
    return value
