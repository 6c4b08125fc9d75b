"""Fidelity of FP8 recipes on the CPU: the tiny setting of tests/test_fidelity.py, per recipe.

  python bench/fidelity_tiny.py --json bench/results/fidelity_tiny_cpu_$(date +%F).json
  # --recipes fp32,coat,coat_bf16fwd_row_e4 --seeds 0,1 --optimizer adamw --forward_noise

A Llama of 4 layers, hidden 128, SwiGLU 384, byte vocabulary 256; 600 steps of batch 8 x 128
tokens of the ``"stdlib"`` corpus (warmup 50, cosine 1e-3 -> 1e-4, b2 0.95, weight decay 0.1),
the same weights and batches for every recipe of a seed. Reported: the mean training loss of
the last 50 steps and its gap to the ``fp32`` run of the same seed. ``--forward_noise``
also evaluates the fp32 run's final weights through each recipe's forward on those 50 batches:
the loss an FP8 forward adds at equal weights (no training involved). About 70 s per run on
two CPU cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json

import jax
import numpy as np
import optax
from flax import nnx

import coat_jax
from coat_jax.core.recipe import Fp8Recipe
from coat_jax.models.llama import Llama, LlamaConfig, loss_fn
from coat_jax.tools.quant_error import stdlib_tokens, train_llama
from coat_jax.training.data import BatchSampler

TINY = LlamaConfig(vocab_size=256, dim=128, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=384)
STEPS, SEQ_LEN, BATCH, TAIL = 600, 128, 8, 50
E4 = dict(grad_format="e4m3")
RECIPES = {  # name -> (precision, FP8 recipe)
    "fp32": ("fp32", Fp8Recipe()),
    "bf16": ("bf16", Fp8Recipe()),
    "fp8_linear": ("fp8_linear", Fp8Recipe()),
    "coat": ("coat", Fp8Recipe()),
    "coat_block_e4": ("coat", Fp8Recipe(scaling="block", **E4)),
    "coat_row_e4": ("coat", Fp8Recipe(scaling="row", **E4)),
    # every FP8 GEMM writes a BF16 product before its scales (one more rounding; +2.1% tokens/s
    # on the 7B step, docs/results.md)
    "coat_bf16prod": ("coat", Fp8Recipe(gemm_product="bf16")),
    # per-tensor scales rounded up to powers of two, alone and with the BF16 product (which
    # then rounds once, as the fp32 one does)
    "coat_pow2": ("coat", Fp8Recipe(pow2_scales=True)),
    "coat_pow2_bf16prod": ("coat", Fp8Recipe(pow2_scales=True, gemm_product="bf16")),
    "coat_bf16fwd": ("coat", Fp8Recipe(forward_gemm="bf16")),
    "coat_bf16fwd_row_e4": ("coat", Fp8Recipe(forward_gemm="bf16", scaling="row", **E4)),
    "coat_bf16fwd_block_e4": ("coat", Fp8Recipe(forward_gemm="bf16", scaling="block", **E4)),
    # COAT with the fused MLP and the fused backward kernels (Pallas interpret mode: the kernels'
    # own arithmetic, ~30x slower than the XLA ops on a CPU): what `auto` runs on one Hopper GPU
    "coat_fused": ("coat", Fp8Recipe(fused_mlp="interpret", fused_backward="interpret")),
}
DEFAULT = "fp32,bf16,coat,coat_block_e4,coat_bf16fwd,coat_bf16fwd_row_e4,coat_bf16fwd_block_e4"


def optimizer(name: str, precision: str):
    lr = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 50, STEPS, 1e-4)
    if name == "fp8_adamw" and precision != "fp32":  # the reference keeps fp32 AdamW
        return coat_jax.fp8_adamw(lr, b2=0.95, weight_decay=0.1)
    return optax.adamw(lr, b2=0.95, weight_decay=0.1)


def forward_noise(params, seed: int, names) -> dict:
    """Mean loss of the last ``TAIL`` batches with ``params`` through each recipe's forward."""
    sampler = BatchSampler(stdlib_tokens(), SEQ_LEN, BATCH, seed)
    batches = [sampler.batch(i, "train") for i in range(STEPS - TAIL, STEPS)]
    out = {}
    for name in names:
        precision, recipe = RECIPES[name]
        config = dataclasses.replace(TINY, precision=precision, fp8=recipe)
        graph, _ = nnx.split(Llama(config, rngs=nnx.Rngs(seed)))
        loss = jax.jit(lambda p, t, g=graph: loss_fn(nnx.merge(g, p), t))
        out[name] = float(np.mean([float(loss(params, b)) for b in batches]))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", default=DEFAULT, help=f"from {list(RECIPES)}")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--optimizer", default="fp8_adamw", choices=("fp8_adamw", "adamw"))
    parser.add_argument("--forward_noise", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    names = args.recipes.split(",")
    if unknown := sorted(set(names) - set(RECIPES)):
        raise SystemExit(f"fidelity_tiny.py: unknown recipes {unknown}; known {list(RECIPES)}")
    if "fp32" not in names:
        names.insert(0, "fp32")
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        raise SystemExit(f"fidelity_tiny.py: bad --seeds {args.seeds!r}") from None
    rows = []
    for seed in seeds:
        ref, ref_params = None, None
        for name in names:
            precision, recipe = RECIPES[name]
            config = dataclasses.replace(TINY, precision=precision, fp8=recipe)
            opt = optimizer(args.optimizer, precision)
            losses, params, _ = train_llama(opt, STEPS, config, seed, SEQ_LEN, BATCH)
            final = float(losses[-TAIL:].mean())
            if name == "fp32":
                ref, ref_params = final, params
            rows.append(dict(recipe=name, seed=seed, final_loss=final, gap=final / ref - 1))
            print(f"seed {seed} {name:24s} {final:.5f} {final / ref - 1:+.3%}", flush=True)
        if args.forward_noise:
            noise = forward_noise(ref_params, seed, names)
            for row in rows[-len(names) :]:
                row["fp32_weights_loss"] = noise[row["recipe"]]
                row["forward_noise"] = noise[row["recipe"]] / noise["fp32"] - 1
    print("\n| recipe | " + " | ".join(f"seed {s} gap" for s in seeds) + " | forward noise |")
    print("|---|" + "---|" * (len(seeds) + 1))
    for name in names:
        mine = [r for r in rows if r["recipe"] == name]
        noise = mine[0].get("forward_noise")
        cells = [f"{r['final_loss']:.4f} ({r['gap']:+.2%})" for r in mine]
        noise = "-" if noise is None else f"{noise:+.2%}"
        print(f"| {name} | " + " | ".join(cells) + f" | {noise} |")
    if args.json:
        meta = dict(date=datetime.date.today().isoformat(), device="cpu", jax=jax.__version__,
                    optimizer=args.optimizer, steps=STEPS, batch=BATCH, seq_len=SEQ_LEN,
                    model=dataclasses.asdict(TINY) | {"fp8": None},
                    recipes={n: [RECIPES[n][0], dataclasses.asdict(RECIPES[n][1])] for n in names})
        with open(args.json, "w") as fh:
            json.dump(dict(meta=meta, rows=rows), fh, indent=1, default=str)


if __name__ == "__main__":
    main()
