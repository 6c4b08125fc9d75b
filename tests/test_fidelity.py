"""Training fidelity against the fp32 policy (issue 20): the best FP8 recipe's loss within 0.25%.

The setting of the independent check that found the gap: a Llama of 4 layers, hidden 128,
4 heads, SwiGLU 384, byte vocabulary 256, trained on the ``"stdlib"`` corpus for 600 steps of
batch 8 x 128 tokens (AdamW, peak lr 1e-3 after 50 warmup steps, cosine to 1e-4, b2 0.95,
weight decay 0.1), the same initial weights and batches for every policy. The measure is the
mean training loss of the last 50 steps, relative to the fp32 policy's.

Measured on this CPU (2026-12-01, seed 0, FP8 runs with ``fp8_adamw``;
``bench/fidelity_tiny.py``, ``bench/results/fidelity_tiny_cpu_2026-12-01.json``): bf16 -0.00%,
COAT's default recipe (per-tensor E4M3 / E5M2, FP8 forward) +0.37%, FP8 forward with 1x128 /
128x128 blocks and E4M3 gradients +0.31%: an FP8 forward adds its rounding noise to the loss
it reports (fp32's final weights read +0.40% through COAT's forward). BF16 forward GEMMs with
FP8 backward GEMMs scaled per row, E4M3 gradients and COAT's FP8 saved activations: -0.13%
(the recipe the README recommends, asserted here); +0.047% since the LM head's backward GEMMs
take the loss gradient in BF16 (2026-12-06, ``coat_jax.ops.plain.head_logits``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import optax
import pytest

import coat_jax
from coat_jax.core.recipe import Fp8Recipe
from coat_jax.models.llama import LlamaConfig
from coat_jax.tools.quant_error import train_llama

TINY = LlamaConfig(vocab_size=256, dim=128, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=384)
STEPS, SEQ_LEN, BATCH, TAIL = 600, 128, 8, 50
FIDELITY_RECIPE = Fp8Recipe(forward_gemm="bf16", scaling="row", grad_format="e4m3")
TARGET = 0.0025


def schedule():
    return optax.warmup_cosine_decay_schedule(0.0, 1e-3, 50, STEPS, 1e-4)


def final_loss(precision: str, optimizer, recipe: Fp8Recipe | None = None) -> float:
    config = dataclasses.replace(TINY, precision=precision, fp8=recipe or Fp8Recipe())
    losses, _, _ = train_llama(optimizer, STEPS, config, seed=0, seq_len=SEQ_LEN,
                               batch_size=BATCH)  # fmt: skip
    assert np.all(np.isfinite(losses))
    return float(losses[-TAIL:].mean())


@pytest.mark.slow
def test_fidelity_recipe_within_quarter_percent_of_fp32():
    reference = final_loss("fp32", optax.adamw(schedule(), b2=0.95, weight_decay=0.1))
    fp8 = final_loss(
        "coat", coat_jax.fp8_adamw(schedule(), b2=0.95, weight_decay=0.1), FIDELITY_RECIPE
    )
    gap = fp8 / reference - 1.0
    assert reference < 1.7  # it learned (the first steps read ~5.5 nats/byte)
    assert abs(gap) <= TARGET, f"fp32 {reference:.5f}, FP8 {fp8:.5f}: gap {gap:+.3%}"
