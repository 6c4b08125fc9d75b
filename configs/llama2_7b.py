"""Llama-2-7B shapes (6.74B params), context 2048, FP8 states and activations (COAT).

Needs the Llama-2 tokenizer (``--config.data.tokenizer=/path/to/tokenizer.json``) or the byte
tokenizer (default, vocab 256 inside the 32000-row embedding). Check memory first:
``python train.py --config configs/llama2_7b.py --dry_run``.
"""

from coat_jax.training.configs import pretraining_config


def get_config():
    return pretraining_config("llama2_7b")
