"""Train-step time per precision policy and FP8 recipe, one process, same shapes (no train.py).

  PYTHONPATH=. python3 bench/recipe_step.py 114m \\
      bench/results/recipe_step_114m_h200_$(date +%F).json fp32,fp32_x3,bf16,coat_bf16fwd_row_e4
  # sizes: tiny (CPU smoke test), 114m (configs/llama_114m.py's shape, batch 16 x 512),
  # 7b4 (four Llama-2-7B layers with its 32k vocabulary, batch 4 x 2048)

Each variant: a jitted step (loss, gradients, ``optax.adamw``; donated state) on random tokens,
2 warmup steps, median of 5 (``coat_jax.core.measure``, host time). A quick side-by-side of
recipes at equal batch; the end-to-end numbers (largest batch, memory) are ``bench/e2e.py``'s
and ``train.py``'s. ``fp32_tf32`` / ``fp32_x3`` / ``fp32_x6``: the fp32 policy with
``matmul_precision`` ``tensorfloat32`` / ``BF16_BF16_F32_X3`` / ``BF16_BF16_F32_X6``.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import jax
import optax
from flax import nnx

from coat_jax.core import measure
from coat_jax.core.recipe import Fp8Recipe
from coat_jax.models.llama import Llama, LlamaConfig, loss_fn

SIZES = {  # name -> (model, batch, seq_len)
    "tiny": (LlamaConfig(256, 128, 2, 4, ffn_dim=384), 2, 128),
    "114m": (LlamaConfig(256, 768, 16, 12, ffn_dim=2048), 16, 512),
    "7b4": (LlamaConfig(32000, 4096, 4, 32, ffn_dim=11008), 4, 2048),
}
E4 = dict(grad_format="e4m3")
VARIANTS = {  # name -> (precision, recipe, matmul_precision)
    "fp32": ("fp32", Fp8Recipe(), None),
    "fp32_tf32": ("fp32", Fp8Recipe(), "tensorfloat32"),
    "fp32_x3": ("fp32", Fp8Recipe(), "BF16_BF16_F32_X3"),
    "fp32_x6": ("fp32", Fp8Recipe(), "BF16_BF16_F32_X6"),
    "bf16": ("bf16", Fp8Recipe(), None),
    "lin": ("fp8_linear", Fp8Recipe(), None),
    "coat": ("coat", Fp8Recipe(), None),
    "coat_bf16fwd": ("coat", Fp8Recipe(forward_gemm="bf16"), None),
    "coat_bf16fwd_e4": ("coat", Fp8Recipe(forward_gemm="bf16", **E4), None),
    "coat_bf16fwd_row_e4": ("coat", Fp8Recipe(forward_gemm="bf16", scaling="row", **E4), None),
    "coat_bf16fwd_block_e4": ("coat", Fp8Recipe(forward_gemm="bf16", scaling="block", **E4),
                              None),  # fmt: skip
    "coat_row_e4": ("coat", Fp8Recipe(scaling="row", **E4), None),
    "coat_block_e4": ("coat", Fp8Recipe(scaling="block", **E4), None),
}


def step_ms(config: LlamaConfig, batch: int, seq_len: int) -> float:
    graph, params = nnx.split(Llama(config, rngs=nnx.Rngs(0)))
    opt = optax.adamw(1e-4)

    def step(carry):
        params, state, tokens = carry
        grads = jax.grad(lambda p: loss_fn(nnx.merge(graph, p), tokens))(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, tokens

    tokens = jax.random.randint(jax.random.key(0), (batch, seq_len + 1), 0, config.vocab_size)
    jitted = jax.jit(step, donate_argnums=0,
                     compiler_options=config.policy().compiler_options())  # fmt: skip
    timing, _ = measure.time_loop(jitted, (params, opt.init(params), tokens), warmup=2, iters=5)
    return timing.median_ms


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    usage = f"usage: recipe_step.py {{{','.join(SIZES)}}} OUT.json VARIANT,..."
    if argv in (["-h"], ["--help"]):
        print(f"{usage}\n\n{__doc__.strip()}\n\nvariants: {', '.join(VARIANTS)}")
        return None
    if len(argv) != 3 or argv[0] not in SIZES:
        raise SystemExit(usage)
    size, out, names = argv[0], argv[1], argv[2].split(",")
    if unknown := sorted(set(names) - set(VARIANTS)):
        raise SystemExit(f"recipe_step.py: unknown variants {unknown}; known {list(VARIANTS)}")
    model, batch, seq_len = SIZES[size]
    results = {}
    for name in names:
        precision, recipe, matmul = VARIANTS[name]
        config = dataclasses.replace(model, precision=precision, fp8=recipe,
                                     matmul_precision=matmul)  # fmt: skip
        try:
            ms = step_ms(config, batch, seq_len)
        except Exception as e:  # noqa: BLE001 (a variant the backend lacks)
            print(f"{name:24s} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        results[name] = dict(ms=ms, tokens_per_s=batch * seq_len / ms * 1e3)
        rate = results[name]["tokens_per_s"]
        print(f"{name:24s} {ms:9.2f} ms/step {rate:10.0f} tokens/s", flush=True)
    with open(out, "w") as fh:
        meta = dict(size=size, batch=batch, seq_len=seq_len, jax=jax.__version__,
                    device=jax.devices()[0].device_kind)  # fmt: skip
        json.dump(dict(meta, results=results), fh, indent=1)


if __name__ == "__main__":
    main()
