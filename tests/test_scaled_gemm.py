"""Finer FP8 GEMM scaling (row, block), BF16 forward GEMMs, and the fp32 reference policy."""

from __future__ import annotations

import dataclasses
import secrets

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from coat_jax.core.formats import get_format
from coat_jax.core.quant import dequantize, from_groups, quantize
from coat_jax.core.recipe import Fp8Recipe
from coat_jax.models import nn
from coat_jax.models.llama import Llama, LlamaConfig
from coat_jax.models.policy import get_policy
from coat_jax.ops import flow, scaled_gemm
from coat_jax.training import configs, residuals


def fresh_key():
    return jax.random.key(secrets.randbits(31))


def per_element(q, x_shape):
    """A per-group array's ``amax`` repeated over its group's elements, in ``x``'s shape."""
    size = q.data.shape[-1]
    return from_groups(jnp.repeat(q.amax[..., None], size, axis=-1), x_shape[-1])


@settings(max_examples=15)  # each example compiles its shapes: ~1.4 s
@given(
    rows=st.integers(1, 300),
    k=st.integers(1, 300),
    scaling=st.sampled_from(["row", "block"]),
    role=st.sampled_from(scaled_gemm.OPERAND_ROLES),
    fmt=st.sampled_from(["e4m3", "e5m2"]),
    log_scale=st.floats(-20, 20),
    seed=st.integers(0, 2**31 - 1),
)
def test_operand_round_trip_within_the_format_rounding(rows, k, scaling, role, fmt, log_scale,
                                                       seed):  # fmt: skip
    """In the scaled domain every element is off by at most the format's rounding bound."""
    fmt = get_format(fmt)
    x = jax.random.normal(jax.random.key(seed), (rows, k)) * (2.0**log_scale)
    x = x * jnp.exp(jax.random.normal(jax.random.key(seed + 1), (rows, 1)) * 3)  # row spread
    q = scaled_gemm.quantize_operand(x, fmt, scaling, role)
    amax = per_element(q, x.shape)
    assert bool(jnp.all(amax >= jnp.abs(x)))  # a group's scale covers all its elements
    scaled = x * (fmt.max / amax)
    err = jnp.abs(scaled_gemm.dequantize_operand(q) - x) * (fmt.max / amax)
    assert bool(jnp.all(err <= fmt.rounding_bound(scaled) * 1.001 + 1e-6))


def test_weight_blocks_share_one_scale_per_128_rows_and_group():
    x = jax.random.normal(fresh_key(), (300, 260))
    q = scaled_gemm.quantize_operand(x, get_format("e4m3"), "block", "weight")
    amax = np.asarray(q.amax)  # (300, 3): groups of 87 along K
    assert amax.shape == (300, 3)
    for start in (0, 128, 256):
        block = amax[start : start + 128]
        assert np.all(block == block[0])
        rows = np.asarray(x[start : start + 128])
        want = [np.abs(rows[:, j * 87 : (j + 1) * 87]).max() for j in range(3)]
        np.testing.assert_allclose(block[0], want, rtol=1e-6)


@pytest.mark.parametrize("scaling", ["row", "block"])
@pytest.mark.parametrize("m,n,k", [(64, 48, 256), (130, 20, 300), (5, 7, 1)])
def test_scaled_matmul_is_the_exact_product_of_the_dequantized_operands(scaling, m, n, k):
    """Group by group in fp32 equals the float64 product of what the operands represent (each
    FP8 x FP8 product is exact in fp32; only the fp32 sums round)."""
    ka, kb = jax.random.split(fresh_key())
    e4m3 = get_format("e4m3")
    a = scaled_gemm.quantize_operand(jax.random.normal(ka, (m, k)), e4m3, scaling, "activation")
    b = scaled_gemm.quantize_operand(jax.random.normal(kb, (n, k)) * 1e-3, e4m3, scaling,
                                     "weight")  # fmt: skip
    da, db = (np.asarray(scaled_gemm.dequantize_operand(x), np.float64) for x in (a, b))
    want = da @ db.T
    got = np.asarray(scaled_gemm.scaled_matmul(a, b), np.float64)
    if jax.default_backend() == "cpu":
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6 * np.abs(want).max())
    else:  # a GPU's FP8 GEMM accumulates a group's products in ~14 bits, not fp32
        assert (np.abs(got - want) <= 2.0**-10 * (np.abs(da) @ np.abs(db).T)).all()


def test_chunked_promotion_equals_one_pass(monkeypatch):
    """More groups than the fp32 partial-product buffer holds are contracted in a loop of
    chunks (padded with zero groups) with the same result."""
    ka, kb = jax.random.split(fresh_key())
    e4m3 = get_format("e4m3")
    a = scaled_gemm.quantize_operand(jax.random.normal(ka, (40, 1000)), e4m3, "block",
                                     "activation")  # fmt: skip
    b = scaled_gemm.quantize_operand(jax.random.normal(kb, (24, 1000)), e4m3, "block", "weight")
    one_pass = scaled_gemm.scaled_matmul(a, b)
    monkeypatch.setattr(scaled_gemm, "_PROMOTION_BYTES", 3 * 4 * 40 * 24)  # 3 of 8 groups
    chunked = scaled_gemm.scaled_matmul(a, b)
    np.testing.assert_allclose(chunked, one_pass, rtol=1e-5, atol=1e-5)


