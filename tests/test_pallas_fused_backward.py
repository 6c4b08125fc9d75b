"""pallas_kernels.fused_backward: SwiGLU's backward from its FP8-saved inputs in one pass.

The kernel runs in Pallas interpret mode here (on a Hopper GPU compiled, marker ``gpu``)."""

import secrets
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from blocks import coat_block_saved_bytes

from coat_jax.core.formats import get_format
from coat_jax.core.quant import dequantize, quantize
from coat_jax.core.recipe import Fp8Recipe
from coat_jax.ops import flow
from coat_jax.ops.plain import swiglu_fp32
from pallas_kernels import fused_backward as fb

E4M3 = get_format("e4m3")
REFERENCE = Fp8Recipe(fused_backward="reference")
INTERPRET = Fp8Recipe(fused_backward="interpret")
swiglu = lambda g, u: swiglu_fp32(g, u).astype(jnp.bfloat16)


def fresh_key():
    return jax.random.key(secrets.randbits(31))


def f32(x):
    return np.asarray(x, np.float32)


def saved_inputs(key, shape, dy_scale=1.0):
    """SwiGLU's saved 1x16 groups of fresh ``gate`` / ``up``, the output gradient ``dh`` and
    the forward's ``amax`` of ``h``."""
    kg, ku, kd = jax.random.split(key, 3)
    g, u = ((jax.random.normal(k, shape) * 3).astype(jnp.bfloat16) for k in (kg, ku))
    saved = tuple(quantize(x, E4M3, group_size=16) for x in (g, u))
    dy = (jax.random.normal(kd, shape) * dy_scale).astype(jnp.bfloat16)
    return saved, dy, jnp.max(jnp.abs(swiglu(g, u).astype(jnp.float32)))


SMALL_TILES = fb.FusedBackwardTuning(block_rows=8, block_cols=32)


def run_both(saved, dy, amax, tuning=SMALL_TILES):
    kwargs = dict(operand_fmt=E4M3, operand_amax=amax)
    got = jax.jit(lambda s, d: fb.operand_and_grads(s, d, swiglu, tuning=tuning, interpret=True,
                                                    **kwargs))(saved, dy)  # fmt: skip
    want = jax.jit(lambda s, d: fb.operand_and_grads_reference(s, d, swiglu, **kwargs))(saved, dy)
    return got, want


