"""fp8_adamw in five minutes: the tiny Llama trained with optax.adamw and coat_jax.fp8_adamw.

  python examples/fp8_adamw_quickstart.py [--steps 300]

Prints the optimizer-state bytes of a Llama-2-7B-shaped parameter tree (computed abstractly,
nothing allocated) and the training loss of each optimizer on the tiny Llama
(``PRESETS["tiny"]``, bf16) on the Python standard library's source bytes, on the CPU or GPU.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import optax

import coat_jax
from coat_jax.tools.quant_error import train_llama


def llama2_7b_shapes() -> dict:
    """Parameter shapes of Llama-2-7B (32 layers, hidden 4096, MLP 11008, vocab 32000)."""
    layer = {
        "wq": (4096, 4096), "wk": (4096, 4096), "wv": (4096, 4096), "wo": (4096, 4096),
        "w_gate": (4096, 11008), "w_up": (4096, 11008), "w_down": (11008, 4096),
        "attn_norm": (4096,), "mlp_norm": (4096,),
    }  # fmt: skip
    tree = {f"layer_{i}": dict(layer) for i in range(32)}
    tree.update(embed=(32000, 4096), lm_head=(4096, 32000), final_norm=(4096,))
    return jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s, jnp.float32), tree, is_leaf=lambda x: isinstance(x, tuple)
    )


def state_bytes(opt, params) -> int:
    state = jax.eval_shape(opt.init, params)
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()

    params = llama2_7b_shapes()
    n = sum(x.size for x in jax.tree.leaves(params))
    print(f"Optimizer state for Llama-2-7B ({n / 1e9:.2f}B params):")
    for name, opt in [("optax.adamw", optax.adamw(1e-4)), ("fp8_adamw", coat_jax.fp8_adamw(1e-4))]:
        b = state_bytes(opt, params)
        print(f"  {name:12s} {b / 2**30:6.1f} GiB  ({b / n:.3f} bytes/param)")

    print(f"\nTiny Llama, {args.steps} steps on {jax.devices()[0].device_kind}:")
    optimizers = {
        "optax.adamw": optax.adamw(3e-3),
        "fp8_adamw": coat_jax.fp8_adamw(3e-3, min_size=0),
        "fp8_adamw, no expansion": coat_jax.fp8_adamw(3e-3, min_size=0, expansion=False),
    }
    for name, opt in optimizers.items():
        start = time.perf_counter()
        losses, _, _ = train_llama(opt, args.steps)
        print(
            f"  {name:24s} loss {losses[:10].mean():.3f} -> {losses[-30:].mean():.3f}"
            f"  ({time.perf_counter() - start:.1f} s)"
        )


if __name__ == "__main__":
    main()
