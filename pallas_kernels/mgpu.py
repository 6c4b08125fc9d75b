"""What the Mosaic GPU kernels share: the guarded import of jax's Mosaic GPU Pallas, the check
that it is there, a ``plgpu.load`` that works on jax 0.10 and 0.11, and the device's SM count.

Modules import ``pl`` and ``plgpu`` from here so that they import (and their references and
helpers run) on a jax build without Mosaic GPU; the kernels call :func:`require` first.
"""

from __future__ import annotations

import inspect

import jax

try:  # the kernels need jax's Mosaic GPU Pallas; the references and helpers do not
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError as e:  # pragma: no cover - depends on the jax build
    pl = plgpu = None
    IMPORT_ERROR: Exception | None = e
else:
    IMPORT_ERROR = None

__all__ = ["IMPORT_ERROR", "load", "num_sms", "pl", "plgpu", "require"]


def require(who: str) -> None:
    """Raises ``ValueError`` naming ``who`` when this jax has no Mosaic GPU Pallas."""
    if IMPORT_ERROR is not None:
        raise ValueError(f"{who} needs Mosaic GPU Pallas: {IMPORT_ERROR}")


def load(ref, layout, **kwargs):
    """``plgpu.load(ref, layout=...)``: jax 0.11 takes the index through ``ref.at`` (a separate
    index is deprecated there), jax 0.10 requires the index argument."""
    if inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty:
        return plgpu.load(ref, (), layout=layout, **kwargs)
    return plgpu.load(ref, layout=layout, **kwargs)


def num_sms() -> int:
    """Streaming multiprocessors of the first device (132 on an H100/H200 when unreported)."""
    return int(getattr(jax.devices()[0], "core_count", 0) or 132)
