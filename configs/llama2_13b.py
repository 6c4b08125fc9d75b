"""Llama-2-13B shapes (13.0B params), context 2048, on ONE H200: COAT's FP8 states and
activations, BF16 master weights with an exact 16-bit remainder, BF16 gradients, chunked loss.

Persistent bytes per parameter: BF16 weights 2 + remainder 2 + BF16 gradients 2 + FP8 AdamW
state ~2.1 = ~8.1 (fp32 master weights and gradients: ~10.1, 131 GB for 13B, which leaves no
room for activations on a 141 GB H200). ``--config.optimizer.master_weights=bf16+8`` keeps a
lossy 8-bit residual instead (~7.1 B/param).

Measured on one H200 (jax 0.11.2, 2026-12-01, train.py's allocator: preallocated, 0.95): batch 4
trains at 8,100 tokens/s, MFU 0.67, peak 131 GiB of 132.8; batch 5 runs out of memory
(bench/results/train_llama2_13b_*_h200_2026-12-01.*, docs/results.md).
"""

from coat_jax.training.configs import pretraining_config


def get_config():
    config = pretraining_config("llama2_13b")
    config.optimizer.master_weights = "bf16+16"
    config.grad_dtype = "bfloat16"
    config.batch_size = 4  # the largest that ran on one H200
    config.model.loss_chunk = 512  # positions: 4 x 512 x 32000 x 4 B = 262 MB of logits at batch 4
    return config
