"""Llama-2-13B shapes (13.0B params), context 2048, on ONE H200: COAT's FP8 states and
activations, BF16 master weights with an exact 16-bit remainder, BF16 gradients, chunked loss.

Persistent bytes per parameter: BF16 weights 2 + remainder 2 + BF16 gradients 2 + FP8 AdamW
state ~2.1 = ~8.1 (fp32 master weights and gradients: ~10.1, 131 GB for 13B, which leaves no
room for activations on a 141 GB H200). ``--config.optimizer.master_weights=bf16+8`` keeps a
lossy 8-bit residual instead (~7.1 B/param). Check memory and the largest batch first
(``--dry_run``); ``--config.batch_size=-1`` trains at the largest batch that fits. Not yet run
on a GPU (2026-12-01): the planner's figures are estimates until a measured row lands in
bench/results.
"""

from coat_jax.training.configs import pretraining_config


def get_config():
    config = pretraining_config("llama2_13b")
    config.optimizer.master_weights = "bf16+16"
    config.grad_dtype = "bfloat16"
    config.model.loss_chunk = 512  # positions: 4 x 512 x 32000 x 4 B = 262 MB of logits at batch 4
    return config
