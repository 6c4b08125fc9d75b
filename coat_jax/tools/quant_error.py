"""Quantization error of real Adam moments, the experiment of COAT's Table 1.

Trains the tiny byte-level LM of :mod:`coat_jax.tools.tiny_lm` with ``optax.adamw`` on the CPU,
takes its first and second moments ``m`` and ``v`` of every matrix, quantizes them per group of
``--group-size`` along the last axis in each format pair, with and without dynamic range
expansion, and reports the error of what Adam uses, ``r = m / (sqrt(v) + eps)``:

* ``mse(m/sqrt v)``: mean of ``(r_hat - r)^2`` over all elements (the paper's Table 1 metric).
* ``rel mse m`` / ``rel mse v``: ``sum (x_hat - x)^2 / sum x^2`` of each moment alone.
* ``zeroed v``: fraction of nonzero ``v`` that quantized to 0 (``r_hat`` then explodes).

Usage::

  python -m coat_jax.tools.quant_error [--steps 300] [--group-size 128] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import jax
import jax.numpy as jnp
import optax

from coat_jax.quant import dequantize, quantize
from coat_jax.tools import tiny_lm

CONFIGS = [  # (m format, v format, expansion)
    ("e4m3", "e4m3", False),
    ("e4m3", "e4m3", True),
    ("e4m3", "e5m2", False),
    ("e4m3", "e5m2", True),
    ("e5m2", "e5m2", False),
    ("e5m2", "e5m2", True),
]
ADAM_EPS = 1e-8


def adam_moments(steps: int, lr: float, seed: int) -> tuple[list, list, float]:
    """``(m leaves, v leaves, final loss)`` of the matrices after ``steps`` of AdamW."""
    losses, _, state = tiny_lm.train(optax.adamw(lr), steps, seed=seed)
    adam_state = state[0]
    pairs = [
        (m, v)
        for m, v in zip(jax.tree.leaves(adam_state.mu), jax.tree.leaves(adam_state.nu), strict=True)
        if m.ndim >= 2
    ]
    return [p[0] for p in pairs], [p[1] for p in pairs], float(losses[-20:].mean())


def measure(ms, vs, mu_fmt, nu_fmt, expand, group_size) -> dict:
    """Errors of quantizing every (m, v) pair with one configuration."""
    sq_r = sq_m = sq_v = norm_m = norm_v = 0.0
    count = zeroed = nonzero = 0
    for m, v in zip(ms, vs, strict=True):
        m_hat = dequantize(quantize(m, mu_fmt, group_size=group_size, expand=expand))
        v_hat = dequantize(quantize(v, nu_fmt, group_size=group_size, expand=expand))
        r = m / (jnp.sqrt(v) + ADAM_EPS)
        r_hat = m_hat / (jnp.sqrt(jnp.maximum(v_hat, 0.0)) + ADAM_EPS)
        sq_r += float(jnp.sum((r_hat - r) ** 2))
        sq_m += float(jnp.sum((m_hat - m) ** 2))
        sq_v += float(jnp.sum((v_hat - v) ** 2))
        norm_m += float(jnp.sum(m**2))
        norm_v += float(jnp.sum(v**2))
        count += m.size
        zeroed += int(jnp.sum((v > 0) & (v_hat == 0)))
        nonzero += int(jnp.sum(v > 0))
    return {
        "m_format": mu_fmt,
        "v_format": nu_fmt,
        "expansion": expand,
        "mse_m_over_sqrt_v": sq_r / count,
        "rel_mse_m": sq_m / norm_m,
        "rel_mse_v": sq_v / norm_v,
        "zeroed_v_fraction": zeroed / max(nonzero, 1),
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
        f"(tiny byte LM, loss {loss:.3f}); groups of {args.group_size} along the last axis.\n"
    )
    print(markdown_table(rows))
    print(f"\nExpansion lowers the E4M3+E4M3 mse(m/sqrt v) by {gain:.2f}x (paper: 1.63x).")
    result = {
        "date": datetime.date.today().isoformat(),
        "jax": jax.__version__,
        "device": jax.devices()[0].device_kind,
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
