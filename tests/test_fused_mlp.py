"""coat_jax.ops.flow.fp8_mlp: COAT's MLP with SwiGLU's saved groups written by the gate / up GEMMs.

On the CPU the fused op runs with the GEMM's jnp reference (``Fp8Recipe(fused_mlp="interpret")``);
on a Hopper GPU (marker ``gpu``) with the Mosaic GPU kernel.
"""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from blocks import MESH_MLP, coat_block_saved_bytes, run_on_8_devices

from coat_jax.core.recipe import Fp8Recipe
from coat_jax.ops import flow
from pallas_kernels import dispatch, fp8_matmul

UNFUSED, INTERPRET = Fp8Recipe(fused_mlp="reference"), Fp8Recipe(fused_mlp="interpret")

# Stated bounds (relative Frobenius error, outputs and every gradient). The fused op quantizes
# the fp32 GEMM products to E4M3 where the unfused one quantizes their BF16 copies: a group's
# code moves by one E4M3 step where BF16's rounding crosses an E4M3 rounding boundary, and
# SwiGLU's output may then get another per-tensor scale, which moves the rounding of every
# code of the down projection's operand. The two are two draws of the same FP8 noise, so:
# each within the MLP's FP8 error of fp32 math (E4M3 saved groups, operands and weights on
# three GEMMs, E5M2 output gradients: measured 0.07-0.08 forward, 0.09-0.12 backward), the
# fused one no further from fp32 than the unfused one by more than a tenth (plus 0.01), and
# the two apart by less than that error (measured 0.015-0.09).
FWD_TOL, BWD_TOL = 0.12, 0.16
AS_CLOSE_TO_FP32 = (1.1, 0.01)
FUSED_VS_UNFUSED = 0.12


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "non-finite values"
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def fresh_key():
    return jax.random.key(np.random.default_rng().integers(1 << 30))


def mlp_inputs(key, lead=(2, 24), h=64, f=176, kind="rms"):
    kx, ks, kg, ku, kd, kc = jax.random.split(key, 6)
    x = (jax.random.normal(kx, (*lead, h)) * 2).astype(jnp.bfloat16)
    scale = None if kind == "layer" else (1 + 0.1 * jax.random.normal(ks, (h,)))
    w = lambda k, a, b: jax.random.normal(k, (a, b)) / np.sqrt(a)
    cot = jax.random.normal(kc, (*lead, h)).astype(jnp.bfloat16)
    return (x, scale, w(kg, h, f), w(ku, h, f), w(kd, f, h)), cot


def outputs_and_grads(recipe, args, cot, kind="rms"):
    """``[output, every gradient]`` of ``fp8_mlp`` (the norm's when it has a weight)."""

    def loss(*args):
        out = flow.fp8_mlp(*args, 1e-5, recipe, kind)
        return jnp.sum(out.astype(jnp.float32) * cot.astype(jnp.float32)), out

    grad = jax.value_and_grad(loss, argnums=tuple(range(len(args))), has_aux=True)
    (_, out), grads = jax.jit(grad)(*args)
    return [out, *jax.tree.leaves(grads)]


def fp32_mlp(x, scale, wg, wu, wd, kind="rms"):
    x = x.astype(jnp.float32)
    if kind == "rms":
        y = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5) * scale
    else:
        c = x - x.mean(-1, keepdims=True)
        y = c * jax.lax.rsqrt(jnp.mean(c * c, -1, keepdims=True) + 1e-5)
    return fp32_swiglu(y, wg, wu, wd)


def fp32_swiglu(y, wg, wu, wd):
    hp = jax.lax.Precision.HIGHEST
    g, u = jnp.dot(y, wg, precision=hp), jnp.dot(y, wu, precision=hp)
    return jnp.dot(jax.nn.silu(g) * u, wd, precision=hp)


def norm_weight_noise_scale(x, scale, wg, wu, wd, cot):
    """Per feature j, sqrt(sum_t (xhat_tj gy_tj)^2) in fp32 math: the norm weight's gradient is
    the token sum sum_t xhat_tj gy_tj, so FP8 errors in gy (independent per token) reach it in
    quadrature, whatever that sum's own cancellation. Its relative error against |sum| is a
    ratio of two 64-element norms with few degrees of freedom: 0.17 in 11 of 30,000 seeds."""
    x = x.astype(jnp.float32)
    xhat = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5)
    _, vjp = jax.vjp(lambda y: fp32_swiglu(y, wg, wu, wd), xhat * scale)
    (gy,) = vjp(cot.astype(jnp.float32))  # d loss / d (normed input)
    terms = (xhat * gy).reshape(-1, x.shape[-1])  # xhat_tj gy_tj: d scale_j = sum_t
    return np.sqrt(np.sum(np.asarray(terms, np.float64) ** 2, 0))


