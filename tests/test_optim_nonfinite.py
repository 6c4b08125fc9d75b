"""fp8_adamw against optax.adamw on non-finite, huge, tiny and denormal gradients.

The README's robustness table has one row per case in ``CASES``. For each, both optimizers
take the same gradient stream with the special values injected at one step, and must agree
element by element on what is not finite (the parameter set that becomes NaN, the second
moments that overflow to +inf), while every finite parameter stays within FP8 tolerance of
adamw's. The hypothesis test draws positions, values and the step at random.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st
from triton_semantics import eval_like_triton

import coat_jax
from coat_jax.core import adam, formats, quant
from pallas_kernels import adam_step

LR = 1e-2
STEPS = 6
SHAPE = (4, 256)  # two groups of 128 per row
ATOL = 0.03  # |fp8 - fp32| of a finite parameter after STEPS steps of LR (FP8 moments' error)

CASES = {
    "NaN": [np.nan],
    "+Inf": [np.inf],
    "-Inf": [-np.inf],
    "1e30 (g**2 overflows)": [1e30, -1e30],
    "3e38 (near fp32 max)": [3e38],
    "1e-30 (g**2 underflows)": [1e-30, -1e-30],
    "zeros": [0.0],
    "denormals": [1e-40, -3e-42],
    "mixed": [np.nan, np.inf, 1e30, 1e-30, 0.0, 1e-40],
}


def optimizers(kernels="reference"):
    return {
        "adamw": optax.adamw(LR),
        "fp8": coat_jax.fp8_adamw(LR, min_size=0, kernels=kernels),
    }


@functools.cache
def steppers(kernels="reference"):
    return {k: jax.jit(o.update) for k, o in optimizers(kernels).items()}


def gradients(rng, inject_step, positions, values):
    """STEPS gradients for ``{"w": SHAPE}``; ``values`` placed at ``positions`` at one step."""
    out = []
    for i in range(STEPS):
        g = rng.standard_normal(SHAPE).astype(np.float32)
        if i == inject_step:
            g[positions] = np.asarray(values, np.float32)
        out.append({"w": jnp.asarray(g)})
    return out


def run_both(grads, kernels="reference"):
    """Parameters and states of adamw and fp8_adamw after the stream, from the same start."""
    init = {"w": jnp.asarray(np.linspace(-1, 1, np.prod(SHAPE), dtype=np.float32).reshape(SHAPE))}
    result = {}
    for name, opt in optimizers(kernels).items():
        params, state = init, opt.init(init)
        for g in grads:
            updates, state = steppers(kernels)[name](g, state, params)
            params = optax.apply_updates(params, updates)
        result[name] = (np.asarray(params["w"]), state[0])
    return result


def decoded_moments(state):
    """fp32 ``(m, v)`` of the fp8 state as the optimizer reads them (NaN code of v: +inf)."""
    (mu,), (nu,) = adam.moments(state, jax.tree.structure({"w": 0}))
    return np.asarray(quant.dequantize(mu)), np.asarray(
        adam.loaded_second_moment(quant.dequantize(nu))
    )


def assert_like_adamw(result):
    p32, s32 = result["adamw"]
    p8, s8 = result["fp8"]
    np.testing.assert_array_equal(np.isnan(p8), np.isnan(p32), "NaN parameters differ")
    np.testing.assert_array_equal(np.isinf(p8), np.isinf(p32), "Inf parameters differ")
    finite = np.isfinite(p32)
    np.testing.assert_allclose(p8[finite], p32[finite], rtol=0, atol=ATOL)
    m8, v8 = decoded_moments(s8)
    m32, v32 = np.asarray(s32.mu["w"]), np.asarray(s32.nu["w"])
    # v is finite exactly where adamw's is, and +inf where adamw's overflowed (a NaN v,
    # whose m is NaN too, reads as +inf: the parameter is NaN either way)
    np.testing.assert_array_equal(np.isfinite(v8), np.isfinite(v32))
    assert (v8[v32 == np.inf] == np.inf).all()
    # m: finite wherever adamw's is (0 where v is +inf: every later update there is 0)
    assert np.isfinite(m8[np.isfinite(m32)]).all()
    return np.isnan(p32).sum()


@pytest.mark.parametrize("case", CASES)
def test_robustness_table_row(case):
    rng = np.random.default_rng()
    positions = (np.array([0, 1, 1, 3]), np.array([5, 0, 200, 255]))
    values = np.resize(np.asarray(CASES[case], np.float32), 4)
    if case == "zeros":  # the whole gradient of one step is zero
        positions = (slice(None), slice(None))
        values = 0.0
    n_nan = assert_like_adamw(run_both(gradients(rng, 1, positions, values)))
    # the non-finite elements stay their own: never a whole group or leaf
    assert n_nan <= 4


def test_one_nan_costs_one_element_not_its_group():
    rng = np.random.default_rng()
    grads = gradients(rng, 1, (np.array([2]), np.array([7])), [np.nan])
    p8, _ = run_both(grads)["fp8"]
    assert np.isnan(p8).sum() == 1 and np.isnan(p8[2, 7])


def test_huge_gradient_freezes_its_element_as_adamw_does():
    rng = np.random.default_rng()
    grads = gradients(rng, 1, (np.array([0]), np.array([3])), [1e30])
    result = run_both(grads)
    assert_like_adamw(result)
    p8, s8 = result["fp8"]
    _, v8 = decoded_moments(s8)
    assert v8[0, 3] == np.inf and np.isfinite(p8).all()
    # the group's other second moments keep their precision (not squeezed by a 1e60 maximum)
    p32, _ = result["adamw"]
    np.testing.assert_allclose(p8[0, :128], p32[0, :128], atol=ATOL)


@pytest.mark.parametrize(
    "kernels", ["interpret", pytest.param("pallas", marks=pytest.mark.gpu, id="compiled")]
)
@pytest.mark.parametrize("case", ["NaN", "+Inf", "1e30 (g**2 overflows)", "mixed"])
def test_moment_kernel_like_adamw(case, kernels):
    """The Pallas moment kernel (interpreted, and compiled on a Hopper GPU) follows the same
    rules as the reference."""
    rng = np.random.default_rng()
    positions = (np.array([0, 3]), np.array([9, 130]))
    values = np.resize(np.asarray(CASES[case], np.float32), 2)
    assert_like_adamw(run_both(gradients(rng, 1, positions, values), kernels=kernels))


SPECIAL = st.sampled_from(
    [np.nan, np.inf, -np.inf, 1e30, -1e30, 3e38, 1e-30, -1e-30, 0.0, 1e-40, -1e-45, 1e-38]
)


@given(
    seed=st.integers(0, 2**31 - 1),
    cells=st.lists(
        st.tuples(st.integers(0, SHAPE[0] - 1), st.integers(0, SHAPE[1] - 1), SPECIAL),
        min_size=1,
        max_size=8,
    ),
    step=st.integers(0, STEPS - 2),
)
def test_random_special_values_like_adamw(seed, cells, step):
    rows, cols, values = (np.array(c) for c in zip(*cells, strict=True))
    rng = np.random.default_rng(seed)
    assert_like_adamw(run_both(gradients(rng, step, (rows, cols), values)))


def _same_bits(a, b):
    """Bit-identical, except that any NaN matches any NaN (sign and payload may differ)."""
    a, b = np.asarray(a), np.asarray(b)
    nan_a, nan_b = np.isnan(a.astype(np.float32)), np.isnan(b.astype(np.float32))
    bits = lambda x: x.view(np.uint8).reshape(*x.shape, -1)[~nan_a]
    return a.dtype == b.dtype and np.array_equal(nan_a, nan_b) and np.array_equal(bits(a), bits(b))


@pytest.mark.parametrize("expanded", [True, False], ids=["expanded", "plain"])
def test_moment_kernel_math_does_not_lean_on_nan_propagating_max(expanded):
    """The per-tile math the moment kernels trace gives the same bits when ``max`` / ``min``
    drop NaN as Pallas Triton's lowering does (``tests/triton_semantics.py``): interpret mode
    on the CPU uses XLA's NaN-propagating ``max`` and cannot see the difference, the H200 did
    (a NaN second moment decoded as a finite one, 2026-12-04)."""
    rng = np.random.default_rng()
    e4m3, e5m2 = formats.get_format("e4m3"), formats.get_format("e5m2")
    shape = (8, 128)

    def stored(x, fmt):
        return quant.encode(jnp.asarray(x), fmt, expanded)

    m = rng.standard_normal(shape).astype(np.float32) * 1e-3
    v = rng.standard_normal(shape).astype(np.float32) ** 2 * 1e-6
    g = rng.standard_normal(shape).astype(np.float32)
    special = [np.nan, np.inf, -np.inf, 1e30, 3e38, 1e-40, 0.0]
    for x in (m, v, g):  # a few specials in random rows, some rows left clean
        cells = rng.choice(x.size, size=len(special), replace=False)
        x.reshape(-1)[cells] = special
    v = np.where(v < 0, -v, v)  # second moments are >= 0 (and NaN / +inf)
    coeffs = adam.coefficients(0.9, 0.999, 1e-8, 0.0, 3)

    def tile(g, m_state, v_state):
        return adam_step.moment_update(g, m_state, v_state, coeffs, mu_fmt=e4m3, nu_fmt=e5m2,
                                       expanded=expanded, math=adam_step.KernelMath())  # fmt: skip

    args = (jnp.asarray(g), stored(m, e4m3), stored(v, e5m2))
    xla, triton = jax.tree.leaves(tile(*args)), jax.tree.leaves(eval_like_triton(tile, *args))
    assert len(xla) == len(triton)
    for a, b in zip(xla, triton, strict=True):
        assert _same_bits(a, b), (np.asarray(a), np.asarray(b))
    # the NaN inputs reached the math (else the comparison above would prove nothing)
    u = np.asarray(xla[0])
    assert np.isnan(u).any()
