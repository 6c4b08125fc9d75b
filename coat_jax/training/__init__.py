"""Layer 4, runs: configs, data, checkpoints, placement on a mesh, the optimizer and train
step a config asks for, the run assembly (:func:`coat_jax.training.run.assemble`), the
memory planner and the largest batch, metrics. ``train.py`` and ``bench/`` build on it."""
