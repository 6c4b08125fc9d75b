"""Llama-2-7B shapes (6.74B params), context 2048, FP8 states and activations (COAT).

Needs the Llama-2 tokenizer (``--config.data.tokenizer=/path/to/tokenizer.json``) or the byte
tokenizer (default, vocab 256 inside the 32000-row embedding). Check memory first:
``python train.py --config configs/llama2_7b.py --dry_run``.
"""

from coat_jax.configs import base_config, model_fields


def get_config():
    config = base_config()
    config.model = model_fields("llama2_7b")
    config.batch_size, config.seq_len, config.steps = 1, 2048, 1000
    config.optimizer.update(lr=3e-4, warmup_steps=100)
    config.log_interval, config.eval_interval, config.checkpoint_interval = 10, 200, 500
    config.workdir = "runs/llama2_7b"
    return config
