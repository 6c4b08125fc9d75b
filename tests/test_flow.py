"""Precision-flow ops: VJPs against fp32 references, adversarial scales, saved bytes, errors."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coat_jax.core import quant
from coat_jax.core.quant import dequantize, quantize
from coat_jax.core.recipe import Fp8Recipe
from coat_jax.models import nn
from coat_jax.models.policy import POLICIES, get_policy
from coat_jax.ops import flow, plain
from coat_jax.training import residuals

# Stated tolerances (relative Frobenius error against fp32 math on the same inputs):
FWD_TOL = 0.08  # two E4M3 operands: <= 2^-4 per element each, ~5% RMS on a product
BWD_TOL = 0.12  # plus E5M2 output gradients: <= 2^-3 per element, ~6% RMS


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "non-finite values"
    denom = np.linalg.norm(b)
    return np.linalg.norm(a - b) / denom if denom > 0 else np.linalg.norm(a)


def fresh_key():
    return jax.random.key(np.random.default_rng().integers(1 << 30))


def activations(key, shape, scale=1.0, zero_rows=False):
    x = jax.random.normal(key, shape) * scale
    if zero_rows:
        x = x.at[..., ::3, :].set(0.0)
    return x.astype(jnp.bfloat16)


SCALES = [dict(scale=1.0), dict(scale=1e-6), dict(scale=3e3), dict(scale=1.0, zero_rows=True)]


def check_grads(ours, reference, args, fwd_tol=FWD_TOL, bwd_tol=BWD_TOL):
    """Outputs, and the VJP of a fresh random cotangent, against fp32 math on the same inputs."""
    args32 = [jnp.asarray(a, jnp.float32) for a in args]
    out, ref = ours(*args), reference(*args32)
    for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        assert o.shape == r.shape
        assert rel_err(o, r) < fwd_tol, rel_err(o, r)
    keys = jax.random.split(fresh_key(), len(jax.tree.leaves(ref)))
    cot = [jax.random.normal(k, r.shape) for k, r in zip(keys, jax.tree.leaves(ref), strict=True)]

    def pull(f, args, cast):
        out, vjp = jax.vjp(f, *args)
        treedef = jax.tree.structure(out)
        leaves = [c.astype(cast(o).dtype) for c, o in zip(cot, jax.tree.leaves(out), strict=True)]
        return vjp(jax.tree.unflatten(treedef, leaves))

    grads = pull(ours, args, lambda o: o)
    grads_ref = pull(reference, args32, lambda o: o)
    for a, g, r in zip(args, grads, grads_ref, strict=True):
        assert g.dtype == a.dtype and g.shape == a.shape
        assert rel_err(g, r) < bwd_tol, rel_err(g, r)


def weights(key, *shapes):
    keys = jax.random.split(key, len(shapes))
    return [jax.random.normal(k, s) / np.sqrt(s[0]) for k, s in zip(keys, shapes, strict=True)]


@pytest.mark.parametrize("kw", SCALES)
def test_fp8_project_vjp(kw):
    k1, k2 = jax.random.split(fresh_key())
    x = activations(k1, (2, 24, 64), **kw)
    w1, w2 = weights(k2, (64, 96), (64, 32))
    check_grads(
        lambda x, a, b: flow.fp8_project(x, (a, b)),
        lambda x, a, b: (x @ a, x @ b),
        [x, w1, w2],
    )


@pytest.mark.parametrize("kw", SCALES)
def test_fp8_norm_project_vjp(kw):
    k1, k2, k3 = jax.random.split(fresh_key(), 3)
    x = activations(k1, (2, 24, 64), **kw)
    scale = 1 + 0.2 * jax.random.normal(k3, (64,))
    w1, w2 = weights(k2, (64, 48), (64, 80))
    norm = lambda x, s: plain.rmsnorm_fp32(x, s, 1e-6)
    check_grads(
        lambda x, s, a, b: flow.fp8_norm_project(x, s, (a, b), 1e-6),
        lambda x, s, a, b: (norm(x, s) @ a, norm(x, s) @ b),
        [x, scale, w1, w2],
    )


@pytest.mark.parametrize("kw", SCALES)
def test_fp8_layer_norm_project_vjp(kw):
    """OLMo's weightless LayerNorm through COAT's op (``kind="layer"``, no scale), inputs with a
    nonzero mean per row: the same tolerances as RMSNorm's."""
    k1, k2, k3 = jax.random.split(fresh_key(), 3)
    offset = 0.5 * kw["scale"] * jax.random.normal(k3, (2, 24, 1))
    x = (activations(k1, (2, 24, 64), **kw) + offset).astype(jnp.bfloat16)
    w1, w2 = weights(k2, (64, 48), (64, 80))
    norm = lambda x: plain.layernorm_fp32(x, 1e-5)
    check_grads(
        lambda x, a, b: flow.fp8_norm_project(x, None, (a, b), 1e-5, kind="layer"),
        lambda x, a, b: (norm(x) @ a, norm(x) @ b),
        [x, w1, w2],
    )


