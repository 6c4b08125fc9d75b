"""FP8 GEMMs on a Hopper GPU: XLA bf16, XLA cuBLASLt FP8 and the Pallas wgmma kernels.

  python bench/gemm.py [--check] [--json out.json] [--iters 20]

Shapes (M, K, N): Llama-2-7B projections at 8192 tokens and 8192^3. Per variant the median GPU
time over --iters runs, from CUPTI kernel timings (jax.experimental.mosaic.gpu.profiler.measure:
every kernel the call launches, so padding, transposes and the scale multiply count), else host
time of --inner back-to-back launches (``coat_jax.core.measure.time_calls``). --check compares
each Pallas variant with its reference on small shapes first; a variant that fails (to lower, or
to match) is reported and skipped. Each Pallas variant's autotuned config is printed when chosen
and recorded per shape (``tuned_config``); --json is rewritten after every shape, so a run cut
short keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import re
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from coat_jax.core import measure
from coat_jax.core.quant import QuantizedArray, dequantize
from pallas_kernels import dispatch
from pallas_kernels import fp8_matmul as fm

SHAPES = [(8192, 4096, 4096), (8192, 4096, 11008), (8192, 11008, 4096), (8192, 8192, 8192)]
CHECK_SHAPES = [(512, 640, 384), (129, 256, 200)]


def timer(iters: int, inner: int):
    """``time(fn, *args) -> (median ms, "cupti" | "host")``:
    :func:`coat_jax.core.measure.kernel_time`."""
    return lambda fn, *args: measure.kernel_time(fn, *args, iters=iters, inner=inner)


def inputs(m, k, n, seed=0):
    ka, kb = jax.random.split(jax.random.key(seed))
    a = jax.random.normal(ka, (m, k), jnp.float32)
    b = jax.random.normal(kb, (n, k), jnp.float32)
    sa_shape, sb_shape = fm.block_scales_shape(m, n, k)
    return {
        "a_bf16": a.astype(jnp.bfloat16),
        "w_bf16": b.T.astype(jnp.bfloat16),  # (K, N), as the model stores it
        "a8": a.astype(jnp.float8_e4m3fn),
        "w8": b.T.astype(jnp.float8_e4m3fn),  # (K, N) for XLA
        "b8": b.astype(jnp.float8_e4m3fn),  # (N, K), K-major for wgmma
        "sa": jnp.full(sa_shape, 0.5, jnp.float32),
        "sb": jnp.full(sb_shape, 0.25, jnp.float32),
    }


def variants(block_configs: bool = False, extra_configs=()):
    """name -> (function of the inputs dict, reference or None). ``block_configs``: also one
    "Pallas block-scaled #i" column per autotune candidate of the block-scaled kernel (forced,
    so each is timed by CUPTI side by side; their configs in the JSON's ``block_configs``).
    ``extra_configs``: ``(variant, GemmConfig)`` pairs, one forced column "Pallas <variant>
    cfg<i>" each (configs that are not candidates, e.g. a sweep)."""

    @jax.jit
    def xla_bf16(x):
        return jnp.dot(x["a_bf16"], x["w_bf16"], preferred_element_type=jnp.bfloat16)

    @jax.jit
    def xla_fp8(x):  # what coat_jax.ops.flow.fp8_gemm does: cuBLASLt FP8 with the scale epilogue
        out = jax.lax.dot_general(x["a8"], x["w8"], (((1,), (0,)), ((), ())),
                                  preferred_element_type=jnp.float32)  # fmt: skip
        return (out * (jnp.float32(0.5) * jnp.float32(0.25))).astype(jnp.bfloat16)

    @jax.jit
    def xla_fp8_tn(x):  # the weight stored (N, K): the "TN" layout cuBLASLt FP8 takes on Hopper
        out = jax.lax.dot_general(x["a8"], x["b8"], (((1,), (1,)), ((), ())),
                                  preferred_element_type=jnp.float32)  # fmt: skip
        return (out * (jnp.float32(0.5) * jnp.float32(0.25))).astype(jnp.bfloat16)

    def pallas(variant, config=None):
        """The Pallas kernel of ``variant`` with ``config`` forced (``None``: autotuned)."""
        if variant == "block_scaled":
            return lambda x: fm.fp8_matmul_block_scaled(x["a8"], x["sa"], x["b8"], x["sb"],
                                                        config=config)  # fmt: skip
        return lambda x: fm.fp8_matmul(x["a8"], x["b8"], 0.5, 0.25, config=config)

    def quant(x):
        q = fm.fp8_matmul_quantize_1x16(x["a8"], x["b8"], 0.5, 0.25)
        return q.data, q.amax

    ref_pt = lambda x: fm.fp8_matmul_reference(x["a8"], x["b8"], 0.5, 0.25, out_dtype=jnp.float32)
    ref_bs = lambda x: fm.fp8_matmul_block_scaled_reference(
        x["a8"], x["sa"], x["b8"], x["sb"], out_dtype=jnp.float32
    )
    refs = {"per_tensor": ref_pt, "block_scaled": ref_bs}
    table = {
        "XLA bf16": (xla_bf16, None),
        "XLA cuBLASLt FP8": (xla_fp8, None),
        "XLA cuBLASLt FP8, (N, K) weight": (xla_fp8_tn, None),
        "Pallas per-tensor": (pallas("per_tensor"), ref_pt),
        "Pallas block-scaled": (pallas("block_scaled"), ref_bs),
        "Pallas fused 1x16": (quant, ref_pt),
    }
    if block_configs:
        for i, cfg in enumerate(fm.config_candidates("block_scaled")):
            table[f"Pallas block-scaled #{i}"] = (pallas("block_scaled", cfg), ref_bs)
    for i, (variant, cfg) in enumerate(extra_configs):
        table[f"Pallas {variant} cfg{i}"] = (pallas(variant, cfg), refs[variant])
    return table


def parse_configs(text: str) -> list[tuple[str, fm.GemmConfig]]:
    """``--configs``: a JSON list of objects, each ``"variant"`` (``block_scaled`` or
    ``per_tensor``) and :class:`GemmConfig` fields; each config is checked for its variant."""
    pairs = []
    for i, item in enumerate(json.loads(text)):
        item = dict(item)
        variant = item.pop("variant", "block_scaled")
        if variant not in ("block_scaled", "per_tensor"):
            raise ValueError(f"--configs item {i}: variant {variant!r} is not block_scaled or "
                             "per_tensor")  # fmt: skip
        cfg = fm.GemmConfig(**item)
        cfg.check(variant)
        pairs.append((variant, cfg))
    return pairs


CUBLASLT = ("XLA cuBLASLt FP8", "XLA cuBLASLt FP8, (N, K) weight")
RATIOS = {  # column -> (numerator, denominators: the first one timed)
    "Pallas/cuBLASLt": ("Pallas per-tensor", CUBLASLT),
    "block/cuBLASLt": ("Pallas block-scaled", CUBLASLT),
    "block/per-tensor": ("Pallas block-scaled", ("Pallas per-tensor",)),
    "1x16/per-tensor": ("Pallas fused 1x16", ("Pallas per-tensor",)),
}  # fmt: skip


def format_table(rows: list[dict], names: list[str]) -> str:
    """The markdown table of TFLOP/s, one row per shape, then the ratio columns whose two
    sides were timed (a ratio's cuBLASLt side: the (K, N) weight's column, else (N, K)'s)."""

    def tflops(row, name):
        v = row.get(name)
        return v["TFLOPs"] if isinstance(v, dict) and "TFLOPs" in v else None

    def ratio(row, num, dens):
        a = tflops(row, num)
        b = next((t for d in dens if (t := tflops(row, d)) is not None), None)
        return None if a is None or b is None else a / b

    ratios = {col: nd for col, nd in RATIOS.items()
              if any(ratio(r, *nd) is not None for r in rows)}  # fmt: skip
    lines = ["| M x K x N | " + " | ".join([*names, *ratios]) + " |",
             "|---" * (len(names) + len(ratios) + 1) + "|"]  # fmt: skip
    for r in rows:
        cells = [f"{t:.0f}" if (t := tflops(r, name)) is not None else "err" for name in names]
        cells += [f"{x:.2f}" if (x := ratio(r, *nd)) is not None else "" for nd in ratios.values()]
        lines.append(f"| {r['M']}x{r['K']}x{r['N']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


FP8_GEMM_CALL = "__cublas$lt$matmul$f8"


def xla_gemm_calls(fn, x) -> dict:
    """Which GEMM XLA compiled ``fn`` to: whether its HLO calls cuBLASLt's FP8 matmul (the
    FP8 tensor-core path) and the custom-call targets it uses."""
    hlo = fn.lower(x).compile().as_text()
    targets = sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo)))
    return {"fp8_gemm_call": FP8_GEMM_CALL in hlo, "custom_calls": targets}


