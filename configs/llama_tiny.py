"""A 2-layer, 64-wide Llama for tests and smoke runs (seconds on a CPU)."""

from coat_jax.training.configs import base_config


def get_config():
    config = base_config()
    config.batch_size, config.seq_len, config.steps = 8, 64, 40
    config.optimizer.warmup_steps = 5
    config.log_interval, config.eval_interval, config.checkpoint_interval = 10, 20, 20
    config.eval_batches = 2
    config.workdir = "runs/llama_tiny"
    config.progress = False
    return config
