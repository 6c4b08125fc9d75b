"""The tests' in-process run of ``configs/llama_tiny.py``: built from overrides, and trained on
random tokens (step ``i`` reads ``jax.random.key(100 + i)``, the same batches in every test)."""

import pathlib

import jax

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
