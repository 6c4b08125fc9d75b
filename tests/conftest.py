"""Shared pytest setup: hypothesis profiles, the `gpu` marker, slow tests first, GPU memory
shared between parallel workers (`pytest -n`), and one XLA compilation cache for the session."""

import atexit
import os
import shutil
import tempfile

if os.environ.get("PYTEST_XDIST_WORKER"):  # before JAX starts: workers share each GPU
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
elif "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    # Many tests compile the same programs (llama_tiny's step, train.py in subprocesses): one
    # persistent cache for this session, which the xdist workers and every subprocess inherit
    # through the environment, removed at exit. Compiles over 0.5 s only.
    _cache = tempfile.mkdtemp(prefix="coat_jax_test_xla_cache_")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

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
