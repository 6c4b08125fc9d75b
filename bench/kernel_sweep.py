"""Tuning sweep of the memory-bound Pallas kernels: time every candidate tuning, keep the best.

  python bench/kernel_sweep.py [--rows 4096 --cols 11008] [--json out.json]
  python bench/kernel_sweep.py --rows 16 --cols 256 --max-candidates 2   # CPU smoke (interpret)

Kernels: the fused FP8 Adam moment step (``adam_step``, candidates from
``adam_step.tuning_candidates()``), the full-fusion AdamW update (``adam_update``, same
candidates), the per-group quantize at 1x16 and 1x128 (``quantize_tuning_candidates()``; on a
Hopper GPU also the Mosaic GPU kernel, ``quantize_mgpu.mgpu_tuning_candidates()``), on one
``(rows, cols)`` fp32 tensor, and the per-tensor quantize into both layouts of that tensor in
bf16 to E5M2, as a backward's output gradient (``transpose_tuning_candidates()``). Each Adam
candidate: median over --iters samples of the mean of --inner back-to-back launches
(``coat_jax.core.measure.time_loop``), state fed forward and donated (as in a training loop),
so the update kernel's in-place aliasing is what is timed; each quantize candidate on a GPU:
the median device time CUPTI reports (``coat_jax.core.measure.kernel_time``; host timing of
these ~0.1 ms kernels measured their launches), as is the copy. GB/s counts each
input read once and each output written once; "of copy" relates it to a device copy of the same
fp32 tensor (read + write). A candidate that fails to compile is recorded with its error and
skipped. Off a GPU the kernels run in interpret mode (times meaningless; the point is that the
script cannot rot).
"""

from __future__ import annotations

import argparse
import datetime
import json

import jax
import jax.numpy as jnp

from coat_jax.core import adam, measure
from coat_jax.core.quant import quantize
from pallas_kernels import adam_step, adam_update, dispatch
from pallas_kernels import quantize as kq
from pallas_kernels import quantize_mgpu as km

B1, B2 = 0.9, 0.95


