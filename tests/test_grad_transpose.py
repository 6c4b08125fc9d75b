"""Fp8Recipe.grad_transpose: the output gradients' FP8 operands in both layouts from one pass.

The backward of a per-tensor FP8 projection ``y = x W`` reads the quantized output gradient
twice: row-major for ``dx = dy W^T`` and K-major (``dy^T``, contracted over the tokens) for
``dW = x^T dy``. With the kernel (``pallas_kernels.quantize.quantize_transpose_per_tensor``,
interpreted here) one pass writes both; without it XLA writes the transposed copy. The codes are
the same (the kernel traces ``coat_jax.core.quant``'s encode; tests/test_pallas_quantize.py), so
every input gradient equals the XLA path's bit for bit, and each weight gradient sums the same
fp32 products, maybe in another order.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coat_jax.core.recipe import Fp8Recipe
from coat_jax.ops import flow
from pallas_kernels import dispatch
from pallas_kernels import quantize as kq

KERNEL = Fp8Recipe(grad_transpose="interpret")
XLA = Fp8Recipe(grad_transpose="reference")
TOKENS, HIDDEN, WIDTH = (2, 32), 128, 256

# (recipe, x, norm scale, up, w_gate, w_up, w_down) -> outputs; x is the gate for SwiGLU
OPS = {
    "project": lambda r, x, s, u, wg, wu, wd: flow.fp8_project(x, (wg, wu), r),
    "norm_project": lambda r, x, s, u, wg, wu, wd: flow.fp8_norm_project(x, s, (wg, wu), 1e-5, r),
    "swiglu_project": lambda r, x, s, u, wg, wu, wd: (
        flow.fp8_swiglu_project(x, u, wd[:HIDDEN], r),
    ),  # fmt: skip
    "mlp": lambda r, x, s, u, wg, wu, wd: (flow.fp8_mlp(x, s, wg, wu, wd, 1e-5, r),),
    "mlp_fused": lambda r, x, s, u, wg, wu, wd: (flow.fp8_mlp(x, s, wg, wu, wd, 1e-5, FUSED(r)),),
}
FUSED = lambda r: dataclasses.replace(r, fused_mlp="interpret", fused_backward="interpret")
WEIGHTS = (3, 4, 5)  # argument positions of the weights


def _inputs(seed):
    k = jax.random.split(jax.random.key(seed), 7)
    x, u = (jax.random.normal(kk, (*TOKENS, HIDDEN), jnp.bfloat16) for kk in k[:2])
    s = (1 + 0.1 * jax.random.normal(k[2], (HIDDEN,))).astype(jnp.bfloat16)
    wg, wu = (jax.random.normal(kk, (HIDDEN, WIDTH)) * 0.05 for kk in k[3:5])
    wd = jax.random.normal(k[5], (WIDTH, HIDDEN)) * 0.05
    return (x, s, u, wg, wu, wd), jax.random.normal(k[6], (*TOKENS, WIDTH))


def _grads(op, recipe, args, cot):
    def loss(*a):
        outs = OPS[op](recipe, *a)
        return sum(jnp.sum(o.astype(jnp.float32) * cot[..., : o.shape[-1]]) for o in outs)

    return jax.jit(jax.grad(loss, argnums=tuple(range(6))))(*args)


MODES = ["interpret"] + ([pytest.param("pallas", marks=pytest.mark.gpu)] if dispatch.hopper_gpu()
                         else [])  # fmt: skip


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", sorted(OPS))
def test_gradients_equal_the_xla_operands(op, mode):
    """Fresh inputs each run. Interpreted on the CPU: input and norm-weight gradients bit for
    bit; weight gradients: two fp32 sums of the same ``K`` (= 64 tokens) products differ by at
    most ``2 K u sum_k |x_k||dy_k|`` (``u = 2^-24``); for these Gaussian inputs ``sum_k
    |x_k||dy_k|`` is within ``sqrt(K)`` of ``|sum_k x_k dy_k|`` in norm, so a relative error of
    ``2 K^1.5 u`` (3e-5) bounds it, where an operand wired wrongly is off by O(1). Compiled on
    a Hopper GPU the two programs' GEMMs and fusions may differ (FP8 tensor cores accumulate
    with ~14 bits, README): 2^-7 relative, BF16's rounding."""
    seed = int(np.random.default_rng().integers(2**31))
    args, cot = _inputs(seed)
    got = _grads(op, Fp8Recipe(grad_transpose=mode), args, cot)
    want = _grads(op, XLA, args, cot)
    k = np.prod(TOKENS)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert g.shape == w.shape
        rel = np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30)
        if mode == "pallas":
            assert rel <= 2.0**-7, (seed, op, i, rel)
        elif i in WEIGHTS:
            assert rel <= 2 * k**1.5 * 2.0**-24, (seed, op, i, rel)
        else:
            np.testing.assert_array_equal(g, w, err_msg=f"seed {seed}, {op}, argument {i}")


