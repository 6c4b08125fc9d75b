"""Llama-3-8B shapes (8.03B params, GQA with 8 kv heads), context 2048, COAT FP8 training.

Needs the Llama-3 tokenizer (``--config.data.tokenizer=/path/to/tokenizer.json``) or the byte
tokenizer (default, vocab 256 inside the 128256-row embedding). Check memory first:
``python train.py --config configs/llama3_8b.py --dry_run``.
"""

from coat_jax.configs import base_config, model_fields


def get_config():
    config = base_config()
    config.model = model_fields("llama3_8b")
    config.batch_size, config.seq_len, config.steps = 1, 2048, 1000
    config.optimizer.update(lr=3e-4, warmup_steps=100)
    config.log_interval, config.eval_interval, config.checkpoint_interval = 10, 200, 500
    config.workdir = "runs/llama3_8b"
    return config
