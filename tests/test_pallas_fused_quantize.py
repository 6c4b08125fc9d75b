"""pallas_kernels.fused_quantize: COAT's norm / SwiGLU forwards with quantization inside the op.
The kernels run in Pallas interpret mode here (on a Hopper GPU compiled, marker ``gpu``)."""

import secrets

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from blocks import coat_block_saved_bytes

from coat_jax.core.formats import get_format
from coat_jax.core.quant import dequantize
from coat_jax.core.recipe import Fp8Recipe
from coat_jax.ops import flow
from coat_jax.ops.plain import norm_fp32, swiglu_fp32
from pallas_kernels import fused_quantize as fq

E4M3 = get_format("e4m3")
FORMATS = dict(saved_fmt=E4M3, group=16, operand_fmt=E4M3)
EPS = 1e-5  # the norms' epsilon in op_cases and exact_output
REFERENCE, INTERPRET = Fp8Recipe(fused_quantize="reference"), Fp8Recipe(fused_quantize="interpret")


def fresh_key():
    return jax.random.key(secrets.randbits(31))


def codes(q):
    return np.asarray(q.data, np.float32)


def assert_same(got, want, y=None, tol=None):
    """Saved copies: codes and scales bit for bit. Operand: its scale bit for bit, and its codes
    too except, where the op's exact output ``y`` is given, at elements within ``tol`` of a
    point halfway between two BF16 numbers: the op's fp32 row sums, reduced over a tile in the
    kernel and over the whole array in the reference, round those either way; each such code
    is one E4M3 step from the reference's."""
    for g, w in zip(got[0], want[0], strict=True):
        np.testing.assert_array_equal(codes(g), codes(w))
        np.testing.assert_array_equal(g.amax, w.amax)
    np.testing.assert_array_equal(got[1].amax, want[1].amax)
    g, w = codes(got[1]), codes(want[1])
    if y is None:
        np.testing.assert_array_equal(g, w)
        return
    moved = g != w
    bits = lambda q: np.asarray(q.data).view(np.uint8).astype(np.int16)
    assert np.all(np.abs(bits(got[1]) - bits(want[1]))[moved] == 1), "codes more than a step apart"
    assert np.all(near_bf16_midpoint(y, tol)[moved]), f"{moved.sum()} codes moved, not at a tie"


def near_bf16_midpoint(y, tol):
    """Where ``y`` (float64) lies within ``tol`` (absolute, per element) of a BF16 midpoint:
    halfway from its nearest BF16 number to either neighbour (one code apart, so the gap
    below a power of two is half the gap above)."""
    bits = y.astype(jnp.bfloat16).view(np.uint16)
    value = lambda b: b.view(jnp.bfloat16).astype(np.float64)
    one = np.uint16(1)
    mids = np.stack([(value(bits) + value(b)) / 2 for b in (bits - one, bits + one)])
    return np.any(np.abs(y - mids) <= tol, axis=0)


def exact_output(op, inputs, extras):
    """The op of ``op_cases`` in float64 on the decoded saved inputs, and the tolerance of fp32
    row sums taken in any order: ``n 2^-24`` of each term summed (n: the row length), so
    relative for RMSNorm, plus the mean's rounding (``n 2^-24 max |x| / std``) for LayerNorm."""
    x = np.asarray(inputs[0], np.float64)
    n, u = x.shape[-1], 2.0**-24
    if op == "rms":
        y = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + EPS) * np.asarray(extras[0])
        return y, n * u * np.abs(y)
    centred = x - np.mean(x, -1, keepdims=True)
    rstd = 1 / np.sqrt(np.mean(centred * centred, -1, keepdims=True) + EPS)
    y = centred * rstd
    return y, n * u * (np.abs(y) + np.max(np.abs(x), -1, keepdims=True) * rstd)


def op_cases():
    rms = lambda xd, s: norm_fp32(xd, s, EPS, "rms").astype(jnp.bfloat16)
    layer = lambda xd: norm_fp32(xd, None, EPS, "layer").astype(jnp.bfloat16)
    swiglu = lambda g, u: swiglu_fp32(g, u).astype(jnp.bfloat16)
    return {"rms": (rms, 1, 1, True), "layer": (layer, 1, 0, True), "swiglu": (swiglu, 2, 0, False)}


@pytest.mark.parametrize("op", ["rms", "layer", "swiglu"])
@pytest.mark.parametrize("shape", [(64, 256), (48, 1024), (8, 352)])  # 352: swiglu tiles of 32
def test_kernels_equal_the_reference_bit_for_bit(op, shape):
    """Under jit (as in a step) both trace the same encode / decode / op on the same values;
    a norm's row sums, reduced in another order, may round an output at a BF16 tie either way
    (seen once in ~100 clean-clone runs: one code of 16,384)."""
    fn, n_inputs, n_extras, whole_rows = op_cases()[op]
    keys = jax.random.split(fresh_key(), 3)
    inputs = tuple((jax.random.normal(k, shape) * 3).astype(jnp.bfloat16) for k in keys[:n_inputs])
    extras = (1 + 0.1 * jax.random.normal(keys[2], shape[-1:]),)[:n_extras]
    tuning = fq.FusedQuantizeTuning(block_rows=8, block_cols=32)
    got = jax.jit(lambda i, e: fq.save_and_operand(i, fn, e, whole_rows=whole_rows,
                                                   tuning=tuning, interpret=True, **FORMATS)
                  )(inputs, extras)  # fmt: skip
    want = jax.jit(lambda i, e: fq.save_and_operand_reference(i, fn, e, **FORMATS))(inputs, extras)
    if not whole_rows:
        assert_same(got, want)
        return
    decoded = [jax.jit(dequantize, static_argnums=1)(q, jnp.bfloat16) for q in want[0]]
    assert_same(got, want, *exact_output(op, decoded, extras))


