"""How a per-tensor FP8 GEMM's scales and BF16 output reach XLA's cuBLASLt FP8 call.

  PYTHONPATH=. python3 bench/fp8_epilogue.py [--shapes 8192x4096x4096] [--json out.json]

``coat_jax.ops.flow.fp8_gemm`` multiplies two FP8 operands ``a (M, K)``, ``b (N, K)`` with
scales ``s_a``, ``s_b``: ``out = bf16(s_a s_b sum_k a_mk b_nk)``. XLA rewrites a ``dot`` of FP8
codes into ``__cublas$lt$matmul$f8``; whether the scale multiply and the cast to BF16 join that
call (cuBLASLt's epilogue) or stay a fusion of their own that reads the fp32 product back
depends on how the jnp code spells them. Each pattern below is compiled and reported with the
GEMM's output type, the fusions left beside it, its time (``coat_jax.core.measure.kernel_time``:
CUPTI on a GPU) and its error against an fp64 product of the same codes (the cuBLASLt FP8 GEMM
keeps ~14 bits in its accumulation: ~2e-3 at K = 4096 on an H200).

On a CPU nothing is rewritten: the script runs (patterns checked against each other) and says
that the HLO holds no cuBLASLt call.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re

import jax
import jax.numpy as jnp
import numpy as np

from coat_jax.core import formats, measure
from coat_jax.core.quant import quantize
from coat_jax.core.recipe import Fp8Recipe
from coat_jax.ops import flow

CONTRACT = (((1,), (1,)), ((), ()))


def _dot(a, b, dtype):
    return jax.lax.dot_general(a, b, CONTRACT, preferred_element_type=dtype)


def _shipped(gemm_product: str):
    """``flow.fp8_gemm`` itself, with ``Fp8Recipe(gemm_product=...)``."""
    recipe = Fp8Recipe(gemm_product=gemm_product)
    return lambda qa, qb: flow.fp8_gemm(qa, qb, (1, 1), jnp.bfloat16, recipe)


def _dequantized_f32(qa, qb):
    da, db = qa.data.astype(jnp.float32) * qa.scale, qb.data.astype(jnp.float32) * qb.scale
    return _dot(da, db, jnp.float32).astype(jnp.bfloat16)


def _dequantized_f32_bf16_out(qa, qb):
    da, db = qa.data.astype(jnp.float32) * qa.scale, qb.data.astype(jnp.float32) * qb.scale
    return _dot(da, db, jnp.bfloat16)


def _dequantized_bf16_scales(qa, qb):  # flax.linen.fp8_ops' spelling
    bf = jnp.bfloat16
    return _dot(qa.data.astype(bf) * qa.scale.astype(bf), qb.data.astype(bf) * qb.scale.astype(bf),
                bf)  # fmt: skip


PATTERNS = {
    "f32 product, scaled, cast (shipped)": _shipped("fp32"),
    "bf16 product, scaled in f32, cast": _shipped("bf16"),
    "dequantized in f32, f32 dot, cast": _dequantized_f32,
    "dequantized in f32, bf16 dot": _dequantized_f32_bf16_out,
    "dequantized in bf16 (bf16 scales), bf16 dot": _dequantized_bf16_scales,
}
"""Spellings of ``bf16(s_a s_b (a @ b^T))`` for per-tensor FP8 operands ``qa (M, K)``,
``qb (N, K)``; the first two are ``flow.fp8_gemm`` (``Fp8Recipe.gemm_product``)."""


def hlo_summary(compiled_text: str) -> dict:
    """The cuBLASLt FP8 call's output type and the other non-trivial ops of a compiled GEMM."""
    gemm = re.search(r"= \(?(\w+\[[\d,]*\])[^\n]*custom_call_target=\"__cublas\$lt\$matmul\$f8\"",
                     compiled_text)  # fmt: skip
    fusions = re.findall(r"= (\w+\[[\d,]*\])\S* fusion\(", compiled_text)
    return {"cublaslt_f8": gemm is not None, "gemm_out": gemm.group(1) if gemm else None,
            "fusions": fusions}  # fmt: skip


def run(shapes, iters: int) -> list[dict]:
    rows = []
    for m, k, n in shapes:
        ka, kb = jax.random.split(jax.random.key(0))
        qa = quantize(jax.random.normal(ka, (m, k), jnp.float32), formats.E4M3)
        qb = quantize(jax.random.normal(kb, (n, k), jnp.float32) * 0.02, formats.E4M3)
        exact = (np.asarray(qa.data, np.float64) @ np.asarray(qb.data, np.float64).T) * (
            float(qa.scale) * float(qb.scale))  # fmt: skip
        for name, fn in PATTERNS.items():
            jitted = jax.jit(fn)
            info = hlo_summary(jitted.lower(qa, qb).compile().as_text())
            out = np.asarray(jitted(qa, qb), np.float64)
            rel = float(np.linalg.norm(out - exact) / np.linalg.norm(exact))
            ms, how = measure.kernel_time(jitted, qa, qb, iters=iters)
            row = {"shape": [m, k, n], "pattern": name, "ms": ms, "timer": how,
                   "tflops": 2 * m * k * n / ms / 1e9, "rel_error": rel, **info}  # fmt: skip
            rows.append(row)
            print(f"| {m}x{k}x{n} | {name} | {info['gemm_out']} | {len(info['fusions'])} "
                  f"{','.join(info['fusions'][:3])} | {ms:.3f} | {row['tflops']:.0f} | "
                  f"{rel:.2e} |", flush=True)  # fmt: skip
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="8192x4096x4096,8192x4096x11008",
                        help="comma-separated MxKxN")  # fmt: skip
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    try:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        if any(len(s) != 3 or min(s) < 1 for s in shapes):
            raise ValueError
    except ValueError:
        parser.error(f"--shapes {args.shapes!r}: expected MxKxN[,MxKxN...] of positive ints")
    if jax.default_backend() != "gpu" and max(m * k * n for m, k, n in shapes) > 2**30:
        print(f"fp8_epilogue.py: these shapes take minutes on {jax.default_backend()} "
              "(--shapes 256x256x256: a quick look)", flush=True)  # fmt: skip
    print("| MxKxN | pattern | cuBLASLt FP8 output | fusions beside it | ms | TFLOP/s | rel. error "
          "vs fp64 |\n|---|---|---|---|---|---|---|")  # fmt: skip
    rows = run(shapes, args.iters)
    device = jax.devices()[0]
    if not any(r["cublaslt_f8"] for r in rows):
        print(f"no cuBLASLt FP8 call on {device.platform}: nothing is rewritten here")
    result = {"date": datetime.date.today().isoformat(), "device": device.device_kind,
              "jax": jax.__version__, "rows": rows}  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
