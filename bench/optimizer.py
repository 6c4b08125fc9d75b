"""Optimizer step time on a 1B-parameter Llama-shaped pytree: optax.adamw vs coat_jax.fp8_adamw.

  python bench/optimizer.py [--layers 5] [--json out.json]

Five Llama-2-7B layers (1.01B fp32 parameters). Each step is jitted with params and state donated;
median of --steps timed steps after warm-up. Bytes per parameter count reads and writes of params,
gradients and state (fp32 AdamW: 28; FP8 AdamW: 4+4+4 + 2x(1+1) + scales).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import coat_jax

LAYER = {
    "wq": (4096, 4096), "wk": (4096, 4096), "wv": (4096, 4096), "wo": (4096, 4096),
    "w_gate": (4096, 11008), "w_up": (4096, 11008), "w_down": (11008, 4096),
}  # fmt: skip


def tree_bytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def time_optimizer(opt, params, grads, steps) -> tuple[float, int]:
    state = opt.init(params)
    state_bytes = tree_bytes(state)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params, state = step(params, state, grads)
    jax.block_until_ready(params)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        params, state = step(params, state, grads)
        jax.block_until_ready(params)
        times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times)), state_bytes


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
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
        "optax.adamw (fp32 m, v)": optax.adamw(1e-4),
        "fp8_adamw (jnp, expansion)": coat_jax.fp8_adamw(1e-4, kernels="reference"),
        "fp8_adamw (jnp, no expansion)": coat_jax.fp8_adamw(
            1e-4, expansion=False, kernels="reference"
        ),
    }
    if jax.default_backend() == "gpu":
        optimizers["fp8_adamw (Pallas fused moments, expansion)"] = coat_jax.fp8_adamw(
            1e-4, kernels="pallas"
        )
        optimizers["fp8_adamw (Pallas fused moments, no expansion)"] = coat_jax.fp8_adamw(
            1e-4, expansion=False, kernels="pallas"
        )
    rows = []
    for name, opt in optimizers.items():
        ms, state_bytes = time_optimizer(opt, make(0.02), grads, args.steps)
        moved = 3 * 4 + 2 * state_bytes / n  # params r+w, grads r; state r+w
        rows.append(
            {"optimizer": name, "median_ms": ms, "state_bytes_per_param": state_bytes / n,
             "bytes_moved_per_param": moved, "effective_GBps": moved * n / (ms * 1e-3) / 1e9}
        )  # fmt: skip
    print(f"\n{n / 1e9:.2f}B params, {jax.devices()[0].device_kind}, jax {jax.__version__}")
    print("| optimizer | ms | state B/param | moved B/param | GB/s |\n|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['optimizer']} | {r['median_ms']:.2f} | {r['state_bytes_per_param']:.3f} | "
            f"{r['bytes_moved_per_param']:.1f} | {r['effective_GBps']:.0f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind,
                 "jax": jax.__version__, "params": n, "rows": rows}, f, indent=2,
            )  # fmt: skip


if __name__ == "__main__":
    main()
