"""Where the fused FP8 AdamW update's time goes: the kernel as shipped beside copies of it with
parts of its per-tile math taken out, on one ``(rows, cols)`` fp32 leaf.

  python bench/adam_ablation.py [--rows 4096 --cols 11008] [--json out.json]
  python bench/adam_ablation.py --variants shipped     # the kernel alone (any checkout)

Variants (``pallas_kernels.adam_update.leaf_kernel``, same operands, tiles and bytes; every
variant but ``shipped`` computes wrong moments on purpose: they are timings, not optimizers):

* ``shipped``: the kernel as the library runs it, at each tuning of ``--tunings``.
* ``io only``: loads and stores everything, the moments pass through, ``p + lr g`` the only
  math: the floor this tile layout allows (also at each tuning).
* ``no expansion``: the moments decoded and encoded by plain absmax scaling (the ``k`` codes
  pass through): what the range expansion's ``log`` / ``exp2`` and group statistics cost.
* ``IEEE direction``: the Adam direction with the reference's three divisions and square root
  instead of the kernel's ``rcp.approx`` / ``sqrt.approx`` (what the approximation buys).

Two more rows: ``tiles only``, a Pallas kernel of the same tiles that streams the parameter,
gradient and both code arrays but no per-group ``amax`` / ``k`` arrays (``p + lr g``, codes
copied): what those small per-row operands cost; and ``optax.adamw`` (XLA, fp32 moments,
donated) on the same leaf: what XLA's own fusion streams (28 bytes a parameter). GB/s counts
each operand read once and each output written once (as ``bench/kernel_sweep.py``); "of copy"
relates it to a device copy of one fp32 tensor of the leaf's size. Off a GPU the
kernel runs in interpret mode (times meaningless; the script cannot rot).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json

import jax
import jax.numpy as jnp
import optax
from jax.experimental import pallas as pl
from kernel_sweep import kernel_cases

from coat_jax.core import adam, measure
from coat_jax.core.quant import decode, encode
from pallas_kernels import adam_step, adam_update, dispatch

CASE = "adam_update (full AdamW, expansion)"


def _io_only(grad, m_state, v_state, coeffs, **_):
    return grad, m_state, v_state


def _no_expansion(grad, m_state, v_state, coeffs, *, mu_fmt, nu_fmt, expanded, math):
    m = decode(m_state[0], m_state[1], None, mu_fmt)
    v = adam.loaded_second_moment(decode(v_state[0], v_state[1], None, nu_fmt))
    m, v = adam.update_moments(grad, m, v, coeffs, g_m=adam.first_moment_gradient(grad))
    u = adam.direction(m, v, coeffs)
    (mq, ma, _), (vq, va, _) = encode(m, mu_fmt, False), encode(v, nu_fmt, False)
    return u, (mq, ma, m_state[2]), (vq, va, v_state[2])


VARIANTS = {
    "shipped": {},
    "io only": {(adam_step, "moment_update"): _io_only},
    "no expansion": {(adam_step, "moment_update"): _no_expansion},
    "IEEE direction": {(adam_step, "_approx_direction"): adam.direction},
}


@contextlib.contextmanager
def patched(replacements):
    """Module attributes replaced for the duration (the kernel traces them by attribute), and
    the kernel's jit cache cleared on both sides so that each variant is traced afresh."""
    saved = {key: getattr(*key) for key in replacements}
    for (module, name), fn in replacements.items():
        setattr(module, name, fn)
    adam_update._call.clear_cache()
    try:
        yield
    finally:
        for (module, name), fn in saved.items():
            setattr(module, name, fn)
        adam_update._call.clear_cache()


