"""pallas_kernels.fused_backward: SwiGLU's backward from its FP8-saved inputs in one pass.

The kernel runs in Pallas interpret mode here (on a Hopper GPU compiled, marker ``gpu``)."""

import secrets
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from blocks import MESH_MLP, coat_block_saved_bytes, run_on_8_devices

from coat_jax.core.formats import get_format
from coat_jax.core.quant import dequantize, quantize
from coat_jax.core.recipe import Fp8Recipe
from coat_jax.ops import flow
from coat_jax.ops.plain import norm_fp32, swiglu_fp32
from pallas_kernels import dispatch
from pallas_kernels import fused_backward as fb

E4M3 = get_format("e4m3")
REFERENCE = Fp8Recipe(fused_backward="reference")
INTERPRET = Fp8Recipe(fused_backward="interpret")
OPS = {  # name: (fn of the dequantized inputs and extras, inputs, has a weight, whole rows)
    "swiglu": (lambda g, u: swiglu_fp32(g, u).astype(jnp.bfloat16), 2, False, False),
    "rms": (lambda x, s: norm_fp32(x, s, 1e-5, "rms").astype(jnp.bfloat16), 1, True, True),
    "layer": (lambda x: norm_fp32(x, None, 1e-5, "layer").astype(jnp.bfloat16), 1, False, True),
}
SMALL_TILES = fb.FusedBackwardTuning(block_rows=8, block_cols=32)


def fresh_key():
    return jax.random.key(secrets.randbits(31))


def f32(x):
    return np.asarray(x, np.float32)


def saved_inputs(op, key, shape, expand=False):
    """The op's saved 1x16 groups of fresh inputs, its weight (or none), the output gradient
    and the forward's ``amax`` of its output."""
    fn, n_inputs, weighted, _ = OPS[op]
    keys = jax.random.split(key, 4)
    xs = tuple((jax.random.normal(k, shape) * 3).astype(jnp.bfloat16) for k in keys[:n_inputs])
    extras = (1 + 0.1 * jax.random.normal(keys[2], shape[-1:]),)[: int(weighted)]
    saved = tuple(quantize(x, E4M3, group_size=16, expand=expand) for x in xs)
    dy = jax.random.normal(keys[3], shape).astype(jnp.bfloat16)
    amax = jnp.max(jnp.abs(fn(*xs, *(e.reshape(1, -1) for e in extras)).astype(jnp.float32)))
    return saved, extras, dy, amax


def run_both(op, saved, extras, dy, amax, tuning=SMALL_TILES):
    fn, _, _, whole_rows = OPS[op]
    kwargs = dict(operand_fmt=E4M3, operand_amax=amax)
    got = jax.jit(lambda s, e, d: fb.operand_and_grads(
        s, d, fn, e, whole_rows=whole_rows, tuning=tuning, interpret=True, **kwargs)
    )(saved, extras, dy)  # fmt: skip
    want = jax.jit(lambda s, e, d: fb.operand_and_grads_reference(s, d, fn, e, **kwargs))(
        saved, extras, dy)
    return got, want


