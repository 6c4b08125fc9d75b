"""The device allocator a training run assumes, set before JAX starts its backend.

XLA's GPU allocator decides the largest batch as much as the program does: a train step's one
large temporary buffer (55-98 GiB for Llama-2-7B at its largest batches on an H200) needs one
contiguous region. With a growing pool (``XLA_PYTHON_CLIENT_PREALLOCATE=false``) the regions
carved while parameters are created do not coalesce, and batches whose plan fits still run out
of memory; with JAX's default fraction (0.75) a quarter of the GPU is never used. So, unless
the user set them, :func:`configure` sets

* ``XLA_PYTHON_CLIENT_PREALLOCATE=true``: one region, whose freed chunks coalesce;
* ``XLA_PYTHON_CLIENT_MEM_FRACTION=0.95``: the allocator may use 95% of each GPU;

the settings under which the planner's largest batch (``coat_jax.training.planner``) and the
benchmarks' were measured. Variables the user set are left alone. Neither matters on a CPU.
Another process sharing the GPU needs a smaller fraction (set it yourself).
"""

from __future__ import annotations

import os

__all__ = ["DEFAULTS", "configure"]

DEFAULTS = {"XLA_PYTHON_CLIENT_PREALLOCATE": "true", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95"}


def configure(environ=None) -> dict[str, str]:
    """Sets each of :data:`DEFAULTS` that ``environ`` (default ``os.environ``) lacks; returns
    the ones it set. Call before anything starts JAX's backend (the first device query)."""
    environ = os.environ if environ is None else environ
    added = {k: v for k, v in DEFAULTS.items() if k not in environ}
    environ.update(added)
    return added