def test_layer_norm_saves_fp8_groups_and_nothing_else():
    """COAT's LayerNorm keeps what its RMSNorm keeps (x in FP8 1x16 groups, one scale per
    group, the operand's amax, the FP8 weights) minus the norm weight it does not have."""
    x = activations(fresh_key(), (4, 32, 64))
    (w,) = weights(fresh_key(), (64, 48))
    scale = jnp.ones(64)
    rms = lambda x, w: flow.fp8_norm_project(x, scale, (w,), 1e-5)
    layer = lambda x, w: flow.fp8_norm_project(x, None, (w,), 1e-5, kind="layer")
    _, vjp = jax.vjp(layer, x, w)
    wide = [r for r in jax.tree.leaves(vjp) if r.size >= x.size]
    assert [(r.dtype, r.shape) for r in wide] == [(jnp.float8_e4m3fn, (4, 32, 4, 16))]
    saved = lambda f: residuals.saved_residual_bytes(f, x, w)
    assert saved(layer) == saved(rms) - scale.nbytes
    assert saved(layer) < x.size * 1.3 + w.size + 64  # ~1.25 bytes an element, FP8 weights


@pytest.mark.parametrize("kw", SCALES)
def test_fp8_swiglu_project_vjp(kw):
    k1, k2, k3 = jax.random.split(fresh_key(), 3)
    gate, up = activations(k1, (2, 24, 96), **kw), activations(k2, (2, 24, 96), **kw)
    (w,) = weights(k3, (96, 64))
    check_grads(
        flow.fp8_swiglu_project,
        lambda g, u, w: (jax.nn.silu(g) * u) @ w,
        [gate, up, w],
    )


def test_all_zero_input_gives_zero_outputs_and_finite_grads():
    x = jnp.zeros((2, 8, 32), jnp.bfloat16)
    w = jnp.ones((32, 16))
    for f in (
        lambda x, w: flow.fp8_project(x, (w,))[0],
        lambda x, w: flow.fp8_norm_project(x, jnp.ones(32), (w,))[0],
    ):
        assert float(jnp.abs(f(x, w)).max()) == 0
        loss = lambda x, w, f=f: jnp.sum(f(x, w).astype(jnp.float32) ** 2)
        gx, gw = jax.grad(loss, (0, 1))(x, w)
        assert np.all(np.isfinite(np.asarray(gx, np.float32))) and np.all(np.isfinite(gw))


def test_reference_ops_match_autodiff_of_their_math():
    k1, k2, k3 = jax.random.split(fresh_key(), 3)
    x, up = jax.random.normal(k1, (3, 40)), jax.random.normal(k2, (3, 40))
    scale = 1 + jax.random.normal(k3, (40,))
    check_grads(lambda x, s: plain.rmsnorm(x, s, 1e-6), lambda x, s: plain.rmsnorm_fp32(x, s, 1e-6),
                [x, scale], 1e-6, 1e-5)  # fmt: skip
    check_grads(plain.swiglu, plain.swiglu_fp32, [x, up], 1e-6, 1e-5)