def adamw_step(rows: int, cols: int):
    """``(step, carry)`` of ``optax.adamw`` on one fp32 leaf, state fed forward and donated."""
    keys = jax.random.split(jax.random.key(1), 2)
    p = jax.random.normal(keys[0], (rows, cols)) * 0.02
    g = jax.random.normal(keys[1], (rows, cols)) * 1e-3
    opt = optax.adamw(1e-4, weight_decay=0.1)

    def step(carry):
        params, state = carry
        updates, state = opt.update(g, state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(step, donate_argnums=0), (p, opt.init(p))


def tiles_only_step(rows: int, cols: int, tuning, interpret: bool):
    """``(step, carry, bytes)`` of a kernel streaming ``p``, ``g`` and two FP8 code arrays in
    ``tuning``'s ``(block_rows, 128)`` tiles, in place, with no per-group operands."""
    n, group = rows * cols // 128, 128
    keys = jax.random.split(jax.random.key(2), 2)
    p = jax.random.normal(keys[0], (n, group)) * 0.02
    g = jax.random.normal(keys[1], (n, group)) * 1e-3
    codes = jnp.zeros((n, group), jnp.float8_e4m3fn)

    def kernel(p_ref, g_ref, m_ref, v_ref, p_out, m_out, v_out):
        p_out[...] = p_ref[...] - 1e-4 * g_ref[...]
        m_out[...], v_out[...] = m_ref[...], v_ref[...]

    tile = pl.BlockSpec((tuning.block_rows, group), lambda i: (i, 0))
    call = pl.pallas_call(
        kernel, grid=(n // tuning.block_rows,), in_specs=[tile] * 4, out_specs=[tile] * 3,
        out_shape=[jax.ShapeDtypeStruct((n, group), x.dtype) for x in (p, codes, codes)],
        input_output_aliases={0: 0, 2: 1, 3: 2},
        compiler_params=adam_step.compiler_params(tuning), interpret=interpret,
    )  # fmt: skip
    step = jax.jit(lambda c: call(c[0], g, c[1], c[2]), donate_argnums=0)
    return step, (p, codes, jnp.copy(codes)), 12 * n * group + 4 * n * group


def parse_tunings(text: str) -> list[adam_step.AdamStepTuning]:
    """``"16x4,32x8"`` -> tunings of those block rows x warps (other knobs default)."""
    tunings = []
    for item in text.split(","):
        rows, warps = item.lower().split("x")
        tunings.append(adam_step.AdamStepTuning(block_rows=int(rows), num_warps=int(warps)))
    return tunings


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=11008)
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--inner", type=int, default=10)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--tunings", default="8x4",
                        help="block rows x warps, for shipped and io only")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {sorted(VARIANTS)}")
    interpret = not dispatch.hopper_gpu()
    if interpret and args.rows * args.cols > 2**20:
        print(f"adam_ablation.py: the kernels run interpreted on {jax.default_backend()}: "
              f"{args.rows}x{args.cols} takes minutes (--rows 16 --cols 256: a quick look)",
              flush=True)  # fmt: skip
    _, make, nbytes = kernel_cases(args.rows, args.cols, interpret)[CASE]
    median_ms = lambda step, carry: measure.time_loop(step, carry, iters=args.iters,
                                                      inner=args.inner)[0].median_ms  # fmt: skip
    n = args.rows * args.cols
    copy_gbps = 8 * n / median_ms(jax.jit(lambda x: x * 2), jnp.ones((args.rows, args.cols))) / 1e6
    rows = []
    for variant in args.variants.split(","):
        tuned = variant in ("shipped", "io only")
        for tuning in parse_tunings(args.tunings) if tuned else [adam_step.AdamStepTuning()]:
            row = {"variant": variant, "block_rows": tuning.block_rows,
                   "num_warps": tuning.num_warps}  # fmt: skip
            with patched(VARIANTS[variant]):
                try:
                    ms = median_ms(*make(tuning))
                    row.update(ms=ms, GBps=nbytes / ms / 1e6)
                except Exception as e:  # a tuning that does not compile
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            print(f"  {row}", flush=True)
    if "shipped" in args.variants.split(",") and len(args.variants.split(",")) > 1:
        for tuning in parse_tunings(args.tunings):
            step, carry, tile_bytes = tiles_only_step(args.rows, args.cols, tuning, interpret)
            ms = median_ms(step, carry)
            rows.append({"variant": "tiles only (no per-group arrays)",
                         "block_rows": tuning.block_rows, "num_warps": tuning.num_warps,
                         "ms": ms, "GBps": tile_bytes / ms / 1e6})  # fmt: skip
            print(f"  {rows[-1]}", flush=True)
        ms = median_ms(*adamw_step(args.rows, args.cols))
        rows.append({"variant": "optax.adamw (XLA, fp32 m, v)", "block_rows": None,
                     "num_warps": None, "ms": ms, "GBps": 28 * n / ms / 1e6})  # fmt: skip
    device = f"{jax.devices()[0].device_kind}, jax {jax.__version__}"
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": datetime.date.today().isoformat(), "device": device,
                       "interpret": interpret, "shape": [args.rows, args.cols], "bytes": nbytes,
                       "copy_GBps": copy_gbps, "rows": rows}, f, indent=2)  # fmt: skip
    mode = "interpret mode: times are not kernel speed" if interpret else "compiled"
    print(f"\n{args.rows}x{args.cols} fp32 leaf, {device} ({mode}); copy {copy_gbps:.0f} GB/s")
    print("| variant | tile rows x warps | ms | GB/s | of copy |\n|---|---|---|---|---|")
    for r in rows:
        tile = f"{r['block_rows']}x{r['num_warps']}" if r["block_rows"] else "-"
        if "ms" not in r:
            print(f"| {r['variant']} | {tile} | failed | - | - |")
            continue
        print(f"| {r['variant']} | {tile} | {r['ms']:.3f} | {r['GBps']:.0f} | "
              f"{r['GBps'] / copy_gbps:.0%} |")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
