"""Shared pytest setup: hypothesis profiles, the `gpu` marker, slow tests first, and GPU
memory shared between parallel workers (`pytest -n`)."""

import os

if os.environ.get("PYTEST_XDIST_WORKER"):  # before JAX starts: workers share each GPU
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from pallas_kernels.dispatch import hopper_gpu  # noqa: E402

settings.register_profile(
    "default", deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "ci", deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("ci" if os.environ.get("CI") else "default")


def pytest_collection_modifyitems(config, items):
    # Tests marked slow first (a stable sort): under `pytest -n` the long ones start at once
    # instead of leaving one worker busy after the other has finished.
    items.sort(key=lambda item: "slow" not in item.keywords)
    if jax.default_backend() != "cpu":
        # XLA:GPU picks GEMM algorithms and fusions per program, so two programs that compute
        # the same math agree to rounding, not bit for bit, and its HLO and buffers differ
        on_cpu = pytest.mark.skip(reason="xla_cpu: bit-level or HLO claims about XLA:CPU")
        for item in items:
            if "xla_cpu" in item.keywords:
                item.add_marker(on_cpu)
    if hopper_gpu():  # the kernels' own dispatch rule
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA Hopper GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