def test_layernorm_and_clip_match_autodiff_of_their_formulas():
    """Stated tolerances (fp32 inputs): 1e-6 forward, 1e-5 gradient, relative Frobenius, against
    ``jax.vjp`` of the textbook formulas (``jnp.var``: biased, as torch's ``layer_norm``)."""
    x = jax.random.normal(fresh_key(), (3, 40)) * 2 + 1.5
    formula = lambda x: (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-5)
    check_grads(lambda x: plain.layernorm(x, 1e-5), formula, [x], 1e-6, 1e-5)
    check_grads(lambda x: plain.clip(x, 2.0), lambda x: jnp.clip(x, -2.0, 2.0), [x], 1e-7, 1e-7)
    xb = x.astype(jnp.bfloat16)
    assert residuals.saved_residual_bytes(lambda x: plain.clip(x, 2.0), xb) == xb.size  # a mask
    with pytest.raises(ValueError, match="norm kind 'layer' takes no weight"):
        plain.norm(x, jnp.ones(40), 1e-5, "layer")


def test_rope_vjp_is_exact_and_norm_preserving():
    x = jax.random.normal(fresh_key(), (2, 9, 3, 16))
    pos = jnp.broadcast_to(jnp.arange(9), (2, 9))
    y = plain.rope(x, pos, 1e4)
    np.testing.assert_allclose(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-5)
    check_grads(lambda x: plain.rope(x, pos, 1e4), lambda x: plain._rope_math(x, pos, 1e4), [x],
                1e-6, 1e-5)  # fmt: skip


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_reference_attention_matches_jax_nn(kv_heads):
    k1, k2, k3 = jax.random.split(fresh_key(), 3)
    q = jax.random.normal(k1, (2, 12, 4, 16))
    k = jax.random.normal(k2, (2, 12, kv_heads, 16))
    v = jax.random.normal(k3, (2, 12, kv_heads, 16))
    expected = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
    check_grads(lambda q, k, v: plain.attention(q, k, v, "reference"), expected, [q, k, v],
                1e-5, 1e-5)  # fmt: skip


def test_fp8_gemm_equals_dot_of_dequantized_operands():
    k1, k2 = jax.random.split(fresh_key())
    a = quantize(jax.random.normal(k1, (5, 64)), "e4m3")
    b = quantize(jax.random.normal(k2, (64, 7)), "e5m2")
    with jax.default_matmul_precision("highest"):
        expected = dequantize(a) @ dequantize(b)
    # cuBLASLt's FP8 GEMM accumulates with ~14 significant bits (README, Limits); XLA on the CPU
    # computes the same products in fp32, summed in another order than the dot of the
    # dequantized operands (each rounded twice: codes / fmax * amax): both sums are within
    # gamma_64 sum_i |a_i b_i| of the exact one (Higham), so 2 * 64 + 4 fp32 roundings of it.
    # A flat 1e-5 was 2.6 ulps at |result| > 32 and failed 1 seed in 40,000 (18877: 1.14e-5).
    if jax.default_backend() == "gpu":
        tol = 1e-3 * float(jnp.abs(expected).max())
    else:
        magnitude = np.abs(np.asarray(dequantize(a))) @ np.abs(np.asarray(dequantize(b)))
        tol = (2 * 64 + 4) * 2.0**-24 * magnitude
    err = np.abs(np.asarray(flow.fp8_gemm(a, b, (-1, 0))) - np.asarray(expected))
    assert np.all(err <= tol), np.max(err / tol)