def assert_same(got, want):
    """Operand codes and scale, gradients and their maxima: bit for bit."""
    (gq, g_grads, g_max), (wq, w_grads, w_max) = got, want
    np.testing.assert_array_equal(f32(gq.data), f32(wq.data))
    np.testing.assert_array_equal(gq.amax, wq.amax)
    for a, b in zip((*g_grads, *g_max), (*w_grads, *w_max), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(f32(a), f32(b))


@pytest.mark.parametrize("shape", [(64, 256), (48, 1024), (8, 352)])  # 352: tiles of 32 columns
def test_kernel_equals_the_reference_bit_for_bit(shape):
    """Under jit (as in a step) both trace the same decode, SwiGLU, vjp and encode."""
    assert_same(*run_both(*saved_inputs(fresh_key(), shape)))


def test_the_gradients_maxima_are_of_tiles_and_skip_non_finite():
    """A NaN and an Inf in ``dh`` stay out of the maxima (as the reference's); a large ``dh``
    in one tile sets them."""
    saved, dy, amax = saved_inputs(fresh_key(), (32, 64))
    dy = dy.at[3, 5].set(jnp.nan).at[7, 9].set(jnp.inf).at[30, 60].set(500.0)
    got, want = run_both(saved, dy, amax)
    assert all(np.isfinite(float(m)) for m in got[2])
    assert float(max(got[2])) > 100
    assert_same(got, want)


@pytest.mark.parametrize("cols,expand", [(40, False), (64, True)])
def test_untileable_or_expanded_inputs_fall_back_to_the_reference(cols, expand):
    """A last axis of 40 (not whole groups of 16) and range-expanded groups run the
    reference, without error."""
    kg, ku, kd = jax.random.split(fresh_key(), 3)
    g, u, dy = (jax.random.normal(k, (16, cols)).astype(jnp.bfloat16) for k in (kg, ku, kd))
    saved = tuple(quantize(x, E4M3, group_size=16, expand=expand) for x in (g, u))
    assert_same(*run_both(saved, dy, jnp.float32(4.0)))


FLOW_OPS = {
    "swiglu_project": lambda r, x, s, u, ws: flow.fp8_swiglu_project(x, u, ws[2], r),
    "mlp": lambda r, x, s, u, ws: flow.fp8_mlp(x, s, *ws, 1e-5, r),
    "mlp_fused_forward": lambda r, x, s, u, ws: flow.fp8_mlp(
        x, s, *ws, 1e-5, Fp8Recipe(fused_quantize="interpret", fused_backward=r.fused_backward)),
}


@pytest.mark.parametrize("op", sorted(FLOW_OPS))
def test_flow_ops_with_the_kernel_equal_the_xla_ops(op):
    """``Fp8Recipe(fused_backward="interpret")``: outputs and all gradients of the COAT ops
    bit for bit those of the XLA ops (same saved residuals, same operands and maxima)."""
    kx, ku, ks, k1, k2, k3, kc = jax.random.split(fresh_key(), 7)
    x, u = (jax.random.normal(k, (2, 16, 64)).astype(jnp.bfloat16) for k in (kx, ku))
    scale = (1 + 0.1 * jax.random.normal(ks, (64,))).astype(jnp.bfloat16)
    ws = (jax.random.normal(k1, (64, 64)) * 0.1, jax.random.normal(k2, (64, 64)) * 0.1,
          jax.random.normal(k3, (64, 64)) * 0.1)  # fmt: skip
    cot = jax.random.normal(kc, (2, 16, 64)).astype(jnp.bfloat16)

    def run(recipe):
        def loss(x, scale, u, ws):
            return jnp.sum(FLOW_OPS[op](recipe, x, scale, u, ws).astype(jnp.float32) * cot)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(x, scale, u, ws)

    calls = []
    kernel = fb.operand_and_grads
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fb, "operand_and_grads", lambda *a, **k: calls.append(1) or kernel(*a, **k))
        got, got_grads = run(INTERPRET)
    assert calls, "the kernel did not run"
    want, want_grads = run(REFERENCE)
    np.testing.assert_array_equal(got, want)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_array_equal(f32(g), f32(w))


def test_the_fused_backward_saves_no_more_bytes():
    """A COAT block saves the same activation bytes with the kernel as without."""
    assert coat_block_saved_bytes(INTERPRET) == coat_block_saved_bytes(REFERENCE)


def test_the_kernel_stays_out_of_other_recipes_and_pallas_needs_a_gpu():
    assert flow._fused_backward_mode(INTERPRET) == "interpret"
    assert flow._fused_backward_mode(REFERENCE) is None
    assert flow._fused_backward_mode(Fp8Recipe(fused_backward="interpret", scaling="row")) is None
    assert flow._fused_backward_mode(Fp8Recipe()) is None  # auto: not measured faster yet
    with pytest.raises(ValueError, match="Fp8Recipe.fused_backward='triton'"):
        Fp8Recipe(fused_backward="triton")
    with pytest.raises(ValueError, match="Hopper"):
        flow._fused_backward_mode(Fp8Recipe(fused_backward="pallas"))


def test_kernel_lowers_to_one_triton_call_for_cuda(monkeypatch):
    """Without a GPU: the kernel lowers to Triton IR (every primitive it traces has a Triton
    lowering) at the 7B MLP's shape, as one call."""
    monkeypatch.setattr(fb.dispatch, "check_compiled", lambda *a, **k: None)
    shape = (4096, 11008)
    saved = jax.eval_shape(lambda x: tuple(quantize(x, E4M3, group_size=16) for x in (x, x)),
                           jax.ShapeDtypeStruct(shape, jnp.bfloat16))  # fmt: skip
    dy = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    fn = lambda s, d: fb.operand_and_grads(s, d, swiglu, operand_fmt=E4M3, operand_amax=1.0)
    text = jax.jit(fn).trace(saved, dy).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1, text.count("__gpu$xla.gpu.triton")


