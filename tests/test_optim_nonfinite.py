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

import coat_jax
from coat_jax.core import adam, quant

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
