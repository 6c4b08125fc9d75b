"""The tests' in-process run of ``configs/llama_tiny.py``: built from overrides, and trained on
random tokens (step ``i`` reads ``jax.random.key(100 + i)``, the same batches in every test)."""

import pathlib

import jax
import numpy as np

from coat_jax.training import configs
from coat_jax.training.run import Run, assemble

ROOT = pathlib.Path(__file__).resolve().parents[1]


def tiny_run(**overrides) -> Run:
    """``configs/llama_tiny.py`` with ``overrides`` (``{"optimizer.kernels": ...}``), checked
    and assembled."""
    config = configs.load_file(str(ROOT / "configs" / "llama_tiny.py"), overrides)
    configs.validate(config)
    return assemble(config)


def train(run: Run, steps: int):
    """``(params, opt_state, metrics of each step)`` after ``steps`` steps from ``run.create()``."""
    params, opt_state = run.create()
    metrics = []
    for i in range(steps):
        tokens = jax.random.randint(jax.random.key(100 + i), run.batch_shape(), 0, 256)
        params, opt_state, m = run.train_step(params, opt_state, tokens)
        metrics.append(m)
    return params, opt_state, metrics


def assert_trains_identically(overrides: dict, key: str, values, steps: int = 3):
    """``steps`` steps of :func:`tiny_run` with ``overrides`` and ``key`` set to each of the two
    ``values``: the losses and the final weights are equal bit for bit."""
    (p0, _, m0), (p1, _, m1) = (train(tiny_run(**overrides, **{key: v}), steps) for v in values)
    assert [float(m["loss"]) for m in m0] == [float(m["loss"]) for m in m1]
    for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(p1), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