def test_scaled_gemm_rejects_bad_operands():
    e4m3 = get_format("e4m3")
    a = scaled_gemm.quantize_operand(jnp.ones((4, 256)), e4m3, "block", "activation")
    b = scaled_gemm.quantize_operand(jnp.ones((4, 256)), e4m3, "row", "weight")
    with pytest.raises(ValueError, match="group K differently"):
        scaled_gemm.scaled_matmul(a, b)
    with pytest.raises(ValueError, match="grouped operands"):
        scaled_gemm.scaled_matmul(quantize(jnp.ones((4, 256))), b)
    with pytest.raises(ValueError, match="matrix"):
        scaled_gemm.quantize_operand(jnp.ones((2, 4, 256)), e4m3, "row", "weight")
    with pytest.raises(ValueError, match="role"):
        scaled_gemm.quantize_operand(jnp.ones((4, 256)), e4m3, "row", "bias")
    with pytest.raises(ValueError, match="scaling"):
        scaled_gemm.quantize_operand(jnp.ones((4, 256)), e4m3, "tensor", "weight")


@pytest.mark.parametrize(
    "field,value,match",
    [("scaling", "tile", "Fp8Recipe.scaling"), ("forward_gemm", "fp16", "forward_gemm")],
)
def test_recipe_rejects_unknown_scaling_and_forward_gemm(field, value, match):
    with pytest.raises(ValueError, match=match):
        Fp8Recipe(**{field: value})


# --------------------------------------------------------------------------------------------
# The precision flow with finer scales and BF16 forward GEMMs.

OPS = {
    "project": lambda x, w, r: flow.fp8_project(x, (w,), r)[0],
    "norm_project": lambda x, w, r: flow.fp8_norm_project(x, jnp.ones(x.shape[-1]), (w,), 1e-5,
                                                          r)[0],  # fmt: skip
    "swiglu_project": lambda x, w, r: flow.fp8_swiglu_project(x, 0.5 * x, w, r),
}
EXACT = {
    "project": lambda x, w: x @ w,
    "norm_project": lambda x, w: (x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5))
    @ w,
    "swiglu_project": lambda x, w: (jax.nn.silu(x) * 0.5 * x) @ w,
}
FINE = [
    Fp8Recipe(scaling="row", grad_format="e4m3"),
    Fp8Recipe(scaling="block"),
    Fp8Recipe(forward_gemm="bf16"),
    Fp8Recipe(forward_gemm="bf16", scaling="row", grad_format="e4m3"),
    Fp8Recipe(forward_gemm="bf16", scaling="block", grad_format="e4m3"),
]


def _rel(a, b):
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def _bf16_forward_reference(op, x, w, recipe):
    """The fp32 math on what a BF16-GEMM forward of ``op`` reads: ``fp8_project`` its BF16
    input, the COAT ops the FP8 1x16 copies of their inputs."""
    xb = x.astype(jnp.bfloat16)

    def saved(v):
        return dequantize(quantize(v, recipe.saved, group_size=recipe.saved_group))

    if op == "project":
        return EXACT[op](xb.astype(jnp.float32), w)
    if op == "swiglu_project":
        return (jax.nn.silu(saved(xb)) * saved(0.5 * xb)) @ w
    return EXACT[op](saved(xb), w)


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("recipe", FINE, ids=lambda r: f"{r.scaling}-{r.forward_gemm}-"
                         f"{r.grad_format}")  # fmt: skip
def test_fine_recipes_match_fp32_math_within_fp8_error(op, recipe):
    """Outputs and both gradients within 8% of the fp32 math, E5M2 gradients within 10%: an
    E4M3 rounding adds ~2.6% RMS relative error (3 mantissa bits), E5M2 twice that, and a COAT
    op's output carries up to four of them in quadrature (its FP8 1x16 inputs, the re-quantized
    GEMM operand, the weight); 40 seeds measured at most 5.4% / 7.2%. With a BF16 forward GEMM
    the output is within BF16 rounding (1%) of the fp32 math on what the forward reads."""
    kx, kw, kc = jax.random.split(fresh_key(), 3)
    x = jax.random.normal(kx, (2, 48, 256), jnp.float32)
    w = jax.random.normal(kw, (256, 128)) * 0.05
    cot = jax.random.normal(kc, (2, 48, 128))
    fn, exact = OPS[op], EXACT[op]
    out, vjp = jax.vjp(lambda x, w: fn(x.astype(jnp.bfloat16), w, recipe), x, w)
    want, want_vjp = jax.vjp(exact, x, w)
    assert _rel(out, want) < 0.08
    if recipe.forward_gemm == "bf16":  # BF16 rounding of what the forward consumes
        assert _rel(out, _bf16_forward_reference(op, x, w, recipe)) < 0.01
    grad_tol = 0.08 if recipe.grad_format == "e4m3" else 0.10
    for got, ref in zip(vjp(cot.astype(jnp.bfloat16)), want_vjp(cot), strict=True):
        assert _rel(got, ref) < grad_tol


