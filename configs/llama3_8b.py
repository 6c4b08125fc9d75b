"""Llama-3-8B shapes (8.03B params, GQA with 8 kv heads), context 2048, COAT FP8 training.

Needs the Llama-3 tokenizer (``--config.data.tokenizer=/path/to/tokenizer.json``) or the byte
tokenizer (default, vocab 256 inside the 128256-row embedding). Check memory first:
``python train.py --config configs/llama3_8b.py --dry_run``.
"""

from coat_jax.training.configs import pretraining_config


def get_config():
    return pretraining_config("llama3_8b")
