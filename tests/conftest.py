"""Shared pytest setup: hypothesis profiles, the `gpu` marker, slow tests first, GPU memory
shared between parallel workers (`pytest -n`), and a faster XLA compile level on CPU hosts."""

import os

if os.environ.get("PYTEST_XDIST_WORKER"):  # before JAX starts: workers share each GPU
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# On a host without an NVIDIA GPU (CI, the 2-core machine) the suite is bound by XLA's CPU
# compiles: LLVM at -O1 compiles them ~25-30% faster than the default and ran the tiny Llama's
# FP8 train step as fast (108 vs 111 ms a step; -O0 was 6x slower to run). Set before JAX
# starts, unless the user chose a level; the tests' subprocesses inherit it (those that set
# their own XLA_FLAGS append to it). GPU hosts keep XLA's defaults.
CPU_COMPILE_LEVEL = "--xla_backend_optimization_level=1"
if not os.path.exists("/dev/nvidiactl") and "xla_backend_optimization_level" not in os.environ.get(
    "XLA_FLAGS", ""
):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {CPU_COMPILE_LEVEL}".strip()

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
    if hopper_gpu():  # the kernels' own dispatch rule
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA Hopper GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
