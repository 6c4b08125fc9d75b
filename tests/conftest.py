"""Shared pytest setup: hypothesis profiles and the `gpu` marker."""

import os

import pytest
from hypothesis import HealthCheck, settings

from pallas_kernels.dispatch import hopper_gpu

settings.register_profile(
    "default", deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "ci", deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("ci" if os.environ.get("CI") else "default")


def pytest_collection_modifyitems(config, items):
    if hopper_gpu():  # the kernels' own dispatch rule
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA Hopper GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