def test_fp8_gemm_with_partials_in_out_dtype_rounds_once_more():
    """``partials_in_out_dtype``: the GEMM emits BF16, the scales multiply after: the fp32
    result within two BF16 roundings (2^-8 relative each, per element), and the same as scaling
    the BF16 product by hand."""
    k1, k2 = jax.random.split(fresh_key())
    a = quantize(jax.random.normal(k1, (300, 64)), "e4m3")
    b = quantize(jax.random.normal(k2, (300, 50)), "e5m2")
    got = flow.fp8_gemm(a, b, (0, 0), jnp.bfloat16, partials_in_out_dtype=True)
    assert got.dtype == jnp.bfloat16
    want = flow.fp8_gemm(a, b, (0, 0))
    np.testing.assert_allclose(got.astype(jnp.float32), want, rtol=2**-7, atol=1e-6)
    product = jax.lax.dot_general(a.data, b.data, (((0,), (0,)), ((), ())),
                                  preferred_element_type=jnp.bfloat16)  # fmt: skip
    by_hand = (product.astype(jnp.float32) * (a.scale * b.scale)).astype(jnp.bfloat16)
    np.testing.assert_array_equal(got, by_hand)


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_fp8_gemm_with_a_bf16_product(out_dtype):
    """``Fp8Recipe(gemm_product="bf16")``: the GEMM writes a BF16 product and the scales
    multiply it after, in any output dtype: the fp32 product's result within two BF16
    roundings, equal to scaling the BF16 product by hand; the default writes fp32."""
    k1, k2 = jax.random.split(fresh_key())
    a = quantize(jax.random.normal(k1, (40, 96)), "e4m3")
    b = quantize(jax.random.normal(k2, (96, 24)), "e5m2")
    recipe = Fp8Recipe(gemm_product="bf16")
    got = flow.fp8_gemm(a, b, (-1, 0), out_dtype, recipe)
    assert got.dtype == out_dtype
    want = flow.fp8_gemm(a, b, (-1, 0))
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2**-7, atol=1e-6)
    product = jax.lax.dot_general(a.data, b.data, (((1,), (0,)), ((), ())),
                                  preferred_element_type=jnp.bfloat16)  # fmt: skip
    by_hand = (product.astype(jnp.float32) * (a.scale * b.scale)).astype(out_dtype)
    np.testing.assert_array_equal(got, by_hand)
    dots = lambda r: [e.params["preferred_element_type"] for e in jax.make_jaxpr(
        lambda a, b: flow.fp8_gemm(a, b, (-1, 0), out_dtype, r))(a, b).eqns
        if e.primitive.name == "dot_general"]  # fmt: skip
    assert dots(recipe) == [jnp.bfloat16] and dots(Fp8Recipe()) == [jnp.float32]


def block_activation_bytes(policy, h=128, t=32, heads=4, ffn=352, norm="rms"):
    block = nn.Block(h, heads, heads, ffn, policy=get_policy(policy), norm=norm, rngs=nnx.Rngs(0))
    graph, params = nnx.split(block)

    def f(x, params):
        return nnx.merge(graph, params)(x, jnp.broadcast_to(jnp.arange(t), x.shape[:2]))

    def make_args(batch):
        return activations(jax.random.key(batch), (batch, t, h)), params

    return residuals.activation_bytes_per_example(make_args, f) / (t * h * 2)  # in units of U


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_saved_activation_bytes_per_block(norm):
    """COAT keeps <= 0.62x the BF16 block's activations (paper: 13.33U / 22.66U = 0.59), with
    RMSNorm (Llama) as with the weightless LayerNorm (OLMo)."""
    u = {name: block_activation_bytes(name, norm=norm) for name in POLICIES}
    print("saved activations per block, units of U = tokens*hidden*2 bytes:", u)
    assert u["coat"] <= 0.62 * u["bf16"]
    assert u["coat"] < u["fp8_linear"] < u["bf16"]


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_coat_residuals_are_fp8(norm):
    block = nn.Block(64, 4, 4, 176, policy=get_policy("coat"), norm=norm, rngs=nnx.Rngs(0))
    graph, params = nnx.split(block)
    x = activations(fresh_key(), (2, 16, 64))
    _, vjp = jax.vjp(lambda x, p: nnx.merge(graph, p)(x, jnp.zeros((2, 16), jnp.int32)), x, params)
    wide = [r for r in jax.tree.leaves(vjp) if r.ndim >= 2 and r.shape[:2] == (2, 16)]
    bf16 = [r.shape for r in wide if r.dtype == jnp.bfloat16]
    # only the attention core's q, k, v stay BF16 (cuDNN's flash attention on a GPU also
    # keeps its output for backward)
    cores = 4 if plain.attention_implementation(jnp.bfloat16) == "cudnn" else 3
    assert bf16 == [(2, 16, 4, 16)] * cores
    assert any(r.dtype == jnp.float8_e4m3fn for r in wide)


