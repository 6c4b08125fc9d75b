"""Memory-bound kernels on the GPU: Pallas quantize kernels vs the XLA-compiled jnp reference.

  python bench/quantize_kernels.py [--rows 8192 --cols 8192] [--json out.json]

Rows "Pallas" are the Triton-backend kernels (pallas_kernels/quantize.py), "Pallas Mosaic GPU"
the Mosaic GPU per-group quantize (pallas_kernels/quantize_mgpu.py, Hopper only).

For each kernel: the median over --iters samples of the mean time of --inner back-to-back
launches (``coat_jax.core.measure.time_loop``; dispatch is asynchronous, so launch latency
overlaps the previous launch; inputs rotate over 3 buffers), the bytes it must move (each input
read once, each output written once; the standalone two-stage per-tensor quantize reads its
input twice) and the achieved GB/s, next to a device copy (read + write).
"""

from __future__ import annotations

import argparse
import datetime
import json

import jax
import jax.numpy as jnp

from coat_jax.core import measure
from coat_jax.core.quant import dequantize, quantize
from pallas_kernels import dispatch
from pallas_kernels import quantize as kq
from pallas_kernels import quantize_mgpu as km


def median_ms(fn, inputs, iters: int, inner: int) -> float:
    """Median ms of ``fn`` over ``iters`` samples of ``inner`` launches, the inputs in turn."""
    step = lambda carry: (carry[0] + 1, fn(inputs[carry[0] % len(inputs)]))
    return measure.time_loop(step, (0, None), iters=iters, inner=inner)[0].median_ms


def _quantize_both(x):
    """The jnp twin of the fused transpose+quantize: codes and transposed codes, amax 4."""
    q = quantize(x, "e4m3", amax=jnp.float32(4.0))
    return q.data, q.data.T


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--cols", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--inner", type=int, default=10, help="launches per timed sample")
    parser.add_argument("--json")
    args = parser.parse_args()
    if not dispatch.hopper_gpu():
        raise SystemExit("quantize_kernels.py: the Pallas kernels compile for a Hopper GPU only "
                         "(bench/kernel_sweep.py runs them interpreted anywhere)")  # fmt: skip
    n = args.rows * args.cols
    rows = []

    def record(name, fn, inputs, nbytes):  # fn jitted: the wrappers' reshapes are free there
        ms = median_ms(fn, inputs, args.iters, args.inner)
        rows.append({"kernel": name, "ms": ms, "bytes": nbytes, "GBps": nbytes / ms / 1e6})

    for dtype in (jnp.float32, jnp.bfloat16):
        keys = jax.random.split(jax.random.key(0), 3)
        xs = [jax.random.normal(k, (args.rows, args.cols), dtype) for k in keys]
        b = jnp.dtype(dtype).itemsize
        tag = jnp.dtype(dtype).name
        record(f"copy {tag} (x * 2)", jax.jit(lambda x: x * 2), xs, 2 * b * n)
        for g in (16, 128):
            moved = n * (b + 1) + n // g * 4
            record(f"per-group 1x{g} {tag}, XLA jnp", jax.jit(
                lambda x, g=g: quantize(x, "e4m3", group_size=g)), xs, moved)  # fmt: skip
            record(f"per-group 1x{g} {tag}, Pallas", jax.jit(lambda x, g=g: kq.quantize_per_group(
                x, "e4m3", g)), xs, moved)  # fmt: skip
            record(f"per-group 1x{g} {tag}, Pallas Mosaic GPU",
                   jax.jit(lambda x, g=g: km.quantize_per_group_mgpu(x, "e4m3", g)), xs,
                   moved)  # fmt: skip
        record(f"per-tensor {tag}, XLA jnp", jax.jit(lambda x: quantize(x, "e4m3")), xs,
               n * (2 * b + 1))  # fmt: skip
        record(f"per-tensor {tag}, Pallas two-stage", jax.jit(kq.quantize_per_tensor), xs,
               n * (2 * b + 1))  # fmt: skip
        # backward-GEMM operands: codes in both layouts from a known amax (one read, two writes)
        record(f"transpose+quantize per-tensor {tag}, XLA jnp", jax.jit(_quantize_both), xs,
               n * (b + 2))  # fmt: skip
        record(f"transpose+quantize per-tensor {tag}, Pallas",
               jax.jit(lambda x: kq.quantize_transpose_per_tensor(x, 4.0)), xs,
               n * (b + 2))  # fmt: skip
    qs = [kq.quantize_per_group(jax.random.normal(k, (args.rows, args.cols)), "e4m3", 16)
          for k in jax.random.split(jax.random.key(1), 3)]  # fmt: skip
    moved = n * (1 + 4) + n // 16 * 4
    record("dequantize 1x16 -> f32, XLA jnp", jax.jit(dequantize), qs, moved)
    record("dequantize 1x16 -> f32, Pallas", jax.jit(kq.dequantize_per_group), qs, moved)

    device = f"{jax.devices()[0].device_kind}, jax {jax.__version__}"
    print(f"\n{args.rows}x{args.cols}, median of {args.iters} x {args.inner} launches, {device}")
    print("| kernel | ms | MB moved | GB/s |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['kernel']} | {r['ms']:.3f} | {r['bytes'] / 1e6:.0f} | {r['GBps']:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": datetime.date.today().isoformat(), "device": device,
                       "shape": [args.rows, args.cols], "iters": args.iters,
                       "inner": args.inner, "rows": rows}, f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