def test_each_output_gradient_is_quantized_once_into_both_layouts(monkeypatch):
    """One kernel call per output gradient on its ``(M, N)`` matrix; the weight-gradient GEMM
    reads the kernel's ``(N, M)`` codes contracted over their last axis (no copy for XLA to
    make); the XLA path calls no kernel and contracts ``dy`` over its tokens (axis 0)."""
    calls, gemms = [], []
    kernel, gemm = kq.quantize_transpose_per_tensor, flow.fp8_gemm
    monkeypatch.setattr(
        kq,
        "quantize_transpose_per_tensor",
        lambda x, *a, **kw: calls.append(x.shape) or kernel(x, *a, **kw),
    )
    monkeypatch.setattr(
        flow,
        "fp8_gemm",
        lambda a, b, contract, *r, **kw: (
            gemms.append((a.data.shape, b.data.shape, contract, b.data.dtype))
            or gemm(a, b, contract, *r, **kw)
        ),
    )
    args, cot = _inputs(0)
    m = np.prod(TOKENS)
    e5m2 = jnp.dtype(jnp.float8_e5m2)
    _grads("project", KERNEL, args, cot)
    assert calls == [(m, WIDTH)] * 2
    wgrads = [g for g in gemms if g[3] == e5m2 and g[2][0] == 0]
    assert wgrads == [((m, HIDDEN), (WIDTH, m), (0, 1), e5m2)] * 2, gemms
    calls.clear(), gemms.clear()
    _grads("project", XLA, args, cot)
    assert calls == []
    wgrads = [g for g in gemms if g[3] == e5m2 and g[2][0] == 0]
    assert wgrads == [((m, HIDDEN), (m, WIDTH), (0, 0), e5m2)] * 2, gemms


def test_modes_and_bad_values():
    assert flow._grad_transpose_mode(KERNEL) == "interpret"
    assert flow._grad_transpose_mode(XLA) is None
    assert flow._grad_transpose_mode(Fp8Recipe(grad_transpose="interpret", scaling="row")) is None
    assert "grad_transpose" in flow.fused_kernels(KERNEL)
    with pytest.raises(ValueError, match="Fp8Recipe.grad_transpose='yes'"):
        Fp8Recipe(grad_transpose="yes")
    if not dispatch.hopper_gpu():
        assert flow._grad_transpose_mode(Fp8Recipe()) is None  # "auto": not measured faster
        with pytest.raises(ValueError, match="needs a Hopper GPU"):
            flow._grad_transpose_mode(Fp8Recipe(grad_transpose="pallas"))


TRAIN_SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["XLA_FLAGS"] = "--xla_allow_excess_precision=false"
    import jax, numpy as np
    from coat_jax.training import configs
    from coat_jax.training.run import assemble

    def losses(grad_transpose):
        config = configs.load_file("configs/llama_tiny.py", {
            "precision": "coat", "fp8.grad_transpose": grad_transpose,
            "optimizer.kernels": "reference"})
        configs.validate(config)
        r = assemble(config, devices=jax.devices()[:1])
        with jax.set_mesh(r.placement.mesh):
            params, opt_state = r.create()
            out = []
            for i in range(4):
                tokens = jax.random.randint(jax.random.key(100 + i), r.batch_shape(), 0, 256)
                params, opt_state, m = r.train_step(params, opt_state, tokens)
                out.append(float(m["loss"]))
        return out

    kernel, xla = losses("interpret"), losses("reference")
    assert kernel == xla, (kernel, xla)
    print("OK", kernel)
    """
)


def test_training_steps_equal_the_xla_path_bit_for_bit():
    """COAT's tiny Llama, four train steps, with the kernel (interpreted) and with XLA's
    fusions: the same losses to the last bit, once XLA keeps BF16 values BF16
    (``--xla_allow_excess_precision=false``). By default XLA may quantize an output gradient
    from the fp32 value its producer computed, skipping the BF16 rounding the kernel reads, and
    the runs drift apart at the E5M2 rounding (llama_tiny, 40 steps: 0.1% at step 5)."""
    out = subprocess.run([sys.executable, "-c", TRAIN_SCRIPT], capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr[-3000:]