def test_the_recipe_decides_formats_and_groups():
    """A non-default recipe (E4M3 gradient operands, 1x32 saved groups): no E5M2 anywhere in
    the backward, saved groups of 32, and gradients still as close to the fp32 reference."""
    recipe = Fp8Recipe(grad_format="e4m3", saved_group=32)
    k1, k2 = jax.random.split(fresh_key())
    x = activations(k1, (2, 8, 64))
    (w,) = weights(k2, (64, 48))
    loss = lambda r: lambda x, w: flow.fp8_norm_project(x, jnp.ones(64), (w,), 1e-6, r)[0].sum()
    jaxpr = lambda r: str(jax.make_jaxpr(jax.grad(loss(r), (0, 1)))(x, w))
    assert "f8_e5m2" in jaxpr(Fp8Recipe()) and "f8_e5m2" not in jaxpr(recipe)
    _, vjp = jax.vjp(lambda x: flow.fp8_norm_project(x, jnp.ones(64), (w,), 1e-6, recipe), x)
    groups = {leaf.shape[-1] for leaf in jax.tree.leaves(vjp) if leaf.dtype == jnp.float8_e4m3fn
              and leaf.ndim == 4}  # fmt: skip
    assert groups == {32}
    norm = lambda x: plain.rmsnorm_fp32(x, jnp.ones(64), 1e-6)
    check_grads(lambda x, w: flow.fp8_norm_project(x, jnp.ones(64), (w,), 1e-6, recipe),
                lambda x, w: (norm(x) @ w,), [x, w])  # fmt: skip
    with pytest.raises(ValueError, match="multiple of the FP8 group size 32"):
        flow.fp8_norm_project(jnp.ones((2, 48)), jnp.ones(48), (jnp.ones((48, 4)),), 1e-6, recipe)


OPS = {  # each FP8 op with two kernels' worth of weights: (x, w1, w2) -> outputs
    "project": lambda r: lambda x, w1, w2: flow.fp8_project(x, (w1, w2), r),
    "norm_project": lambda r: lambda x, w1, w2: flow.fp8_norm_project(x, jnp.ones(64), (w1, w2),
                                                                       1e-6, r),
    "swiglu_project": lambda r: lambda x, w1, w2: flow.fp8_swiglu_project(x, x * 0.5, w1 + w2, r),
}  # fmt: skip


