"""FP8 GEMMs of a train step by operand scaling: time (quantization included) and error.

  PYTHONPATH=. python3 bench/scaled_gemm.py --json bench/results/scaled_gemm_h200_$(date +%F).json
  # other shapes: --tokens 8192 --dims 768,2048 (114M); --iters 20

For the MLP up projection of a Llama layer (``x (T, d) @ W (d, f)``; Llama-2-7B: d 4096,
f 11008, T = 16384 tokens = batch 8 x 2048) the three GEMMs of a train step:

* ``fwd``: ``y = x W`` (activation x weight),
* ``dgrad``: ``dx = dy W^T`` (output gradient x weight, contracted over f),
* ``wgrad``: ``dW = x^T dy`` (contracted over the tokens),

each from BF16 operands through the FP8 recipe's quantization to the BF16/fp32 result, per
``Fp8Recipe.scaling``: ``tensor`` (:func:`coat_jax.ops.flow.fp8_gemm`, XLA's cuBLASLt FP8),
``tensor`` with the FP8 dot algorithm named (``tensor_f32acc``: ``ANY_F8_ANY_F8_F32``, no fast
accumulation; ``tensor_fastacc``: ``ANY_F8_ANY_F8_F32_FAST_ACCUM``; the error column shows what
XLA's default is), ``row`` and ``block``
(:mod:`coat_jax.ops.scaled_gemm`), and BF16 as the baseline. Operands are Gaussian with the
features a trained model shows (activation outlier channels x30, per-token gradient scales over
three decades). Error: ``||C - C_ref|| / ||C_ref||`` against the fp32 product of the BF16
operands (``HIGHEST``). Time: median of ``--iters`` (host timing of the jitted call,
``coat_jax.core.measure``); TFLOP/s counts ``2 T d f``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from coat_jax.core import measure
from coat_jax.core.formats import get_format
from coat_jax.core.quant import quantize
from coat_jax.ops import scaled_gemm
from coat_jax.ops.flow import fp8_gemm

E4M3, E5M2 = get_format("e4m3"), get_format("e5m2")


def operands(tokens: int, d: int, f: int, seed: int = 0) -> dict:
    """BF16 ``x (T, d)``, ``W (d, f)``, ``dy (T, f)`` shaped like a trained layer's."""
    kx, kw, kg, ko, ks = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(kx, (tokens, d), jnp.float32)
    outliers = jax.random.choice(ko, d, (max(d // 256, 1),), replace=False)
    x = x.at[:, outliers].multiply(30.0)
    w = jax.random.normal(kw, (d, f), jnp.float32) * 0.02
    row_scale = 10.0 ** jax.random.uniform(ks, (tokens, 1), minval=-3.0, maxval=0.0)
    dy = jax.random.normal(kg, (tokens, f), jnp.float32) * row_scale * 1e-3
    return {k: v.astype(jnp.bfloat16) for k, v in (("x", x), ("w", w), ("dy", dy))}


def _tensor_dot(a, b, contract, fmt_a, fmt_b, precision=None):
    qa, qb = quantize(a, fmt_a), quantize(b, fmt_b)
    if precision is None:
        return fp8_gemm(qa, qb, contract, jnp.bfloat16)
    dims = (((contract[0],), (contract[1],)), ((), ()))
    out = jax.lax.dot_general(qa.data, qb.data, dims, precision=precision,
                              preferred_element_type=jnp.float32)  # fmt: skip
    return (out * (qa.scale * qb.scale)).astype(jnp.bfloat16)


def _scaled_dot(a, b, fmt_a, fmt_b, scaling, roles):
    """``a (M, K) . b (N, K)`` with both operands quantized along K."""
    qa = scaled_gemm.quantize_operand(a, fmt_a, scaling, roles[0])
    qb = scaled_gemm.quantize_operand(b, fmt_b, scaling, roles[1])
    return scaled_gemm.scaled_matmul(qa, qb, jnp.bfloat16)


def gemms(scaling: str, grad_fmt) -> dict:
    """``kind -> jitted fn(ops)`` of one scaling (``"bf16"`` for the BF16 baseline)."""
    if scaling == "bf16":
        return {
            "fwd": lambda o: jnp.dot(o["x"], o["w"]),
            "dgrad": lambda o: jnp.dot(o["dy"], o["w"].T),
            "wgrad": lambda o: jnp.dot(o["x"].T, o["dy"]),
        }
    if scaling.startswith("tensor"):
        dot = functools.partial(_tensor_dot, precision=ALGORITHMS.get(scaling))
        return {
            "fwd": lambda o: dot(o["x"], o["w"], (1, 0), E4M3, E4M3),
            "dgrad": lambda o: dot(o["dy"], o["w"], (1, 1), grad_fmt, E4M3),
            "wgrad": lambda o: dot(o["x"], o["dy"], (0, 0), E4M3, grad_fmt),
        }
    act, wt = "activation", "weight"
    return {
        "fwd": lambda o: _scaled_dot(o["x"], o["w"].T, E4M3, E4M3, scaling, (act, wt)),
        "dgrad": lambda o: _scaled_dot(o["dy"], o["w"], grad_fmt, E4M3, scaling, (act, wt)),
        "wgrad": lambda o: _scaled_dot(o["x"].T, o["dy"].T, E4M3, grad_fmt, scaling, (act, act)),
    }


def references(ops) -> dict:
    f32 = {k: v.astype(jnp.float32) for k, v in ops.items()}
    hi = functools.partial(jnp.dot, precision=jax.lax.Precision.HIGHEST)
    return {
        "fwd": hi(f32["x"], f32["w"]),
        "dgrad": hi(f32["dy"], f32["w"].T),
        "wgrad": hi(f32["x"].T, f32["dy"]),
    }


def rel_err(got, want) -> float:
    got = jnp.asarray(got, jnp.float32)
    return float(jnp.linalg.norm(got - want) / jnp.maximum(jnp.linalg.norm(want), 1e-30))


ALGORITHMS = {
    "tensor_f32acc": jax.lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32,
    "tensor_fastacc": jax.lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32_FAST_ACCUM,
}
SCALINGS = ("bf16", "tensor", "tensor_f32acc", "tensor_fastacc", "row", "block")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--dims", default="4096,11008", help="d,f of the projection")
    parser.add_argument("--grad_format", default="e4m3", choices=("e4m3", "e5m2"))
    parser.add_argument("--scalings", default=",".join(SCALINGS))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    d, f = (int(v) for v in args.dims.split(","))
    if min(args.tokens, d, f, args.iters) <= 0:
        raise SystemExit("bench/scaled_gemm.py: --tokens, --dims and --iters must be positive")
    if jax.default_backend() != "gpu":
        print(f"scaled_gemm.py: on {jax.default_backend()} the times say nothing of a GPU, and "
              "the default shapes take minutes (--tokens 256 --dims 256,512: a quick look)",
              flush=True)  # fmt: skip
    scalings = args.scalings.split(",")
    unknown = sorted(set(scalings) - set(SCALINGS))
    if unknown:
        raise SystemExit(f"bench/scaled_gemm.py: unknown scalings {unknown}; known {SCALINGS}")
    ops = operands(args.tokens, d, f)
    refs = references(ops)
    flop = 2.0 * args.tokens * d * f
    rows = []
    for scaling in scalings:
        for kind, fn in gemms(scaling, get_format(args.grad_format)).items():
            jitted = jax.jit(fn)
            try:
                err = rel_err(jitted(ops), refs[kind])
            except Exception as e:  # noqa: BLE001 (e.g. an FP8 dot algorithm off a GPU)
                print(f"{scaling:15s} {kind:6s} failed: {type(e).__name__}: {str(e)[:200]}")
                rows.append(dict(scaling=scaling, gemm=kind, failed=f"{type(e).__name__}"))
                continue
            ms = measure.time_calls(jitted, ops, warmup=2, iters=args.iters).median_ms
            rows.append(dict(scaling=scaling, gemm=kind, ms=ms, tflops=flop / ms / 1e9,
                             rel_err=err))  # fmt: skip
            print(f"{scaling:15s} {kind:6s} {ms:8.3f} ms {flop / ms / 1e9:8.1f} TFLOP/s "
                  f"err {err:.2e}", flush=True)  # fmt: skip
    print(f"\n| scaling | {' | '.join(k + ' ms (err)' for k in ('fwd', 'dgrad', 'wgrad'))} |")
    print("|---|---|---|---|")
    for scaling in scalings:
        cells = [f"{r['ms']:.3f} ({r['rel_err']:.1e})" if "ms" in r else "failed"
                 for r in rows if r["scaling"] == scaling]  # fmt: skip
        print(f"| {scaling} | {' | '.join(cells)} |")
    if args.json:
        meta = dict(date=datetime.date.today().isoformat(), device=jax.devices()[0].device_kind,
                    jax=jax.__version__, tokens=args.tokens, d=d, f=f,
                    grad_format=args.grad_format, iters=args.iters)  # fmt: skip
        with open(args.json, "w") as fh:
            json.dump(dict(meta=meta, rows=rows), fh, indent=1)


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
