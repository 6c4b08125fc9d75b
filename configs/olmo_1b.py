"""OLMo-1B shapes (1.18B params: 2048 wide, 16 layers, 16 heads, SwiGLU 8192, LayerNorm without
weight or bias, tied embeddings), context 2048, FP8 states and activations (COAT): the paper's
1B pretraining run (REFERENCE.md section 3).

Needs OLMo's tokenizer (``--config.data.tokenizer=/path/to/tokenizer.json``, 50280 tokens in
the 50304-row embedding) or the byte tokenizer (default). Check memory first:
``python train.py --config configs/olmo_1b.py --dry_run``.
"""

from coat_jax.training.configs import pretraining_config


def get_config():
    return pretraining_config("olmo_1b")