def check_fused_against_unfused(fused: Fp8Recipe, kind: str, lead=(2, 24), h=64, f=176):
    args, cot = mlp_inputs(fresh_key(), lead, h, f, kind)
    got = outputs_and_grads(fused, args, cot, kind)
    want = outputs_and_grads(UNFUSED, args, cot, kind)
    args32 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), args)
    ref, vjp = jax.vjp(lambda *a: fp32_mlp(*a, kind=kind), *args32)
    refs = [ref, *jax.tree.leaves(vjp(cot.astype(jnp.float32)))]
    factor, slack = AS_CLOSE_TO_FP32
    tols = [FWD_TOL] + [BWD_TOL] * (len(refs) - 1)
    norm_weight = 2 if kind == "rms" else None  # [out, dx, d scale, ...]
    for i, (g, w, r, tol) in enumerate(zip(got, want, refs, tols, strict=True)):
        assert g.dtype == w.dtype and g.shape == w.shape == r.shape
        assert rel_err(g, w) < FUSED_VS_UNFUSED, rel_err(g, w)
        if i == norm_weight:
            # 64 token sums: error against the noise scale of their terms; fused vs unfused
            # is bounded by the check above (|rel(g, r) - rel(w, r)| <= rel(g, w)), a 10%
            # comparison of two 64-element noise norms is not (1.33x in 2 of 30,000 seeds)
            noise = np.linalg.norm(norm_weight_noise_scale(*args, cot))
            err = np.linalg.norm(np.asarray(g, np.float64) - np.asarray(r, np.float64))
            assert err / noise < tol, err / noise
            continue
        assert rel_err(g, r) < tol, rel_err(g, r)
        assert rel_err(g, r) <= factor * rel_err(w, r) + slack, (rel_err(g, r), rel_err(w, r))


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_fused_mlp_matches_the_unfused_ops_and_fp32(kind):
    check_fused_against_unfused(INTERPRET, kind)


def test_the_fused_mlp_writes_the_groups_from_the_gemm(monkeypatch):
    """Fused, gate and up each come from one quantizing GEMM, and SwiGLU saves exactly what it
    returned: the saved groups are the GEMM's output (no BF16 copy quantized afresh)."""
    calls, outputs = [], []
    reference = fp8_matmul.fp8_matmul_quantize_1x16_reference

    def counted(*args, **kwargs):
        q = reference(*args, **kwargs)
        calls.append(args[0].shape + args[1].shape)
        outputs.append(q)
        return q

    monkeypatch.setattr(fp8_matmul, "fp8_matmul_quantize_1x16_reference", counted)
    (x, scale, wg, wu, wd), _ = mlp_inputs(fresh_key())
    _, vjp = jax.vjp(lambda x: flow.fp8_mlp(x, scale, wg, wu, wd, 1e-5, INTERPRET), x)
    assert calls == [(48, 64, 176, 64)] * 2  # (M, K) activations, (N, K) weight
    saved = [r for r in jax.tree.leaves(vjp) if r.dtype == jnp.float8_e4m3fn
             and r.shape == (2, 24, 11, 16)]  # fmt: skip
    gate_codes = np.asarray(outputs[0].data, np.float32).reshape(2, 24, 11, 16)
    assert any(np.array_equal(np.asarray(r, np.float32), gate_codes) for r in saved)


def test_the_fused_block_saves_the_same_bytes():
    assert coat_block_saved_bytes(INTERPRET, ffn=176) == coat_block_saved_bytes(UNFUSED, ffn=176)


