"""One Llama block, forward + backward, per precision policy: time, saved activations, peak memory.

The paper's own micro-benchmark (COAT, arXiv 2410.19313: Llama-2-7B block, hidden 4096, seq 2048,
batch 4 on an H100: BF16 26.55 ms, TransformerEngine 17.98 ms, COAT 16.85 ms; activations
2914 -> 1766 MB). Each policy runs in its own subprocess so that ``peak_bytes_in_use`` is its own.

  python bench/layer.py [--json out.json] [--seq 2048 ...]

Reported per policy: median ms of a jitted fwd+bwd (grads of params and input;
``coat_jax.core.measure``), bytes of the activation residuals saved for backward (leaves shaped
(batch, seq, ...)), the FP8 GEMM custom-calls in the compiled HLO, and the device's peak memory
(beside the allocator's settings).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import functools
import json
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
from flax import nnx

from coat_jax.core import measure
from coat_jax.core.recipe import Fp8Recipe
from coat_jax.models import nn
from coat_jax.models.policy import POLICIES, get_policy

F8_GEMM = "__cublas$lt$matmul$f8"


VARIANTS = {
    "coat+fused": ("coat", Fp8Recipe(fused_quantize="pallas")),
    "fp8_linear+pallas_gemm": ("fp8_linear", Fp8Recipe(gemm="pallas")),
    "coat+pallas_gemm": ("coat", Fp8Recipe(gemm="pallas")),
    "coat+auto_gemm": ("coat", Fp8Recipe(gemm="auto")),
    "fp8_linear+bf16_product": ("fp8_linear", Fp8Recipe(gemm_product="bf16")),
    "coat+bf16_product": ("coat", Fp8Recipe(gemm_product="bf16")),
    "fp8_linear+pow2_bf16_product": ("fp8_linear", Fp8Recipe(pow2_scales=True,
                                                             gemm_product="bf16")),  # fmt: skip
    "coat+pow2_bf16_product": ("coat", Fp8Recipe(pow2_scales=True, gemm_product="bf16")),
    "coat+unfused": ("coat", Fp8Recipe(fused_mlp="reference", fused_backward="reference")),
    "coat+fused_mlp": ("coat", Fp8Recipe(fused_mlp="pallas", fused_backward="reference")),
    "coat+fused_mlp+auto": ("coat", Fp8Recipe(fused_mlp="pallas", gemm="auto")),
    "coat+fused_backward": ("coat", Fp8Recipe(fused_backward="pallas", fused_mlp="reference")),
    "coat+fused_mlp+fused_backward": ("coat", Fp8Recipe(fused_mlp="pallas",
                                                        fused_backward="pallas")),  # fmt: skip
    "coat+all_fused+fused_backward": ("coat", Fp8Recipe(fused_quantize="pallas", fused_mlp="pallas",
                                                        fused_backward="pallas")),  # fmt: skip
    "fp8_linear+grad_transpose": ("fp8_linear", Fp8Recipe(grad_transpose="pallas")),
    "coat+grad_transpose": ("coat", Fp8Recipe(grad_transpose="pallas")),
    "fp8_linear+xla_grad_transpose": ("fp8_linear", Fp8Recipe(grad_transpose="reference")),
    "coat+xla_grad_transpose": ("coat", Fp8Recipe(grad_transpose="reference")),
}
"""Rows beyond the policies: COAT with the norm / SwiGLU forwards' fused quantize kernels
(``--fused``); every per-tensor FP8 GEMM on the Pallas wgmma kernel, or only the shapes
``pallas_kernels.dispatch.GEMM_PALLAS_FASTER`` lists (``--gemm``); XLA's FP8 GEMMs writing a
BF16 product (``--product``: ``Fp8Recipe.gemm_product``; with ``pow2_scales``, whose
power-of-two scales make that product round once, as the fp32 one does); COAT's MLP with
SwiGLU's saved groups written by the gate / up GEMMs (``--mlp``: ``Fp8Recipe.fused_mlp``, with
XLA's GEMMs elsewhere and with ``gemm='auto'``); SwiGLU's and the norms' backwards as one pass
each over their FP8-saved inputs (``--backward``: ``Fp8Recipe.fused_backward``, alone, with the
fused MLP, and with it and the fused quantize kernels); each output gradient's E5M2 codes in
both layouts from one Pallas pass, and from XLA's fusions (``--transpose``:
``Fp8Recipe.grad_transpose``, ``auto`` on one Hopper GPU since 2026-12-07). Since 2026-12-06
``auto`` runs the fused MLP and backward on one Hopper GPU, so the ``coat`` row and the rows
that name neither run them; ``coat+unfused`` is COAT without them."""


def run_policy(args) -> dict:
    """Measures one policy (or a :data:`VARIANTS` row) in this process."""
    name, recipe = VARIANTS.get(args.policy, (args.policy, None))
    policy = get_policy(name, recipe)
    block = nn.Block(
        args.hidden,
        args.heads,
        args.kv_heads,
        args.ffn,
        policy=policy,
        rngs=nnx.Rngs(0),
    )
    graph, params = nnx.split(block)
    key = jax.random.key(1)
    x = jax.random.normal(key, (args.batch, args.seq, args.hidden), jnp.bfloat16)
    cot = jax.random.normal(jax.random.key(2), x.shape, jnp.bfloat16)
    positions = jnp.broadcast_to(jnp.arange(args.seq), x.shape[:2])

    def forward(x, params):
        return nnx.merge(graph, params)(x, positions)

    @functools.partial(jax.jit, compiler_options=policy.compiler_options())  # as train.py's
    def fwd_bwd(x, params):
        out, vjp = jax.vjp(forward, x, params)
        return vjp(cot)

    compiled = fwd_bwd.lower(x, params).compile()
    hlo = compiled.as_text()
    residual_fn = jax.jit(lambda x, p: jax.vjp(forward, x, p)[1])
    leaves = {id(r): r for r in jax.tree.leaves(residual_fn(x, params))}.values()
    act = [r for r in leaves if r.ndim >= 2 and r.shape[:2] == (args.batch, args.seq)]
    act_bytes = sum(r.nbytes for r in act)
    del leaves, act

    timing = measure.time_calls(fwd_bwd, x, params, iters=args.steps)
    u = args.batch * args.seq * args.hidden * 2
    return {
        "policy": args.policy,
        "median_ms": timing.median_ms,
        "min_ms": timing.min_ms,
        "activation_bytes": int(act_bytes),
        "activation_U": act_bytes / u,
        "f8_gemm_calls": hlo.count(f'custom_call_target="{F8_GEMM}"'),
        "custom_calls": dict(collections.Counter(re.findall(r'custom_call_target="([^"]+)"', hlo))),
        "peak_bytes_in_use": measure.device_memory(jax.devices()[:1]).peak,
        "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=32)
    parser.add_argument("--ffn", type=int, default=11008)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--policy", choices=sorted([*POLICIES, *VARIANTS]),
                        help="measure one policy only")  # fmt: skip
    parser.add_argument("--fused", action="store_true",
                        help="add a row: COAT with Fp8Recipe(fused_quantize='pallas')")
    parser.add_argument("--gemm", action="store_true",
                        help="add rows: fp8_linear and COAT with Fp8Recipe(gemm='pallas'), COAT "
                        "with gemm='auto'")
    parser.add_argument("--product", action="store_true",
                        help="add rows: fp8_linear and COAT with Fp8Recipe(gemm_product='bf16')")
    parser.add_argument("--mlp", action="store_true",
                        help="add rows: COAT with Fp8Recipe(fused_mlp='pallas'), alone and with "
                        "gemm='auto'")
    parser.add_argument("--backward", action="store_true",
                        help="add rows: COAT with Fp8Recipe(fused_backward='pallas'), alone, "
                        "with fused_mlp='pallas', and with it and fused_quantize='pallas'")
    parser.add_argument("--transpose", action="store_true",
                        help="add rows: fp8_linear and COAT with Fp8Recipe(grad_transpose="
                        "'pallas') and with 'reference'")
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args()
    if args.policy:
        print(json.dumps(run_policy(args)))
        return

    rows = []
    extra = [v for v in VARIANTS if (args.fused and v.endswith("fused"))
             or (args.gemm and v.endswith("gemm"))
             or (args.product and v.endswith("product"))
             or (args.mlp and "fused_mlp" in v and "backward" not in v)
             or (args.backward and v.endswith("fused_backward"))
             or (args.transpose and v.endswith("grad_transpose"))]  # fmt: skip
    if extra:  # COAT without the kernels auto runs, beside the rows that vary them
        extra.insert(0, "coat+unfused")
    for policy in ("bf16", "fp8_linear", "coat", *extra):
        cmd = [sys.executable, __file__, "--policy", policy]
        for name in ("hidden", "heads", "kv_heads", "ffn", "seq", "batch", "steps"):
            cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"{policy} failed:\n{out.stderr[-3000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))

    base, allocator = rows[0], measure.allocator_settings()
    fmt_gb = lambda b: "-" if b is None else f"{b / 1e9:.2f}"
    device = f"{jax.devices()[0].device_kind}, jax {jax.__version__}"
    print(
        f"\nLlama block hidden {args.hidden}, heads {args.heads}/{args.kv_heads}, ffn {args.ffn}, "
        f"seq {args.seq}, batch {args.batch} on {device}"
    )
    print("| policy | fwd+bwd ms | speedup | saved act. MB (U) | vs bf16 | peak GB | f8 GEMMs |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['policy']} | {r['median_ms']:.2f} | {base['median_ms'] / r['median_ms']:.2f}x | "
            f"{r['activation_bytes'] / 2**20:.0f} ({r['activation_U']:.2f}U) | "
            f"{r['activation_bytes'] / base['activation_bytes']:.3f} | "
            f"{fmt_gb(r['peak_bytes_in_use'])} | {r['f8_gemm_calls']} |"
        )
    print("allocator:", ", ".join(f"{k}={v}" for k, v in allocator.items()))
    if args.json:
        result = {
            "date": datetime.date.today().isoformat(),
            "device": jax.devices()[0].device_kind,
            "jax": jax.__version__,
            "allocator": allocator,
            "config": {k: v for k, v in vars(args).items() if k not in ("json", "policy")},
            "rows": rows,
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