def test_the_tensor_amax_is_the_max_of_tile_maxima_and_skips_non_finite():
    """A NaN and an Inf input stay out of the operand's scale (as the reference's)."""
    x = jax.random.normal(fresh_key(), (32, 64)).astype(jnp.bfloat16)
    x = x.at[3, 5].set(jnp.nan).at[7, 9].set(jnp.inf)
    fn = lambda g, u: swiglu_fp32(g, u).astype(jnp.bfloat16)
    tuning = fq.FusedQuantizeTuning(block_rows=8, block_cols=16)
    got = jax.jit(lambda x: fq.save_and_operand((x, x), fn, whole_rows=False, tuning=tuning,
                                                interpret=True, **FORMATS))(x)  # fmt: skip
    want = jax.jit(lambda x: fq.save_and_operand_reference((x, x), fn, **FORMATS))(x)
    assert np.isfinite(float(got[1].amax))
    assert_same(got, want)


def test_rows_that_do_not_fit_a_tile_fall_back_to_the_reference():
    """A norm over 5120 (not a power of two: no whole-row tile) runs the reference, no error."""
    x = jax.random.normal(fresh_key(), (4, 5120)).astype(jnp.bfloat16)
    fn = lambda xd: norm_fp32(xd, None, 1e-5, "layer").astype(jnp.bfloat16)
    got = jax.jit(lambda x: fq.save_and_operand((x,), fn, whole_rows=True, interpret=True,
                                                **FORMATS))(x)  # fmt: skip
    assert_same(got, jax.jit(lambda x: fq.save_and_operand_reference((x,), fn, **FORMATS))(x))


