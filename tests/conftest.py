"""Shared pytest setup: hypothesis profiles and the `gpu` marker."""

import os

import jax
import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "default", deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "ci", deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("ci" if os.environ.get("CI") else "default")


def _has_hopper_gpu() -> bool:
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        return False
    return any(getattr(d, "compute_capability", "0") >= "9.0" for d in devices)


def pytest_collection_modifyitems(config, items):
    if _has_hopper_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA Hopper GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
