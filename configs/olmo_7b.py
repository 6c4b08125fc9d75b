"""OLMo-7B shapes (6.89B params: 4096 wide, 32 layers, 32 heads, SwiGLU 11008, LayerNorm
without weight or bias, untied head), context 2048, FP8 states and activations (COAT): the
paper's 7B pretraining run (REFERENCE.md section 3).

Needs OLMo's tokenizer (``--config.data.tokenizer=/path/to/tokenizer.json``, 50280 tokens in
the 50304-row embedding) or the byte tokenizer (default). Check memory first:
``python train.py --config configs/olmo_7b.py --dry_run``.
"""

from coat_jax.training.configs import pretraining_config


def get_config():
    return pretraining_config("olmo_7b")