def exact_rows(key, shape):
    """BF16 ``x`` whose COAT save (1x16 E4M3 groups) decodes exactly and whose row sums are
    exact in fp32 in any order: each group of 16 holds 8 numbers and their negatives (row
    means exactly 0), the magnitudes E4M3 numbers in [32, 448] times 2^-6 with 7 among them
    (the group's scale is a power of two), so a row's squares are multiples of 2^-8 below 49
    and its sums need fewer than 24 bits."""
    e4m3 = [v for v in range(32, 449) if float(jnp.float8_e4m3fn(v)) == v]
    k_values, k_order = jax.random.split(key)
    half = jax.random.choice(k_values, jnp.asarray(e4m3, jnp.float32) / 64,
                             (*shape[:-1], shape[-1] // 16, 8)).at[..., 0].set(7.0)  # fmt: skip
    groups = jax.random.permutation(k_order, jnp.concatenate([half, -half], -1), axis=-1,
                                    independent=True)  # fmt: skip
    return groups.reshape(shape).astype(jnp.bfloat16)


FLOW_OPS = {
    "norm_project": lambda r, x, s, u, ws: flow.fp8_norm_project(x, s, ws, 1e-5, r),
    "layer_norm_project": lambda r, x, s, u, ws: flow.fp8_norm_project(x, None, ws, 1e-5, r,
                                                                       "layer"),  # fmt: skip
    "swiglu_project": lambda r, x, s, u, ws: (flow.fp8_swiglu_project(x, u, ws[0], r),),
}


@pytest.mark.parametrize("op", sorted(FLOW_OPS))
def test_flow_ops_with_the_kernels_equal_the_unfused_ops(op):
    """``Fp8Recipe(fused_quantize="interpret")``: outputs and all gradients of the COAT ops
    bit for bit those of the XLA ops (same saved residuals, same operands). The inputs are
    arguments of the step: an input computed in the same jit may be kept in excess precision
    by XLA's fusions where the kernel reads its rounded value. A norm's input has rows its
    sums cannot round (:func:`exact_rows`): reduced in another order, a norm's output at a
    BF16 tie may round either way (1 in ~700 runs of random rows), as
    :func:`test_kernels_equal_the_reference_bit_for_bit` allows."""
    kx, ku, ks, k1, k2, kc = jax.random.split(fresh_key(), 6)
    x, u = (jax.random.normal(k, (2, 16, 128)).astype(jnp.bfloat16) for k in (kx, ku))
    if op != "swiglu_project":
        x = exact_rows(kx, x.shape)
    scale = (1 + 0.1 * jax.random.normal(ks, (128,))).astype(jnp.bfloat16)
    ws = (jax.random.normal(k1, (128, 64)) * 0.05, jax.random.normal(k2, (128, 32)) * 0.05)
    cot = jax.random.normal(kc, (2, 16, 64)).astype(jnp.bfloat16)

    def run(recipe):
        def loss(x, scale, u, ws):
            return jnp.sum(FLOW_OPS[op](recipe, x, scale, u, ws)[0].astype(jnp.float32) * cot)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(x, scale, u, ws)

    (got, got_grads), (want, want_grads) = run(INTERPRET), run(REFERENCE)
    np.testing.assert_array_equal(got, want)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_fused_forward_saves_no_more_bytes():
    """A COAT block saves the same activation bytes with the kernels as without."""
    assert coat_block_saved_bytes(INTERPRET) == coat_block_saved_bytes(REFERENCE)


def test_the_kernels_stay_out_of_other_recipes_and_pallas_needs_a_gpu():
    assert flow._fused_mode(Fp8Recipe(fused_quantize="interpret", scaling="row")) is None
    assert flow._fused_mode(Fp8Recipe(fused_quantize="interpret", forward_gemm="bf16")) is None
    assert flow._fused_mode(Fp8Recipe()) is None  # auto: not measured faster yet
    with pytest.raises(ValueError, match="fused_quantize"):
        Fp8Recipe(fused_quantize="triton")
    with pytest.raises(ValueError, match="Hopper"):
        flow._fused_mode(Fp8Recipe(fused_quantize="pallas"))


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["rms", "swiglu"])
def test_compiled_kernels_equal_the_reference_on_a_gpu(op):
    """Compiled for the GPU (Triton): the 7B shapes' rows (hidden 4096, MLP 11008).

    The saved copies only encode the inputs: codes and scales as the reference's (a GPU's
    reductions may still round a group maximum differently: 1e-3 of the codes). The operand
    goes through ``f`` (the norm's ``rsqrt`` and mean are approximated and reduced in another
    order by Triton), so its ``y`` and hence ``max |y|`` may differ in the last BF16 bit: the
    scale within 2^-7 of the reference's, and each element within one E4M3 rounding (2^-4
    relative) of the reference's ``y`` plus that last bit (2^-7), or of the format's subnormal
    step at that scale."""
    fn, n_inputs, n_extras, whole_rows = op_cases()[op]
    shape = (4096, 4096) if op == "rms" else (4096, 11008)
    keys = jax.random.split(fresh_key(), 3)
    inputs = tuple((jax.random.normal(k, shape) * 3).astype(jnp.bfloat16) for k in keys[:n_inputs])
    extras = (1 + 0.1 * jax.random.normal(keys[2], shape[-1:]),)[:n_extras]
    got = jax.jit(lambda i, e: fq.save_and_operand(i, fn, e, whole_rows=whole_rows,
                                                   **FORMATS))(inputs, extras)  # fmt: skip
    want = jax.jit(lambda i, e: fq.save_and_operand_reference(i, fn, e, **FORMATS))(inputs, extras)
    saved = [(np.mean(codes(g) != codes(w)), np.mean(np.asarray(g.amax) != np.asarray(w.amax)))
             for g, w in zip(got[0], want[0], strict=True)]  # fmt: skip
    y = np.asarray(fn(*(dequantize(q, jnp.bfloat16) for q in want[0]),
                      *(e.reshape(1, -1) for e in extras)), np.float64)  # fmt: skip
    operand = np.asarray(dequantize(got[1], jnp.float32), np.float64)
    amax, want_amax = float(got[1].amax), float(want[1].amax)
    step = amax / E4M3.max * 2.0**-9  # E4M3's subnormal step at this scale
    excess = np.abs(operand - y) - (2.0**-4 + 2.0**-7) * np.abs(y) - step
    report = f"saved (codes, scales) mismatch {saved}; amax {amax} vs {want_amax}; " \
             f"worst operand excess {excess.max():.3g}"  # fmt: skip
    assert all(c < 1e-3 and a < 1e-3 for c, a in saved), report
    assert abs(amax - want_amax) <= 2.0**-7 * want_amax, report
    assert excess.max() <= 0, report


@pytest.mark.parametrize("op", ["rms", "layer", "swiglu"])
def test_kernels_lower_to_triton_for_cuda(op, monkeypatch):
    """Without a GPU: both passes of each op lower to Triton IR (every primitive they trace
    has a Triton lowering) at the 7B block's shapes."""
    monkeypatch.setattr(fq.dispatch, "check_compiled", lambda *a, **k: None)
    fn, n_inputs, n_extras, whole_rows = op_cases()[op]
    shape = (4096, 4096) if whole_rows else (4096, 11008)
    inputs = tuple(jax.ShapeDtypeStruct(shape, jnp.bfloat16) for _ in range(n_inputs))
    extras = (jax.ShapeDtypeStruct(shape[-1:], jnp.float32),)[:n_extras]
    traced = jax.jit(lambda i, e: fq.save_and_operand(i, fn, e, whole_rows=whole_rows,
                                                      **FORMATS)).trace(inputs, extras)  # fmt: skip
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2, text.count("__gpu$xla.gpu.triton")