def rel_err(got, want):
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    want = np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def check(name, fn, ref) -> str | None:
    """Error message, or None when the variant matches its reference on CHECK_SHAPES."""
    for m, k, n in CHECK_SHAPES:
        x = inputs(m, k, n, seed=1)
        try:
            out = fn(x)
            want = ref(x)
            if name == "Pallas fused 1x16":
                codes, amax = out
                got = dequantize(QuantizedArray(codes, amax, None, n))
                bound = 0.04
            else:
                got, bound = out, 1e-2  # block-scaled with uniform scales: per-tensor's bound
            err = rel_err(got, want)
            if not np.isfinite(np.asarray(jnp.asarray(got, jnp.float32))).all() or err > bound:
                return f"{(m, k, n)}: rel. Frobenius error {err:.2e} > {bound} (or non-finite)"
            print(f"  check {name} {(m, k, n)}: rel err {err:.2e} ok", flush=True)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            return f"{(m, k, n)}: {type(e).__name__}: {str(e)[:300]}"
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--inner", type=int, default=10)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--shapes", default="all", help="'all' or e.g. 8192x4096x4096 (MxKxN)")
    parser.add_argument("--only", default="", help="comma-separated substrings: time only the "
                        "variants whose name contains one (default: all)")  # fmt: skip
    parser.add_argument("--block_configs", action="store_true",
                        help="one column per block-scaled candidate config, forced")  # fmt: skip
    parser.add_argument("--configs", default="",
                        help="JSON list of {variant, GemmConfig fields}: one forced column "
                        "'Pallas <variant> cfg<i>' each")  # fmt: skip
    args = parser.parse_args()
    try:
        extra = parse_configs(args.configs) if args.configs else []
    except (ValueError, TypeError) as e:
        raise SystemExit(f"gemm.py: --configs: {e}") from None
    try:
        shapes = SHAPES if args.shapes == "all" else [
            tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]  # fmt: skip
        if any(len(s) != 3 or min(s) < 1 for s in shapes):
            raise ValueError
    except ValueError:
        raise SystemExit(f"gemm.py: --shapes {args.shapes!r}: expected 'all' or MxKxN,..."
                         ) from None  # fmt: skip
    if not dispatch.hopper_gpu():
        raise SystemExit(f"gemm.py: times cuBLASLt and the Pallas wgmma GEMMs on a Hopper GPU; "
                         f"this backend is {jax.default_backend()}")  # fmt: skip
    time_fn = timer(args.iters, args.inner)
    table = variants(args.block_configs, extra)
    if args.only:
        keep = [w.strip() for w in args.only.split(",") if w.strip()]
        table = {k: v for k, v in table.items() if any(w in k for w in keep)}
        if not table:
            raise SystemExit(f"gemm.py: --only {args.only!r} matches no variant")
    errors = {}
    if args.check:
        for name, (fn, ref) in table.items():
            if ref is not None and (msg := check(name, fn, ref)):
                print(f"  check {name} FAILED: {msg}", flush=True)
                errors[name] = f"check: {msg}"
    device = f"{jax.devices()[0].device_kind}, jax {jax.__version__}"
    rows = []

    def write_json(done: bool) -> None:
        """Everything measured so far (rewritten after each shape: a timeout keeps it)."""
        if not args.json:
            return
        tuned = {str(k): dataclasses.asdict(v) for k, v in fm._TUNED.items()}
        tune_log = {str(k): v for k, v in fm.AUTOTUNE_LOG.items()}
        with open(args.json, "w") as f:
            json.dump({"date": datetime.date.today().isoformat(), "device": device,
                       "iters": args.iters, "complete": done, "rows": rows,
                       "check_errors": errors, "tuned_configs": tuned,
                       "block_configs": [dataclasses.asdict(c) for c in
                                         fm.config_candidates("block_scaled")],
                       "extra_configs": [{"variant": v, **dataclasses.asdict(c)}
                                         for v, c in extra],
                       "autotune_log": tune_log}, f, indent=2)  # fmt: skip

    for m, k, n in shapes:
        x = inputs(m, k, n)
        row = {"M": m, "K": k, "N": n}
        for name, (fn, _) in table.items():
            if name in errors:
                row[name] = None
                continue
            tuned_before = set(fm._TUNED)
            try:
                jax.block_until_ready(fn(x))  # eager first call: autotunes this shape
                ms, how = time_fn(fn if name.startswith("XLA") else jax.jit(fn), x)
                row[name] = {"ms": ms, "TFLOPs": 2 * m * k * n / ms / 1e9, "timing": how}
                if name.startswith("XLA"):
                    row[name].update(xla_gemm_calls(fn, x))
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                row[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            # the autotune winner(s) this variant's first call chose (none for XLA)
            new = {str(key): dataclasses.asdict(fm._TUNED[key])
                   for key in fm._TUNED if key not in tuned_before}  # fmt: skip
            if new:
                row[name]["tuned_config"] = new if len(new) > 1 else next(iter(new.values()))
                for key, cfg in new.items():
                    print(f"  {(m, k, n)} {name}: tuned {key} -> {cfg}", flush=True)
            print(f"  {(m, k, n)} {name}: {row[name]}", flush=True)
        rows.append(row)
        write_json(done=False)

    print(f"\nTFLOP/s (median of {args.iters}), {device}")
    print(format_table(rows, list(table)))
    if args.json:
        write_json(done=True)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