SHARDED_SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp, numpy as np
    from coat_jax.core.recipe import Fp8Recipe
    from coat_jax.ops import flow, sharding
    from pallas_kernels import fused_backward as fb

    P = jax.sharding.PartitionSpec
    mesh = sharding.make_mesh(2, 2, 2)
    k = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(k[0], (8, 16, 128)).astype(jnp.bfloat16)
    scale = (1 + 0.1 * jax.random.normal(k[1], (128,))).astype(jnp.bfloat16)
    wg, wu = (jax.random.normal(kk, (128, 256)) * 0.1 for kk in k[2:4])
    wd = jax.random.normal(k[4], (256, 128)) * 0.06
    cot = jax.random.normal(k[5], (8, 16, 128)).astype(jnp.bfloat16)
    calls = []
    kernel = fb.operand_and_grads
    fb.operand_and_grads = lambda *a, **kw: calls.append(a[1].shape) or kernel(*a, **kw)

    def run(recipe, on_mesh):
        loss = lambda *a: jnp.sum(flow.fp8_mlp(*a, 1e-5, recipe).astype(
            jnp.float32) * cot)
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
        if not on_mesh:
            return step(x, scale, wg, wu, wd)
        specs = (P(("data", "fsdp")), P(), P(None, "tensor"), P(None, "tensor"), P("tensor"))
        with jax.set_mesh(mesh):
            return step(*(jax.device_put(a, jax.sharding.NamedSharding(mesh, s))
                          for a, s in zip((x, scale, wg, wu, wd), specs)))

    got = jax.tree.leaves(run(Fp8Recipe(fused_backward="interpret"), True))
    assert calls == [(32, 128)], calls  # each device's rows and MLP columns only
    xla_ops = jax.tree.leaves(run(Fp8Recipe(fused_backward="reference"), True))
    one_device = jax.tree.leaves(run(Fp8Recipe(fused_backward="interpret"), False))
    for a, b, c in zip(got, xla_ops, one_device, strict=True):
        a, b, c = (np.asarray(v, np.float64) for v in (a, b, c))
        np.testing.assert_array_equal(a, b)
        if a.shape in ((), (128, 256), (256, 128)):
            # the loss and weight gradients: sums over tokens, in another order on one device
            assert np.linalg.norm(a - c) <= 1e-6 * np.linalg.norm(c), a.shape
        else:
            np.testing.assert_array_equal(a, c)
    print("OK")
    """
)


def test_the_kernel_runs_on_each_shard_with_the_tensors_maxima():
    """``fp8.fused_backward`` under a 2x2x2 mesh of 8 virtual devices: the kernel
    (interpreted) runs on each device's rows and MLP columns, with the ``pmax`` of the shards'
    gradient maxima as their E5M2 scales. The MLP's loss and gradients equal the XLA ops' on
    the same mesh bit for bit; on one device the activations' gradients too, and the sums over
    tokens (loss, weight gradients) within 1e-6 (fp32 sums in another order)."""
    out = subprocess.run([sys.executable, "-c", SHARDED_SCRIPT], capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr[-3000:]


@pytest.mark.gpu
def test_compiled_kernel_matches_the_reference_on_a_gpu():
    """Compiled for the GPU (Triton) at the 7B MLP's shape (rows of 4096 tokens, 11008).

    Decoding the saved groups is exact; SwiGLU's ``exp`` and its vjp are approximated by
    Triton and XLA alike, differently: each gradient element within one BF16 rounding
    (2^-7 relative) of the reference's plus 2^-10 of the gradient's maximum (where it cancels);
    the maxima within 2^-7; ``h``'s codes (same ``amax``) at most one E4M3 step apart on
    at most 1e-3 of the elements."""
    saved, dy, amax = saved_inputs(fresh_key(), (4096, 11008))
    kwargs = dict(operand_fmt=E4M3, operand_amax=amax)
    got = jax.jit(lambda s, d: fb.operand_and_grads(s, d, swiglu, **kwargs))(saved, dy)
    want = jax.jit(lambda s, d: fb.operand_and_grads_reference(s, d, swiglu, **kwargs))(saved, dy)
    (gq, g_grads, g_max), (wq, w_grads, w_max) = got, want
    h_got, h_want = (np.asarray(dequantize(q, jnp.float32), np.float64) for q in (gq, wq))
    moved = np.mean(h_got != h_want)
    step = np.abs(h_want) * 2.0**-3 + float(amax) / E4M3.max * 2.0**-9
    assert moved < 1e-3 and np.all(np.abs(h_got - h_want) <= step), moved
    for a, b, ma, mb in zip(g_grads, w_grads, g_max, w_max, strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        excess = np.abs(a - b) - 2.0**-7 * np.abs(b) - 2.0**-10 * float(mb)
        assert excess.max() <= 0, excess.max()
        assert abs(float(ma) - float(mb)) <= 2.0**-7 * float(mb)
