"""Llama-2-7B shapes, context 2048, at the largest batch one H200 holds: COAT with every
memory option.

- the optimizer step inside the backward pass (``optimizer.update_in_backward``: each weight's
  gradient is consumed where it appears; clipping by the previous step's norm),
- BF16 master weights with a lossy 8-bit residual (``bf16+8``; two 114M seeds within 0.3% of
  fp32 master in train loss, docs/results.md) and BF16 gradients,
- weights requantized in backward instead of keeping their FP8 codes
  (``fp8.saved_weights=requantize``), the loss 512 positions at a time (``model.loss_chunk``),
- the attention branch recomputed in backward (``model.recompute_attention``: the same
  gradients, q/k/v not saved; one more q/k/v projection and attention forward a layer).

Measured on one H200 (jax 0.11.2, 2026-12-02, train.py's allocator: preallocated, 0.95): batch
32 trains at 17,630 tokens/s, MFU 0.76, peak 138.9 GB (compiled step 41.98 GB at batch 2, 3.24
GB a sequence more); bf16 + adamw's largest batch is 6, COAT's default 12
(bench/results/train_llama2_7b_b32_memory_options_h200_2026-12-02.*, docs/results.md).
On another GPU let the planner choose: ``--config.batch_size=-1`` (compiles only, then trains).
"""

from coat_jax.training.configs import pretraining_config


def get_config():
    config = pretraining_config("llama2_7b")
    config.optimizer.update_in_backward = True
    config.optimizer.master_weights = "bf16+8"
    config.grad_dtype = "bfloat16"
    config.fp8.saved_weights = "requantize"
    config.model.loss_chunk = 512
    config.model.recompute_attention = True
    config.batch_size = 32  # the largest the compiled step's line put under train.py's limit
    return config
