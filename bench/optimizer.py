"""Optimizer step time on a 1B-parameter Llama-shaped pytree: optax.adamw vs coat_jax.fp8_adamw
and the full-fusion FP8 AdamW update (coat_jax.fused_fp8_adamw_update).

  python bench/optimizer.py [--layers 5] [--json out.json]

Five Llama-2-7B layers (1.01B fp32 parameters). Each step is jitted with params and state
donated; median of --steps timed steps after warm-up (``coat_jax.core.measure.time_loop``).
Bytes per parameter are what each step must move at the least: reads and writes of params and
state and a read of the gradients (fp32 AdamW: 28; FP8 AdamW: 4+4+4 + 2x(1+1) + scales = 16.2;
BF16 master weights with a 16-bit remainder the same, 8-bit 14.2; on a GPU also those rows);
GB/s divides them by the time, and "vs adamw" is optax.adamw's time over the row's (higher is
faster).
"""

from __future__ import annotations

import argparse
import datetime
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax

import coat_jax
from coat_jax.core import measure
from coat_jax.ops.master_weights import split_tree
from pallas_kernels import dispatch

LAYER = {
    "wq": (4096, 4096), "wk": (4096, 4096), "wv": (4096, 4096), "wo": (4096, 4096),
    "w_gate": (4096, 11008), "w_up": (4096, 11008), "w_down": (11008, 4096),
}  # fmt: skip


def tree_bytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def optax_step(opt):
    def step(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return opt.init, step


def fused_step(kernels: str):
    """``coat_jax.fused_fp8_adamw_update`` with fp8_adamw's defaults (weight decay 1e-4)."""
    adam = coat_jax.scale_by_fp8_adam(kernels="reference")
    return adam.init, lambda params, state, grads: coat_jax.fused_fp8_adamw_update(
        params, grads, state, 1e-4, weight_decay=1e-4, kernels=kernels
    )


def fused_master_step(kernels: str, bits: int):
    """:func:`fused_step` on BF16 master weights: the carried parameters are ``(BF16 parts,
    remainders)`` of ``bits``; ``kernels="reference"`` rebuilds fp32 around the XLA update,
    ``"auto"`` around the fp32 kernel, ``"pallas"`` runs the kernel on the parts."""
    adam = coat_jax.scale_by_fp8_adam(kernels="reference")

    def step(parts, state, grads):
        hi, remainder, state = coat_jax.fused_fp8_adamw_update(
            parts[0], grads, state, 1e-4, weight_decay=1e-4, kernels=kernels, remainder=parts[1]
        )
        return (hi, remainder), state

    return adam.init, step, jax.jit(lambda params: split_tree(params, bits))


def time_optimizer(init_and_step, params, grads, steps) -> tuple[float, int, int]:
    """``(median ms, state bytes, parameter bytes)`` of one optimizer's jitted, donated step;
    a third element of ``init_and_step`` turns the fp32 params into what the step carries."""
    init, step, *carried = init_and_step
    state = init(params)
    if carried:
        params = carried[0](params)
    state_bytes, param_bytes = tree_bytes(state), tree_bytes(params)
    step = jax.jit(step, donate_argnums=(0, 1))
    timing, _ = measure.time_loop(lambda carry: step(*carry, grads), (params, state), iters=steps)
    return timing.median_ms, state_bytes, param_bytes


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--only", default="",
                        help="comma-separated substrings of the rows to time (optax.adamw, the "
                             "ratios' base, always runs)")  # fmt: skip
    parser.add_argument("--json")
    args = parser.parse_args()

    shapes = {f"layer{i}": LAYER for i in range(args.layers)}
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(jax.random.key(0), len(leaves))
    make = lambda scale: treedef.unflatten(
        [jax.random.normal(k, s, jnp.float32) * scale for k, s in zip(keys, leaves, strict=True)]
    )
    grads = make(1e-3)
    n = sum(int(np.prod(s)) for s in leaves)
    optimizers = {
        "optax.adamw (fp32 m, v)": optax_step(optax.adamw(1e-4)),
        "fp8_adamw (jnp, expansion)": optax_step(coat_jax.fp8_adamw(1e-4, kernels="reference")),
        "fp8_adamw (jnp, no expansion)": optax_step(
            coat_jax.fp8_adamw(1e-4, expansion=False, kernels="reference")
        ),
        "fused FP8 AdamW update (XLA jnp reference, expansion)": fused_step("reference"),
    }
    if dispatch.hopper_gpu():
        optimizers["fp8_adamw (Pallas fused moments, expansion)"] = optax_step(
            coat_jax.fp8_adamw(1e-4, kernels="pallas")
        )
        optimizers["fused FP8 AdamW update (Pallas, expansion)"] = fused_step("pallas")
        for bits in (16, 8):  # BF16 master weights: parts in the kernel vs fp32 rebuilt around it
            optimizers[f"fused, BF16 + {bits}-bit remainder (Pallas on the parts)"] = (
                fused_master_step("pallas", bits))  # fmt: skip
        optimizers["fused, BF16 + 16-bit remainder (fp32 rebuilt around the Pallas kernel)"] = (
            fused_master_step("auto", 16))  # fmt: skip
    wanted = [w for w in args.only.split(",") if w]
    base = "optax.adamw (fp32 m, v)"
    optimizers = {name: fn for name, fn in optimizers.items()
                  if name == base or not wanted or any(w in name for w in wanted)}  # fmt: skip
    rows = []
    for name, init_and_step in optimizers.items():
        ms, state_bytes, param_bytes = time_optimizer(init_and_step, make(0.02), grads,
                                                      args.steps)  # fmt: skip
        moved = (2 * param_bytes + 4 * n + 2 * state_bytes) / n  # params r+w, grads r; state r+w
        rows.append(
            {"optimizer": name, "median_ms": ms, "state_bytes_per_param": state_bytes / n,
             "bytes_moved_per_param": moved, "effective_GBps": moved * n / (ms * 1e-3) / 1e9}
        )  # fmt: skip
    for r in rows:
        r["speedup_vs_optax_adamw"] = rows[0]["median_ms"] / r["median_ms"]
    print(f"\n{n / 1e9:.2f}B params, {jax.devices()[0].device_kind}, jax {jax.__version__}")
    print("| optimizer | ms | state B/param | moved B/param | GB/s | vs adamw |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['optimizer']} | {r['median_ms']:.2f} | {r['state_bytes_per_param']:.3f} | "
            f"{r['bytes_moved_per_param']:.1f} | {r['effective_GBps']:.0f} | "
            f"{r['speedup_vs_optax_adamw']:.2f}x |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind,
                 "jax": jax.__version__, "params": n, "rows": rows}, f, indent=2,
            )  # fmt: skip


if __name__ == "__main__":
    main()
