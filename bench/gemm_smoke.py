"""Smallest first run of the Pallas FP8 GEMMs on a GPU: each variant once, one small shape,
default config, printed error or traceback (so a lowering failure shows at once).

  python bench/gemm_smoke.py
"""

import argparse
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from coat_jax.core.quant import dequantize
from pallas_kernels import dispatch
from pallas_kernels import fp8_matmul as fm


def rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / np.linalg.norm(want)


def cases(m=256, k=256, n=256):
    """``{name: () -> (got, want)}`` for each variant on ``(m, k, n)``."""
    key_a, key_b = jax.random.split(jax.random.key(0))
    a = jax.random.normal(key_a, (m, k)).astype(jnp.float8_e4m3fn)
    b = jax.random.normal(key_b, (n, k)).astype(jnp.float8_e4m3fn)
    b5 = jax.random.normal(key_b, (n, k)).astype(jnp.float8_e5m2)
    sa_shape, sb_shape = fm.block_scales_shape(m, n, k)
    sa, sb = jnp.full(sa_shape, 0.5), jnp.full(sb_shape, 2.0)
    cfg, f32 = fm.DEFAULT_CONFIG, jnp.float32
    ref = lambda x, y, s1, s2: fm.fp8_matmul_reference(x, y, s1, s2, out_dtype=f32)
    return {
        "per-tensor e4m3 x e4m3 -> f32": lambda: (
            fm.fp8_matmul(a, b, 0.5, 2.0, out_dtype=f32, config=cfg), ref(a, b, 0.5, 2.0)),
        "per-tensor e4m3 x e4m3 -> bf16": lambda: (
            fm.fp8_matmul(a, b, 0.5, 2.0, config=cfg).astype(f32), ref(a, b, 0.5, 2.0)),
        "per-tensor e5m2 x e4m3 (mixed) -> f32": lambda: (
            fm.fp8_matmul(b5, a, 0.5, 2.0, out_dtype=f32, config=cfg), ref(b5, a, 0.5, 2.0)),
        "per-tensor ragged 129x256x200": lambda: (
            fm.fp8_matmul(a[:129], b[:200], 1.0, 1.0, out_dtype=f32, config=cfg),
            ref(a[:129], b[:200], 1.0, 1.0)),
        "block-scaled": lambda: (
            fm.fp8_matmul_block_scaled(a, sa, b, sb, out_dtype=f32, config=cfg),
            fm.fp8_matmul_block_scaled_reference(a, sa, b, sb, out_dtype=f32)),
        "fused 1x16 epilogue": lambda: (
            dequantize(fm.fp8_matmul_quantize_1x16(a, b, 0.5, 2.0, config=cfg)),
            ref(a, b, 0.5, 2.0)),
    }  # fmt: skip


def main():
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    if not dispatch.hopper_gpu():
        raise SystemExit(f"gemm_smoke.py: the Pallas FP8 GEMMs compile for a Hopper GPU only, "
                         f"not {jax.default_backend()}")  # fmt: skip
    print("jax", jax.__version__, jax.devices(), flush=True)
    for name, run in cases().items():
        try:
            got, want = run()
            err = rel(got, want)
            finite = bool(np.isfinite(np.asarray(got)).all())
            verdict = "OK" if finite and err < 0.05 else "WRONG"
            print(f"SMOKE {name}: rel. Frobenius error {err:.2e}, all finite {finite} -> {verdict}",
                  flush=True)  # fmt: skip
        except Exception:
            print(f"SMOKE {name}: FAILED", flush=True)
            traceback.print_exc()


if __name__ == "__main__":
    main()