def test_the_fused_mlp_runs_only_where_its_kernel_applies():
    assert flow._fused_mlp_mode(INTERPRET) == "interpret"
    assert flow._fused_mlp_mode(UNFUSED) is None
    for other in (dict(scaling="row"), dict(forward_gemm="bf16"), dict(saved_group=32),
                  dict(saved_format="e5m2")):  # fmt: skip
        assert flow._fused_mlp_mode(Fp8Recipe(fused_mlp="interpret", **other)) is None
    if not dispatch.hopper_gpu():
        assert flow._fused_mlp_mode(Fp8Recipe()) is None  # "auto" off a Hopper GPU
        with pytest.raises(ValueError, match="needs a Hopper GPU"):
            flow._fused_mlp_mode(Fp8Recipe(fused_mlp="pallas"))
    with pytest.raises(ValueError, match="Fp8Recipe.fused_mlp='triton'"):
        Fp8Recipe(fused_mlp="triton")


SHARDED_SCRIPT = MESH_MLP + textwrap.dedent(
    """
    from pallas_kernels import fp8_matmul
    calls = []
    kernel = fp8_matmul.fp8_matmul_quantize_1x16_reference
    fp8_matmul.fp8_matmul_quantize_1x16_reference = (
        lambda a, b, *r, **kw: calls.append((a.shape, b.shape)) or kernel(a, b, *r, **kw))

    fused = Fp8Recipe(fused_mlp="interpret")
    got = run(fused, True)
    # each device: its 32 tokens times the whole K of its tensor half of N (gate, then up)
    assert calls == [((32, 128), (128, 128))] * 2, calls
    assert_close(got, run(fused, False))
    for backward in ("interpret", "reference"):  # the kernel's gradient maxima, pmax'd, or XLA's
        assert_close(got, run(Fp8Recipe(fused_mlp="interpret", fused_backward=backward), True))
    print("OK")
    """
)


def test_the_fused_mlp_runs_on_each_shard():
    """Under a 2x2x2 mesh of 8 virtual devices (FSDP- and tensor-sharded weights) the fused
    MLP's GEMMs (their jnp reference standing in for the Mosaic GPU kernel) run on each
    device's tokens and ``tensor`` half of the MLP; loss and gradients within 2^-8 (relative
    Frobenius: sums over tokens in another order) of one device's, with and without the fused
    backward (whose gradient maxima the fused MLP then reads, ``pmax``'d over the shards)."""
    run_on_8_devices(SHARDED_SCRIPT)


@pytest.mark.parametrize(
    ("shapes", "match"),
    [
        (((2, 64), (64, 176), (64, 160), (176, 64)), "w_gate .* and w_up .* differ"),
        (((2, 64), (64, 176), (64, 176), (160, 64)), "w_down .* does not take"),
        (((2, 64), (64, 168), (64, 168), (168, 64)), "w_gate last axis 168 is not a multiple"),
        (((2, 48), (64, 176), (64, 176), (176, 64)), "last axis 48"),
    ],
)
def test_bad_shapes_raise(shapes, match):
    x, wg, wu, wd = (jnp.ones(s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        flow.fp8_mlp(x.astype(jnp.bfloat16), jnp.ones(x.shape[-1]), wg, wu, wd)


@pytest.mark.gpu
@pytest.mark.skipif(not dispatch.hopper_gpu(), reason="needs an NVIDIA Hopper GPU")
def test_gpu_fused_mlp_kernel_matches_the_unfused_ops():
    """The compiled kernel (tiles of 8192 x 4096 x 11008's kind: several M and N tiles, a
    ragged last N tile) against the unfused ops, to the same bound."""
    check_fused_against_unfused(Fp8Recipe(fused_mlp="pallas"), "rms", (2, 512), 512, 1376)


def test_fused_kernels_names_the_options_that_run_a_kernel(monkeypatch):
    """What train.py reports: the fused-flow options whose kernels run here; ``auto`` runs the
    MLP, backward and gradient quantize-transpose kernels on one Hopper GPU and not under a
    multi-device mesh."""
    both = Fp8Recipe(fused_mlp="interpret", fused_backward="interpret")
    assert flow.fused_kernels(both) == ("fused_mlp", "fused_backward")
    assert flow.fused_kernels(Fp8Recipe(fused_quantize="interpret", scaling="row")) == ()
    monkeypatch.setattr(dispatch, "hopper_gpu", lambda: True)
    assert flow.fused_kernels(Fp8Recipe()) == ("fused_mlp", "fused_backward", "grad_transpose")
    monkeypatch.setattr(dispatch, "multi_device_mesh", lambda: object())
    assert flow.fused_kernels(Fp8Recipe()) == ()
    assert flow.fused_kernels(Fp8Recipe(fused_mlp="pallas")) == ("fused_mlp",)