def test_row_scaled_gradients_keep_small_rows_that_per_tensor_flushes():
    """Per-token gradient magnitudes over 8 decades: one E4M3 scale per tensor flushes the
    smallest rows of ``dy`` (their ``dx`` rows come back ~0), one scale per row keeps them."""
    kx, kw, kc = jax.random.split(fresh_key(), 3)
    x = jax.random.normal(kx, (64, 128), jnp.bfloat16)
    w = jax.random.normal(kw, (128, 96)) * 0.05
    row_scale = jnp.logspace(0, -8, 64)[:, None]
    cot = (jax.random.normal(kc, (64, 96)) * row_scale).astype(jnp.bfloat16)
    want = cot.astype(jnp.float32) @ w.T
    small = slice(48, 64)  # rows 1e-6 .. 1e-8 of the largest (E4M3 spans 2^-9 / 448 = 4e-6)

    def dx(recipe):
        _, vjp = jax.vjp(lambda x: flow.fp8_project(x, (w,), recipe)[0], x)
        return vjp(cot)[0].astype(jnp.float32)

    tensor = dx(Fp8Recipe(grad_format="e4m3"))
    row = dx(Fp8Recipe(scaling="row", grad_format="e4m3"))
    assert _rel(row[small], want[small]) < 0.06
    assert _rel(tensor[small], want[small]) > 0.5


@pytest.mark.parametrize("policy", ["coat", "fp8_linear"])
def test_fine_recipes_save_no_more_than_per_tensor(policy):
    """Saved activations per example, in bytes: BF16 forward GEMMs save exactly what FP8
    forward GEMMs save; row/block scales add their scales (<= 1/32 of the FP8 codes)."""
    h, t, heads, ffn = 128, 32, 4, 384

    def saved(recipe):
        block = nn.Block(h, heads, heads, ffn, policy=get_policy(policy, recipe),
                         rngs=nnx.Rngs(0))  # fmt: skip
        graph, params = nnx.split(block)

        def f(x, params):
            return nnx.merge(graph, params)(x, jnp.broadcast_to(jnp.arange(t), x.shape[:2]))

        def make_args(batch):
            return jnp.ones((batch, t, h), jnp.bfloat16), params

        return residuals.activation_bytes_per_example(make_args, f)

    base = saved(Fp8Recipe())
    assert saved(Fp8Recipe(forward_gemm="bf16")) == base
    for recipe in FINE:
        assert base <= saved(recipe) <= base * 1.05, recipe


# --------------------------------------------------------------------------------------------
# The fp32 reference policy and the model's matmul precision.

TINY = LlamaConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128)


def test_fp32_policy_computes_everything_in_fp32():
    model = Llama(dataclasses.replace(TINY, precision="fp32"), rngs=nnx.Rngs(0))
    tokens = jax.random.randint(fresh_key(), (2, 16), 0, 64)
    jaxpr = str(jax.make_jaxpr(lambda t: model(t))(tokens))
    assert "bf16" not in jaxpr
    assert "precision=HIGHEST" in jaxpr or "Precision.HIGHEST" in jaxpr
    bf16_model = Llama(dataclasses.replace(TINY, precision="bf16"), rngs=nnx.Rngs(0))
    with jax.default_matmul_precision("highest"):
        want = bf16_model(tokens, compute_dtype=jnp.float32)
    np.testing.assert_allclose(model(tokens), want, rtol=1e-6, atol=1e-6)
    assert _rel(bf16_model(tokens), want) > 1e-4  # the default really is BF16


def test_matmul_precision_reaches_the_model_and_rejects_bad_values():
    config = dataclasses.replace(TINY, precision="fp32", matmul_precision="BF16_BF16_F32_X3")
    assert config.policy().matmul_precision == "BF16_BF16_F32_X3"
    with pytest.raises(ValueError, match="matmul_precision"):
        dataclasses.replace(TINY, precision="fp32", matmul_precision="fast")
    with pytest.raises(ValueError, match="applies to precision"):
        dataclasses.replace(TINY, precision="coat", matmul_precision="highest")
    c = configs.load_file(
        "configs/llama_tiny.py",
        configs.parse_overrides(["precision=fp32", "model.matmul_precision=BF16_BF16_F32_X3",
                                 "fp8.scaling=row", "fp8.forward_gemm=bf16"]),
    )  # fmt: skip
    configs.validate(c)
    model = configs.llama_config(c)
    assert model.matmul_precision == "BF16_BF16_F32_X3"
    assert model.fp8 == Fp8Recipe(scaling="row", forward_gemm="bf16")
    bad = configs.load_file("configs/llama_tiny.py", configs.parse_overrides(["fp8.scaling=tile"]))
    with pytest.raises(ValueError, match="config.fp8: Fp8Recipe.scaling"):
        configs.validate(bad)
