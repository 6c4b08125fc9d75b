"""Shared pytest setup: hypothesis profiles, the `gpu` and `xla_cpu` markers, slow tests first,
GPU memory shared between parallel workers (`pytest -n`) and a persistent compile cache."""

import os
import tempfile

if os.environ.get("PYTEST_XDIST_WORKER"):  # before JAX starts: workers share each GPU
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# One persistent XLA cache for every test, worker and child process (train.py, benches), kept
# across runs on this machine (JAX keys entries by program, backend and version), for compiles
# of 1 s or more: caching every compile made a run of small-program tests 2.6x slower (61 ->
# 160 s). On the 2-core CPU, 2026-12-04, three train-step files: 189 s without, 186 s cold,
# 84 s warm. Set JAX_COMPILATION_CACHE_DIR to choose the place, or "" for none.
_CACHE = os.path.join(tempfile.gettempdir(), f"coat_jax_pytest_xla_cache_{os.getuid()}")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(2 << 30))  # LRU beyond 2 GiB

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
