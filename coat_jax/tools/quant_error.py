"""Quantization error of real Adam moments, the experiment of COAT's Table 1.

Trains the tiny Llama (``PRESETS["tiny"]`` of :mod:`coat_jax.models.llama`, precision
``"bf16"``) with ``optax.adamw`` on the CPU on the ``"stdlib"`` byte corpus of
:mod:`coat_jax.training.data`, takes the first and second moments ``m`` and ``v`` of every
matrix, quantizes them per group of ``--group-size`` along the last axis in each format pair,
with and without dynamic range expansion, and reports the error of what Adam uses,
``r = m / (sqrt(v) + eps)``:

* ``mse(m/sqrt v)``: mean of ``(r_hat - r)^2`` over all elements (the paper's Table 1 metric).
* ``rel mse m`` / ``rel mse v``: ``sum (x_hat - x)^2 / sum x^2`` of each moment alone.
* ``zeroed v``: fraction of nonzero ``v`` that quantized to 0 (``r_hat`` then explodes).

:func:`train_llama` (any optax optimizer, any Llama config, the same deterministic batches for a
given seed) is also what the optimizer's convergence tests and the quickstart example train.

Usage::

  python -m coat_jax.tools.quant_error [--steps 300] [--group-size 128] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from coat_jax.core.quant import dequantize, quantize
from coat_jax.models.llama import PRESETS, Llama, LlamaConfig, loss_fn
from coat_jax.training.data import BatchSampler, ByteTokenizer, load_tokens

TINY_LLAMA = dataclasses.replace(PRESETS["tiny"], precision="bf16")
SEQ_LEN = 64
BATCH_SIZE = 16
CONFIGS = [  # (m format, v format, expansion)
    ("e4m3", "e4m3", False),
    ("e4m3", "e4m3", True),
    ("e4m3", "e5m2", False),
    ("e4m3", "e5m2", True),
    ("e5m2", "e5m2", False),
    ("e5m2", "e5m2", True),
]
ADAM_EPS = 1e-8


@functools.cache
def stdlib_tokens() -> np.ndarray:
    """The ``"stdlib"`` corpus as byte tokens (read once per process)."""
    return load_tokens("stdlib", ByteTokenizer())


def train_llama(
    optimizer: optax.GradientTransformation,
    steps: int,
    config: LlamaConfig = TINY_LLAMA,
    seed: int = 0,
    seq_len: int = SEQ_LEN,
    batch_size: int = BATCH_SIZE,
) -> tuple[np.ndarray, nnx.State, optax.OptState]:
    """Trains ``Llama(config)`` (init from ``seed``) with ``optimizer`` for ``steps`` steps on
    the train split of the ``"stdlib"`` corpus; batch ``i`` is ``BatchSampler(tokens, seq_len,
    batch_size, seed).batch(i)``, so runs with the same seed see the same data.

    Returns:
      ``(losses, params, opt_state)``: each step's training loss (float32 ``(steps,)``), the
      ``nnx.split`` params after the last step and the optimizer's state.
    """
    if steps < 1:
        raise ValueError(f"steps must be positive, got {steps}")
    sampler = BatchSampler(stdlib_tokens(), seq_len, batch_size, seed)
    graph, params = nnx.split(Llama(config, rngs=nnx.Rngs(seed)))
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graph, p), tokens))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for i in range(steps):
        params, opt_state, loss = step(params, opt_state, sampler.batch(i, "train"))
        losses.append(loss)
    return np.asarray(jax.device_get(losses), np.float32), params, opt_state


def adam_moments(steps: int, lr: float, seed: int) -> tuple[list, list, float]:
    """``(m leaves, v leaves, final loss)`` of the matrices after ``steps`` of AdamW."""
    losses, _, state = train_llama(optax.adamw(lr), steps, seed=seed)
    adam_state = state[0]
    pairs = [
        (m, v)
        for m, v in zip(jax.tree.leaves(adam_state.mu), jax.tree.leaves(adam_state.nu), strict=True)
        if m.ndim >= 2
    ]
    return [p[0] for p in pairs], [p[1] for p in pairs], float(losses[-20:].mean())


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))
def _pair_sums(m, v, mu_fmt, nu_fmt, expand, group_size) -> dict:
    """The sums :func:`measure` adds up, for one pair of (stacked) moments."""
    m_hat = dequantize(quantize(m, mu_fmt, group_size=group_size, expand=expand))
    v_hat = dequantize(quantize(v, nu_fmt, group_size=group_size, expand=expand))
    r = m / (jnp.sqrt(v) + ADAM_EPS)
    r_hat = m_hat / (jnp.sqrt(jnp.maximum(v_hat, 0.0)) + ADAM_EPS)
    return {
        "sq_r": jnp.sum((r_hat - r) ** 2),
        "sq_m": jnp.sum((m_hat - m) ** 2),
        "sq_v": jnp.sum((v_hat - v) ** 2),
        "norm_m": jnp.sum(m**2),
        "norm_v": jnp.sum(v**2),
        "zeroed": jnp.sum((v > 0) & (v_hat == 0)),
        "nonzero": jnp.sum(v > 0),
    }


def measure(ms, vs, mu_fmt, nu_fmt, expand, group_size) -> dict:
    """Errors of quantizing every (m, v) pair with one configuration.

    Matrices with the same last axis are measured as one (rows stacked): the groups lie along
    the last axis, so stacking changes no group and compiles one function per width.
    """
    by_width: dict[int, list] = {}
    for m, v in zip(ms, vs, strict=True):
        width = m.shape[-1]
        by_width.setdefault(width, []).append((m.reshape(-1, width), v.reshape(-1, width)))
    sums = [
        _pair_sums(
            jnp.concatenate([m for m, _ in pairs]),
            jnp.concatenate([v for _, v in pairs]),
            mu_fmt,
            nu_fmt,
            expand,
            group_size,
        )
        for pairs in by_width.values()
    ]
    total = {k: sum(float(s[k]) for s in sums) for k in sums[0]}
    count = sum(m.size for m in ms)
    return {
        "m_format": mu_fmt,
        "v_format": nu_fmt,
        "expansion": expand,
        "mse_m_over_sqrt_v": total["sq_r"] / count,
        "rel_mse_m": total["sq_m"] / total["norm_m"],
        "rel_mse_v": total["sq_v"] / total["norm_v"],
        "zeroed_v_fraction": total["zeroed"] / max(total["nonzero"], 1),
    }


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| m | v | expansion | mse(m/sqrt v) | rel mse m | rel mse v | zeroed v |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['m_format'].upper()} | {r['v_format'].upper()} | "
            f"{'yes' if r['expansion'] else 'no'} | {r['mse_m_over_sqrt_v']:.4g} | "
            f"{r['rel_mse_m']:.3g} | {r['rel_mse_v']:.3g} | {r['zeroed_v_fraction']:.2%} |"
        )
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="AdamW steps before measuring")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.group_size < 1:
        parser.error("--steps and --group-size must be positive")

    ms, vs, loss = adam_moments(args.steps, args.lr, args.seed)
    rows = [measure(ms, vs, mf, vf, e, args.group_size) for mf, vf, e in CONFIGS]
    by_key = {(r["m_format"], r["v_format"], r["expansion"]): r for r in rows}
    gain = (
        by_key[("e4m3", "e4m3", False)]["mse_m_over_sqrt_v"]
        / by_key[("e4m3", "e4m3", True)]["mse_m_over_sqrt_v"]
    )
    n_params = sum(m.size for m in ms)
    print(
        f"Adam moments of {n_params} matrix parameters after {args.steps} AdamW steps "
        f"(tiny Llama on the stdlib bytes, loss {loss:.3f}); groups of {args.group_size} "
        "along the last axis.\n"
    )
    print(markdown_table(rows))
    print(f"\nExpansion lowers the E4M3+E4M3 mse(m/sqrt v) by {gain:.2f}x (paper: 1.63x).")
    result = {
        "date": datetime.date.today().isoformat(),
        "jax": jax.__version__,
        "device": jax.devices()[0].device_kind,
        "model": f"Llama {TINY_LLAMA.n_layers}x{TINY_LLAMA.dim} (PRESETS['tiny'], bf16)",
        "corpus": "stdlib",
        "seq_len": SEQ_LEN,
        "batch_size": BATCH_SIZE,
        "steps": args.steps,
        "lr": args.lr,
        "group_size": args.group_size,
        "seed": args.seed,
        "final_loss": loss,
        "matrix_params": n_params,
        "rows": rows,
        "expansion_gain_e4m3": gain,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