@pytest.mark.parametrize("forward_gemm", ["fp8", "bf16"])
@pytest.mark.parametrize("op", sorted(OPS))
def test_requantized_weights_give_the_same_gradients_and_save_no_codes(op, forward_gemm):
    """``saved_weights="requantize"``: backward rebuilds the forward's FP8 weight codes from the
    weights (same ``amax``), so outputs and gradients equal ``"fp8"``'s bit for bit, and the
    residuals hold no FP8 array shaped like a weight."""
    kx, kw = jax.random.split(fresh_key())
    x = activations(kx, (2, 8, 64))
    w1, w2 = weights(kw, (64, 48), (64, 48))
    kept, again = (Fp8Recipe(forward_gemm=forward_gemm, saved_weights=s)
                   for s in ("fp8", "requantize"))  # fmt: skip
    results = []
    for recipe in (kept, again):
        f = OPS[op](recipe)
        out, vjp = jax.vjp(f, x, w1, w2)
        ramp = lambda o: jnp.full_like(o, 0.01) * jnp.arange(o.shape[-1], dtype=o.dtype)
        cot = jax.tree.map(ramp, out)
        codes = [r.shape for r in jax.tree.leaves(vjp) if r.shape == (64, 48) and
                 jnp.issubdtype(r.dtype, jnp.floating) and r.dtype.itemsize == 1]  # fmt: skip
        results.append((out, vjp(cot), codes))
    (out_kept, grads_kept, codes_kept), (out_again, grads_again, codes_again) = results
    assert codes_kept and not codes_again, (codes_kept, codes_again)
    for a, b in zip(jax.tree.leaves((out_kept, grads_kept)),
                    jax.tree.leaves((out_again, grads_again)), strict=True):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def _dequantizations_of_groups(hlo: str, groups_shape: str) -> dict:
    """``{"forward": n, "backward": n}``: converts in optimized HLO text whose operand is an
    FP8 array of ``groups_shape`` (``"[4,32,4,16]"``), by the pass their op name says."""
    types, count = {}, {"forward": 0, "backward": 0}
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) = (\S+) (\S+)\(%?([\w.\-]*)", line)
        if not m:
            continue
        name, dtype, op, operand = m.groups()
        types[name] = dtype
        if op == "convert" and types.get(operand, "").startswith("f8e4m3fn" + groups_shape):
            count["backward" if "transpose(" in line else "forward"] += 1
    return count


@pytest.mark.xla_cpu  # counts converts in XLA:CPU's optimized HLO
@pytest.mark.parametrize(("op", "saved_groups"), [("norm_project", 1), ("swiglu_project", 2)])
def test_backward_dequantizes_the_fp8_groups_it_saved(op, saved_groups):
    """Backward dequantizes the saved FP8 1x16 groups itself: an optimization barrier keeps XLA
    from merging its dequantization with the forward's identical one (CSE), which kept the
    forward's BF16 result alive until backward instead of the FP8 codes (1.25 -> 2 bytes an
    element; with the operands backward requantizes, 5.19 -> 3.24 GB a sequence of the 7B step
    with every memory option, measured on an H200). Without the barrier the
    optimized HLO converts no saved group in backward."""
    kx, kw = jax.random.split(fresh_key())
    x = activations(kx, (4, 32, 64))
    w1, w2 = weights(kw, (64, 48), (64, 48))
    f = OPS[op](Fp8Recipe())
    loss = lambda x, w1, w2: sum(jnp.sum(o.astype(jnp.float32) ** 2)
                                 for o in jax.tree.leaves(f(x, w1, w2)))  # fmt: skip
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, w1, w2).compile().as_text()
    count = _dequantizations_of_groups(hlo, "[4,32,4,16]")
    assert count["backward"] == saved_groups, count


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: flow.fp8_project(jnp.ones((2, 8)), (jnp.ones((9, 4)),)), "last axis 8"),
        (lambda: flow.fp8_project(jnp.ones((2, 8)), ()), "at least one kernel"),
        (lambda: flow.fp8_norm_project(jnp.ones((2, 24)), jnp.ones(24), (jnp.ones((24, 4)),)),
         "not a multiple of the FP8 group size 16"),
        (lambda: flow.fp8_swiglu_project(jnp.ones((2, 16)), jnp.ones((2, 32)), jnp.ones((16, 4))),
         "differ"),
        (lambda: get_policy("fp4"), "unknown precision policy"),
        (lambda: plain.attention(jnp.ones((1, 2, 3, 4)), jnp.ones((1, 2, 2, 4)),
                                jnp.ones((1, 2, 2, 4))), "not a multiple"),
    ],
)  # fmt: skip
def test_bad_input_raises(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def fp32_fusion_outputs(hlo: str) -> list[int]:
    """Element counts of the fp32 arrays that the compiled program's fusions write."""
    counts = []
    for line in hlo.splitlines():
        rhs = line.partition("=")[2]
        if "fusion(" not in rhs:
            continue
        for dims in re.findall(r"f32\[([\d,]+)\]", rhs.split("fusion(")[0]):
            counts.append(int(np.prod([int(d) for d in dims.split(",")])))
    return counts


@pytest.mark.gpu
def test_gpu_norm_forward_does_not_write_an_fp32_copy_of_its_input():
    """COAT's norm forward reads the 1x16 codes it saves; XLA used to hand the norm the
    dequantized copy from the fusion that wrote the codes, in fp32 (4 bytes an element of
    ``x``, written and read again)."""
    x = jax.random.normal(fresh_key(), (4, 256, 1024), jnp.bfloat16)
    scale, w = jnp.ones((1024,)), jnp.ones((1024, 512), jnp.bfloat16) / 32
    forward = jax.jit(lambda x, s, w: flow.fp8_norm_project(x, s, (w,))[0])
    hlo = forward.lower(x, scale, w).compile().as_text()
    assert x.size not in fp32_fusion_outputs(hlo)


FUSED_INTERPRETED = dict(fused_quantize="interpret", fused_mlp="interpret",
                         fused_backward="interpret", grad_transpose="interpret")  # fmt: skip


@pytest.mark.parametrize("policy", ["coat", "fp8_linear"])
@pytest.mark.parametrize("kernels", [{}, FUSED_INTERPRETED], ids=["xla", "fused"])
def test_pow2_scales_reach_every_gemm(policy, kernels, monkeypatch):
    """With ``pow2_scales`` every per-tensor scale that :func:`flow.fp8_gemm` multiplies a Llama
    block's products by, forward and backward, through the XLA ops and the fused kernels
    (interpreted), is a power of two; without it they are not. (The fused MLP's gate / up GEMMs
    take the same operands' scales in the kernel, not through ``fp8_gemm``.)"""

    def scales_seen(recipe):
        seen, gemm = [], flow.fp8_gemm

        def recording(a, b, *args, **kwargs):
            jax.debug.callback(lambda s, t: seen.extend([float(s), float(t)]), a.scale, b.scale)
            return gemm(a, b, *args, **kwargs)

        h, t = 128, 32
        block = nn.Block(h, 4, 4, 352, policy=get_policy(policy, recipe), rngs=nnx.Rngs(0))
        graph, params = nnx.split(block)
        x = activations(fresh_key(), (2, t, h))
        loss = lambda p: jnp.sum(nnx.merge(graph, p)(x, jnp.arange(t)[None]).astype(float) ** 2)
        with monkeypatch.context() as patch:
            patch.setattr(flow, "fp8_gemm", recording)
            jax.block_until_ready(jax.jit(jax.grad(loss))(params))
            jax.effects_barrier()
        return np.array(seen)

    pow2 = scales_seen(Fp8Recipe(**kernels, pow2_scales=True))
    assert len(pow2) >= 2 * 9 and np.all(np.frexp(pow2)[0] == 0.5), pow2
    assert not np.all(np.frexp(scales_seen(Fp8Recipe(**kernels)))[0] == 0.5)


def test_pow2_scales_make_a_bf16_gemm_product_round_once():
    """With power-of-two scales a GEMM writing its product in BF16 (``gemm_product="bf16"``)
    returns what the fp32 product scaled and rounded once returns, bit for bit; with measured
    scales the BF16 product is rounded twice and parts from it. Codes in [1, 16) over K = 64:
    every product and partial sum is exact in fp32, whatever order the dot adds them in."""
    k1, k2, k3 = jax.random.split(fresh_key(), 3)
    codes = lambda k, s: jnp.exp2(jax.random.uniform(k, s, maxval=4.0)).astype(jnp.float8_e4m3fn)
    a_codes, b_codes = codes(k1, (48, 64)), codes(k2, (64, 40))
    a_max, b_max = jax.random.uniform(k3, (2,), minval=1.0, maxval=100.0)
    for pow2, parts in ((True, False), (False, True)):
        a_amax = quant.pow2_amax(a_max, "e4m3") if pow2 else a_max
        b_amax = quant.pow2_amax(b_max, "e4m3") if pow2 else b_max
        a = quant.QuantizedArray(a_codes, a_amax)
        b = quant.QuantizedArray(b_codes, b_amax)
        fp32 = flow.fp8_gemm(a, b, (-1, 0), jnp.bfloat16, Fp8Recipe())
        bf16 = flow.fp8_gemm(a, b, (-1, 0), jnp.bfloat16, Fp8Recipe(gemm_product="bf16"))
        assert (not np.array_equal(np.asarray(fp32), np.asarray(bf16))) == parts