def kernel_cases(rows: int, cols: int, interpret: bool):
    """``{name: (candidates, make_step(tuning) -> (step, carry), bytes moved)}``."""
    n = rows * cols
    keys = jax.random.split(jax.random.key(0), 4)
    g = jax.random.normal(keys[0], (rows, cols)) * 1e-3
    p = jax.random.normal(keys[1], (rows, cols)) * 0.02
    mu = quantize(jax.random.normal(keys[2], (rows, cols)) * 1e-4, group_size=128, expand=True)
    nu = quantize(jnp.exp(jax.random.normal(keys[3], (rows, cols))) * 1e-7, group_size=128,
                  expand=True)  # fmt: skip
    moments_bytes = 2 * 2 * (n + n // 128 * 5)  # FP8 codes + amax + k, read and written
    coeffs = adam.coefficients(B1, B2, 1e-8, 0.0, 5)  # the 5th step
    hyper = adam_update.update_vector(coeffs, 1e-4, 0.1, 1.0)  # lr, weight decay, clip scale

    fresh = lambda *tree: jax.tree.map(jnp.copy, tree)  # each candidate donates its own copy

    def moments_step(tuning):
        fn = lambda c: adam_step.fp8_adam_moments(
            g, c[1], c[2], coeffs, tuning=tuning, interpret=interpret
        )
        return jax.jit(fn, donate_argnums=0), fresh(g, mu, nu)

    def update_step(tuning):
        fn = lambda c: adam_update.leaf_kernel(
            c[0], g, c[1], c[2], hyper, True, tuning=tuning, interpret=interpret
        )
        return jax.jit(fn, donate_argnums=0), fresh(p, mu, nu)

    def quantize_step(group):
        def make(tuning):
            fn = lambda x: (kq.quantize_per_group(x, "e4m3", group, tuning=tuning,
                                                  interpret=interpret), x)[::-1]  # fmt: skip
            return jax.jit(lambda c: fn(c[0])), (g, None)

        return make

    def transpose_step(tuning):  # a backward's output gradient: bf16 in, E5M2 in both layouts
        fn = lambda x: (kq.quantize_transpose_per_tensor(x, 4.0, "e5m2", tuning=tuning,
                                                         interpret=interpret), x)[::-1]  # fmt: skip
        return jax.jit(lambda c: fn(c[0])), (g.astype(jnp.bfloat16), None)

    def mgpu_quantize_step(group):
        def make(tuning):
            fn = lambda x: (km.quantize_per_group_mgpu(x, "e4m3", group, tuning=tuning), x)[::-1]
            return jax.jit(lambda c: fn(c[0])), (g, None)

        return make

    cases = {
        "adam_step (moments, expansion)": (
            adam_step.tuning_candidates(),
            moments_step,
            8 * n + moments_bytes,
        ),
        "adam_update (full AdamW, expansion)": (
            adam_step.tuning_candidates(),
            update_step,
            12 * n + moments_bytes,
        ),
    }
    for group in (16, 128):
        cases[f"quantize per-group 1x{group} fp32"] = (
            kq.quantize_tuning_candidates(),
            quantize_step(group),
            5 * n + n // group * 4,
        )
    cases["quantize + transpose bf16 -> e5m2"] = (
        kq.transpose_tuning_candidates(),
        transpose_step,
        4 * n,  # 2 bytes read, 1 + 1 written
    )
    if not interpret:  # the Mosaic GPU kernel has no interpret mode: timed on a Hopper GPU only
        for group in (16, 128):
            cases[f"quantize per-group 1x{group} fp32, Mosaic GPU"] = (
                km.mgpu_tuning_candidates(),
                mgpu_quantize_step(group),
                5 * n + n // group * 4,
            )
    return cases


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=11008)
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--inner", type=int, default=10, help="launches per timed sample")
    parser.add_argument("--max-candidates", type=int, default=0, help="0: all")
    parser.add_argument("--kernels", default="", help="substring filter on kernel names")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    interpret = not dispatch.hopper_gpu()
    if interpret and args.rows * args.cols > 2**20:
        print(f"kernel_sweep.py: the kernels run interpreted on {jax.default_backend()}: "
              f"{args.rows}x{args.cols} takes minutes (--rows 16 --cols 256: a quick look)",
              flush=True)  # fmt: skip
    n = args.rows * args.cols
    host_ms = lambda step, carry: measure.time_loop(step, carry, iters=args.iters,
                                                    inner=args.inner)[0].median_ms  # fmt: skip

    def median_ms(step, carry, stateless: bool) -> float:
        """Device time (CUPTI) of a stateless step on a GPU: the quantize kernels take ~0.1 ms,
        which host timing of back-to-back calls measured as their launch cost (the transpose
        kernel: 1.2 TB/s here against 2.8 TB/s inside a 7B step, H100, 2026-12-07)."""
        if stateless and not interpret:
            return measure.kernel_time(step, carry, iters=args.iters)[0]
        return host_ms(step, carry)

    copy_ms = median_ms(jax.jit(lambda x: x * 2), jnp.ones((args.rows, args.cols)), True)
    copy_gbps = 8 * n / copy_ms / 1e6
    results = {}
    device = f"{jax.devices()[0].device_kind}, jax {jax.__version__}"

    def save():  # after each kernel, so that a run stopped by its time limit keeps what it timed
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"date": datetime.date.today().isoformat(), "device": device,
                           "interpret": interpret, "shape": [args.rows, args.cols],
                           "copy_GBps": copy_gbps, "iters": args.iters, "inner": args.inner,
                           "kernels": results}, f, indent=2)  # fmt: skip

    for name, (candidates, make, nbytes) in kernel_cases(args.rows, args.cols, interpret).items():
        if args.kernels not in name:
            continue
        if args.max_candidates:
            candidates = candidates[: args.max_candidates]
        rows = []
        for tuning in candidates:
            row = {"tuning": {k: v for k, v in vars(tuning).items()}}
            try:
                step, carry = make(tuning)
                ms = median_ms(step, carry, stateless=name.startswith("quantize"))
                row.update(ms=ms, GBps=nbytes / ms / 1e6)
            except Exception as e:  # a candidate that does not compile (smem, layout)
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            print(f"  {name} {row}", flush=True)
        timed = [r for r in rows if "ms" in r]
        best = min(timed, key=lambda r: r["ms"]) if timed else None
        results[name] = {"bytes": nbytes, "best": best, "candidates": rows}
        save()

    mode = "interpret mode: times are not kernel speed" if interpret else "compiled"
    print(f"\n{args.rows}x{args.cols} fp32, {device} ({mode}); copy {copy_gbps:.0f} GB/s")
    print(
        "| kernel | best tuning | ms | GB/s | of copy | candidates ok |\n|---|---|---|---|---|---|"
    )
    for name, r in results.items():
        ok = sum("ms" in c for c in r["candidates"])
        b = r["best"]
        if b is None:
            print(f"| {name} | none compiled | - | - | - | 0/{len(r['candidates'])} |")
            continue
        t = ", ".join(f"{k}={v}" for k, v in b["tuning"].items())
        print(f"| {name} | {t} | {b['ms']:.3f} | {b['GBps']:.0f} | "
              f"{b['GBps'] / copy_gbps:.0%} | {ok}/{len(r['candidates'])} |")  # fmt: skip
    return results


if __name__ == "__main__":
    main()
