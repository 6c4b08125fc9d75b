"""pallas_kernels.fast_math: log and exp2 without MUFU ops, against float64 numpy over fp32's
range (jitted, where XLA's simplifier may rewrite the bit tricks, and eagerly)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from pallas_kernels import fast_math

MODES = {"jit": lambda f: jax.jit(f), "eager": lambda f: f}
TINY = float(np.finfo(np.float32).tiny)


def log_bound(x: np.ndarray) -> np.ndarray:
    """Absolute error allowed for ``ln x``: the polynomial's 7e-8 plus fp32's rounding of the
    sum (at most an ulp of the result, 2^-23 of it; ~8e-6 near 88)."""
    return 1e-7 + 2.0**-23 * np.abs(np.log(x.astype(np.float64)))


@pytest.mark.parametrize("mode", MODES)
def test_log_over_every_binade(mode):
    """Random bit patterns of every positive normal fp32 (and the FP8 values' exact powers of
    two and mantissas, what the kernels' decoders feed it)."""
    rng = np.random.default_rng()
    bits = rng.integers(0x00800000, 0x7F800000, 1 << 20, dtype=np.int64).astype(np.uint32)
    fp8 = np.arange(1, 0x7F, dtype=np.uint8).view(jnp.float8_e4m3fn).astype(np.float32)
    x = np.concatenate([bits.view(np.float32), fp8, [TINY, 1.0, 2.0, 0.5, 448.0]])
    got = np.asarray(MODES[mode](fast_math.log)(x), np.float64)
    err = np.abs(got - np.log(x.astype(np.float64)))
    assert np.all(err <= log_bound(x)), (x[np.argmax(err / log_bound(x))], err.max())
    assert got[-4] == 0.0  # log 1 is exact: a group's amax encodes to exactly the format's max


@pytest.mark.parametrize("mode", MODES)
def test_exp2_over_the_normal_range(mode):
    rng = np.random.default_rng()
    t = np.concatenate([rng.uniform(-126, 127, 1 << 20), np.arange(-126, 127.5, 0.5)])
    t = t.astype(np.float32)
    got = np.asarray(MODES[mode](fast_math.exp2)(t), np.float64)
    rel = np.abs(got / np.exp2(t.astype(np.float64)) - 1)
    assert rel.max() < 2e-7, t[np.argmax(rel)]
    integers = np.arange(-126, 128)
    got = MODES[mode](fast_math.exp2)(integers.astype(np.float32))
    np.testing.assert_array_equal(got, np.ldexp(np.float32(1), integers))  # exact powers of two


@pytest.mark.parametrize("mode", MODES)
def test_special_values(mode):
    log, exp2 = MODES[mode](fast_math.log), MODES[mode](fast_math.exp2)
    got = np.asarray(log(jnp.array([0.0, np.inf, np.nan], jnp.float32)))
    assert got[0] == -np.inf and got[1] == np.inf and np.isnan(got[2])
    got = np.asarray(exp2(jnp.array([-np.inf, -126.5, -1e30, 127.5, np.inf, np.nan], jnp.float32)))
    np.testing.assert_array_equal(got[:5], [0.0, 0.0, 0.0, np.inf, np.inf])
    assert np.isnan(got[5])


@given(st.floats(min_value=TINY, max_value=float(np.finfo(np.float32).max), width=32))
@example(TINY)
@example(float(np.nextafter(np.float32(np.sqrt(2.0)), np.float32(0))))
def test_log_property(x):
    x = np.float32(x)
    got = float(fast_math.log(x))
    assert abs(got - np.log(np.float64(x))) <= log_bound(np.array(x))


@given(st.floats(min_value=-126, max_value=127, width=32))
@example(-126.0)
@example(-125.5)
@example(126.5)
def test_exp2_property(t):
    got = float(fast_math.exp2(np.float32(t)))
    assert abs(got / np.exp2(np.float64(np.float32(t))) - 1) < 2e-7


def test_round_trip_through_both():
    """``exp2(log(x) / ln 2)`` returns ``x`` to a few ulps, as the expansion's decode of its
    encode needs."""
    rng = np.random.default_rng()
    x = np.exp(rng.uniform(-80, 80, 1 << 16)).astype(np.float32)
    back = jax.jit(lambda v: fast_math.exp2(fast_math.log(v) * np.float32(1 / np.log(2))))(x)
    np.testing.assert_allclose(back, x, rtol=2e-5)