def close_bf16(a, b, tiny):
    """Each element within one BF16 rounding (2^-7 relative) of ``b``'s, or ``tiny``."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    with np.errstate(invalid="ignore"):  # inf - inf where both are the same inf
        return np.all(same | (np.abs(a - b) <= 2.0**-7 * np.abs(b) + tiny))


def assert_same(got, want, exact=True):
    """Operand codes and scale, gradients and their maxima: bit for bit (``exact``; an
    element-wise op), or (a norm: its mean over a row reduced in another order over a tile
    than over the whole array, so a BF16 rounding may move) each gradient within one BF16
    rounding or 2^-16 of its largest, and at most 1e-3 of the codes one E4M3 step (2^-3)
    apart. A weight's gradient (fp32 sums over the rows, by tiles in the kernel): within 1e-5
    of the reference's."""
    (gq, g_grads, g_max, g_extra), (wq, w_grads, w_max, w_extra) = got, want
    np.testing.assert_array_equal(gq.amax, wq.amax)
    if exact:
        np.testing.assert_array_equal(f32(gq.data), f32(wq.data))
    else:
        y, y_want = f32(gq.data), f32(wq.data)  # E4M3 values: a step is 2^-3 of one, or 2^-9
        assert np.mean(y != y_want) <= 1e-3
        assert np.all(np.abs(y - y_want) <= 2.0**-3 * np.abs(y_want) + 2.0**-9)
    for a, b in zip((*g_grads, *g_max), (*w_grads, *w_max), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        if exact:
            np.testing.assert_array_equal(f32(a), f32(b))
        else:
            # where the norm's two terms cancel, fp32 rounding of the terms (2^-16 of the
            # largest gradient) outweighs a BF16 rounding of the result
            finite = np.abs(f32(b))[np.isfinite(f32(b))]
            assert close_bf16(a, b, 2.0**-16 * finite.max()), np.nanmax(np.abs(f32(a) - f32(b)))
    for a, b in zip(g_extra, w_extra, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        finite = np.abs(f32(b))[np.isfinite(f32(b))]
        np.testing.assert_allclose(f32(a), f32(b), rtol=1e-5, atol=1e-5 * finite.max())


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("shape", [(64, 256), (48, 1024), (8, 352)])  # 352: tiles of 32 columns
def test_kernel_equals_the_reference(op, shape):
    """Under jit (as in a step) both trace the same decode, op, vjp and encode."""
    if OPS[op][3] and shape[1] & (shape[1] - 1):
        pytest.skip("a whole-row tile needs a power-of-two row (else: the fallback test)")
    assert_same(*run_both(op, *saved_inputs(op, fresh_key(), shape)), exact=not OPS[op][3])


@pytest.mark.parametrize("op", ["swiglu", "rms"])
def test_the_gradients_maxima_are_of_tiles_and_skip_non_finite(op):
    """A NaN and an Inf in the output gradient stay out of the maxima (as the reference's);
    a large one in one tile sets them."""
    saved, extras, dy, amax = saved_inputs(op, fresh_key(), (32, 64))
    dy = dy.at[3, 5].set(jnp.nan).at[7, 9].set(jnp.inf).at[30, 60].set(500.0)
    got, want = run_both(op, saved, extras, dy, amax)
    assert all(np.isfinite(float(m)) for m in got[2])
    assert float(max(got[2])) > 1
    assert_same(got, want, exact=not OPS[op][3])


@pytest.mark.parametrize("op,cols,expand", [("swiglu", 40, False), ("swiglu", 64, True),
                                            ("rms", 80, False)])  # fmt: skip
def test_untileable_or_expanded_inputs_fall_back_to_the_reference(op, cols, expand):
    """A last axis of 40 (not whole groups of 16), range-expanded groups and a norm's row of
    80 (no power-of-two whole-row tile) run the reference, without error."""
    assert_same(*run_both(op, *saved_inputs(op, fresh_key(), (16, cols), expand)))  # the same ops


FLOW_OPS = {
    "norm_project": lambda r, x, s, u, ws: flow.fp8_norm_project(x, s, ws[:2], 1e-5, r)[1],
    "layer_norm_project": lambda r, x, s, u, ws: flow.fp8_norm_project(
        x, None, ws[:2], 1e-5, r, "layer")[0],
    "swiglu_project": lambda r, x, s, u, ws: flow.fp8_swiglu_project(x, u, ws[2], r),
    "mlp": lambda r, x, s, u, ws: flow.fp8_mlp(x, s, *ws, 1e-5, r),
    "mlp_fused_forward": lambda r, x, s, u, ws: flow.fp8_mlp(
        x, s, *ws, 1e-5, Fp8Recipe(fused_quantize="interpret", fused_backward=r.fused_backward)),
    "fused_mlp": lambda r, x, s, u, ws: flow.fp8_mlp(  # reads the kernel's gradient maxima
        x, s, *ws, 1e-5, Fp8Recipe(fused_mlp="interpret", fused_backward=r.fused_backward)),
}


@pytest.mark.parametrize("op", sorted(FLOW_OPS))
def test_flow_ops_with_the_kernel_equal_the_xla_ops(op):
    """``Fp8Recipe(fused_backward="interpret")``: outputs and all gradients of SwiGLU-project
    bit for bit those of the XLA ops (same saved residuals, same operands and maxima); of the
    ops with a norm (its row means reduced in another order: :func:`assert_same`) each
    gradient within 2^-8 (relative Frobenius) of the XLA ops'."""
    kx, ku, ks, k1, k2, k3, kc = jax.random.split(fresh_key(), 7)
    x, u = (jax.random.normal(k, (2, 16, 64)).astype(jnp.bfloat16) for k in (kx, ku))
    scale = 1 + 0.1 * jax.random.normal(ks, (64,))
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
        if op == "swiglu_project":
            np.testing.assert_array_equal(f32(g), f32(w))
        else:
            g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
            assert np.linalg.norm(g - w) <= 2.0**-8 * np.linalg.norm(w), g.shape


def test_the_fused_backward_saves_no_more_bytes():
    """A COAT block saves the same activation bytes with the kernel as without."""
    assert coat_block_saved_bytes(INTERPRET) == coat_block_saved_bytes(REFERENCE)


def test_the_kernel_stays_out_of_other_recipes_and_pallas_needs_a_gpu():
    assert flow._fused_backward_mode(INTERPRET) == "interpret"
    assert flow._fused_backward_mode(REFERENCE) is None
    assert flow._fused_backward_mode(Fp8Recipe(fused_backward="interpret", scaling="row")) is None
    with pytest.raises(ValueError, match="Fp8Recipe.fused_backward='triton'"):
        Fp8Recipe(fused_backward="triton")
    if not dispatch.hopper_gpu():
        assert flow._fused_backward_mode(Fp8Recipe()) is None  # "auto" off a Hopper GPU
        with pytest.raises(ValueError, match="Hopper"):
            flow._fused_backward_mode(Fp8Recipe(fused_backward="pallas"))


@pytest.mark.parametrize("op", sorted(OPS))
def test_kernel_lowers_to_one_triton_call_for_cuda(op, monkeypatch):
    """Without a GPU: the kernel lowers to Triton IR (every primitive it traces has a Triton
    lowering) at the 7B block's shapes (MLP 11008, hidden 4096), as one call."""
    monkeypatch.setattr(fb.dispatch, "check_compiled", lambda *a, **k: None)
    fn, n_inputs, weighted, whole_rows = OPS[op]
    shape = (4096, 4096) if whole_rows else (4096, 11008)
    saved = jax.eval_shape(lambda x: tuple(quantize(x, E4M3, group_size=16)
                                           for _ in range(n_inputs)),
                           jax.ShapeDtypeStruct(shape, jnp.bfloat16))  # fmt: skip
    extras = (jax.ShapeDtypeStruct(shape[-1:], jnp.float32),)[: int(weighted)]
    dy = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    kernel = lambda s, e, d: fb.operand_and_grads(s, d, fn, e, whole_rows=whole_rows,
                                                  operand_fmt=E4M3, operand_amax=1.0)  # fmt: skip
    text = jax.jit(kernel).trace(saved, extras, dy).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1, text.count("__gpu$xla.gpu.triton")


SHARDED_SCRIPT = MESH_MLP + textwrap.dedent(
    """
    from coat_jax.core.quant import quantize
    from coat_jax.ops.plain import norm_fp32
    from pallas_kernels import fused_backward as fb
    calls = []
    kernel = fb.operand_and_grads
    fb.operand_and_grads = lambda *a, **kw: calls.append(a[1].shape) or kernel(*a, **kw)

    got = run(Fp8Recipe(fused_backward="interpret"), True)
    # each device's rows, and the SwiGLU's MLP columns: the SwiGLU's, then the norm's backward
    assert calls == [(32, 128), (32, 128)], calls
    xla_ops = run(Fp8Recipe(fused_backward="reference"), True)
    np.testing.assert_array_equal(got[0], xla_ops[0])  # the loss: the same forward
    assert_close(got, xla_ops)
    assert_close(got, run(Fp8Recipe(fused_backward="interpret"), False))

    # The fused MLP reads the gradients' maxima: on a mesh they are the pmax of the shards',
    # and the norm weight's gradient the psum over the row shards
    saved = (quantize(jax.random.normal(k[0], (8, 16, 256)).astype(jnp.bfloat16), "e4m3",
                      group_size=16),)
    fn = lambda a, s: norm_fp32(a, s, 1e-5, "rms").astype(jnp.bfloat16)
    dy = cot.repeat(2, -1).at[7, 15, 3].set(40.0)  # the largest gradient on the last shard
    recipe, weight, amax = Fp8Recipe(fused_backward="interpret"), scale.repeat(2), 4.0
    kernel_on = lambda saved, dy, weight: flow._operand_and_grads(
        saved, dy, fn, (weight,), amax, recipe, "interpret", whole_rows=True)
    with jax.set_mesh(mesh):
        _, _, (m,), (ds,) = jax.jit(kernel_on)(saved, dy, weight)
    _, (dx1,), (m1,), (ds1,) = kernel_on(saved, dy, weight)
    assert float(m) == float(m1) == float(jnp.max(jnp.abs(dx1.astype(jnp.float32))))
    ds, ds1 = np.asarray(ds, np.float64), np.asarray(ds1, np.float64)
    assert np.all(np.abs(ds - ds1) <= 2.0**-7 * np.abs(ds1) + 1e-3 * np.abs(ds1).max())
    print("OK")
    """
)


def test_the_kernel_runs_on_each_shard_with_the_tensors_maxima():
    """``fp8.fused_backward`` under a 2x2x2 mesh of 8 virtual devices: the kernel
    (interpreted) runs on each device's rows and MLP columns, with the ``pmax`` of the shards'
    gradient maxima as their E5M2 scales, the norm weight's gradient the ``psum`` of the
    shards'. The MLP's loss equals the XLA ops' on the same mesh; every gradient is within
    2^-8 (relative Frobenius) of theirs and of the kernel's on one device (sums over the
    tokens in another order, the norm's means over tiles: ``assert_same``); a lost ``pmax``
    or ``psum`` moves them by FP8 noise or a factor."""
    run_on_8_devices(SHARDED_SCRIPT)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["swiglu", "rms", "layer"])
def test_compiled_kernel_matches_the_reference_on_a_gpu(op):
    """Compiled for the GPU (Triton) at the 7B block's shapes (rows of 4096 tokens; MLP 11008,
    hidden 4096).

    The kernel rounds the decoded inputs to BF16, as the op's math states; XLA keeps the
    reference's in fp32 (``xla_allow_excess_precision``), and SwiGLU's ``exp``, the norm's
    ``rsqrt`` and their vjps are approximated differently by Triton and XLA. Measured on an
    H200 (2026-12-06): 1.5-2.4% of the output's codes one E4M3 step apart (at most 6e-5 more),
    gradients apart by at most 0.43% of their largest (where SwiGLU's derivative crosses zero,
    a BF16 rounding of the input moves it by that), maxima by 0.12%, the norm weight's
    gradient by 0.04% of its largest. Bounds: codes moved <= 5%, beyond one step <= 1e-4; each
    gradient within 2^-7 of itself plus 2^-7 of the largest; maxima within 2^-7; the weight's
    gradient within 1e-3 of its largest."""
    fn, _, _, whole_rows = OPS[op]
    saved, extras, dy, amax = saved_inputs(op, fresh_key(), (4096, 4096 if whole_rows else 11008))
    kwargs = dict(operand_fmt=E4M3, operand_amax=amax)
    got = jax.jit(lambda s, e, d: fb.operand_and_grads(s, d, fn, e, whole_rows=whole_rows,
                                                       **kwargs))(saved, extras, dy)  # fmt: skip
    want = jax.jit(lambda s, e, d: fb.operand_and_grads_reference(s, d, fn, e, **kwargs))(
        saved, extras, dy)
    (gq, g_grads, g_max, g_extra), (wq, w_grads, w_max, w_extra) = got, want
    y_got, y_want = (np.asarray(dequantize(q, jnp.float32), np.float64) for q in (gq, wq))
    step = np.abs(y_want) * 2.0**-3 + float(amax) / E4M3.max * 2.0**-9
    moved, beyond = np.mean(y_got != y_want), np.mean(np.abs(y_got - y_want) > step)
    assert moved <= 0.05 and beyond <= 1e-4, (moved, beyond)
    for a, b, ma, mb in zip(g_grads, w_grads, g_max, w_max, strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        excess = np.abs(a - b) - 2.0**-7 * (np.abs(b) + float(mb))
        assert excess.max() <= 0, excess.max()
        assert abs(float(ma) - float(mb)) <= 2.0**-7 * float(mb)
    for a, b in zip(g_extra, w_extra, strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.abs(a - b).max() <= 1e-3 * np.abs(b).max()
