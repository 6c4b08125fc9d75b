"""Fused FP8 Adam moment kernel against the jnp reference (interpret on CPU, compiled on GPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coat_jax.core import adam
from coat_jax.core.quant import dequantize, quantize
from pallas_kernels import adam_step, dispatch

B1, B2, EPS, EPS_ROOT, STEP = 0.9, 0.95, 1e-8, 0.0, 7


def fresh_state(shape, expand, mu_fmt="e4m3", nu_fmt="e4m3", group=128):
    seed = int(np.random.default_rng().integers(1 << 30))
    print("fresh_state seed", seed)  # shown by pytest when a test fails
    key = jax.random.key(seed)
    k1, k2, k3 = jax.random.split(key, 3)
    g = jax.random.normal(k1, shape) * 1e-2
    m = jax.random.normal(k2, shape) * 1e-3
    v = jnp.exp(jax.random.normal(k3, shape)) * 1e-5
    m = m.at[..., :group].set(0.0)  # an all-zero group
    mu = quantize(m, mu_fmt, group_size=group, expand=expand)
    nu = quantize(v, nu_fmt, group_size=group, expand=expand)
    return g, mu, nu


def reference(g, mu, nu):
    bc1, bc2 = 1 - B1**STEP, 1 - B2**STEP
    m = (1 - B1) * g + B1 * dequantize(mu)
    v = (1 - B2) * (g * g) + B2 * dequantize(nu)
    u = (m / bc1) / (jnp.sqrt(v / bc2 + EPS_ROOT) + EPS)
    group = mu.data.shape[-1]
    new = lambda x, q: quantize(x, q.fmt, group_size=group, expand=q.expanded)
    return u, new(m, mu), new(v, nu)


def modes():
    """Interpret mode everywhere, compiled too on a Hopper GPU (ids interpret / compiled)."""
    compiled = [pytest.param(False, id="compiled")] if dispatch.hopper_gpu() else []
    return [pytest.param(True, id="interpret"), *compiled]


@pytest.mark.parametrize("interpret", modes())
@pytest.mark.parametrize("expand", [True, False])
@pytest.mark.parametrize("shape", [(16, 1024), (3, 4, 256), (5, 384)])
@pytest.mark.parametrize(("mu_fmt", "nu_fmt"), [("e4m3", "e4m3"), ("e4m3", "e5m2")])
def test_kernel_matches_reference(shape, expand, mu_fmt, nu_fmt, interpret):
    g, mu, nu = fresh_state(shape, expand, mu_fmt, nu_fmt)
    assert adam_step.supported(mu, nu)
    coeffs = adam.coefficients(B1, B2, EPS, EPS_ROOT, STEP)
    u, new_mu, new_nu = adam_step.fp8_adam_moments(g, mu, nu, coeffs, interpret=interpret)
    u_ref, mu_ref, nu_ref = reference(g, mu, nu)
    np.testing.assert_allclose(u, u_ref, rtol=1e-4, atol=1e-6)
    for got, want in ((new_mu, mu_ref), (new_nu, nu_ref)):
        assert jax.tree.structure(got) == jax.tree.structure(want)
        np.testing.assert_allclose(got.amax, want.amax, rtol=1e-6)
        # The two paths round fp32 transcendentals differently (the kernel may take lg2.approx),
        # so a moment may differ in its last bits before it is encoded. k depends on the
        # group's smallest nonzero |m|, which can come from a near-cancellation in
        # b1 m + (1 - b1) g, where a last-bit difference is a large relative one: k may land one
        # 1/16 step away in a few groups. Where k agrees, a code may sit on the other side of a
        # rounding boundary: rarely, and then only its neighbour; every other code is equal and
        # decodes to the same value.
        same_k = np.ones(got.amax.shape, bool)
        if expand:
            k_got, k_want = np.asarray(got.k, int), np.asarray(want.k, int)
            assert np.abs(k_got - k_want).max() <= 1 and (k_got != k_want).mean() < 0.1
            same_k = k_got == k_want
        same_k = np.broadcast_to(same_k[..., None], got.data.shape)
        steps = np.abs(code_index(got.data) - code_index(want.data))[same_k]
        assert steps.max() <= 1 and np.mean(steps > 0) < 1e-3, (steps.max(), np.mean(steps > 0))
        equal = same_k & (code_index(got.data) == code_index(want.data))
        got_x, want_x = (np.asarray(dequantize(q)).reshape(q.data.shape) for q in (got, want))
        np.testing.assert_allclose(got_x[equal], want_x[equal], rtol=1e-6)


def code_index(codes) -> np.ndarray:
    """FP8 codes as signed integers ordered like their values (neighbours differ by 1)."""
    bits = np.asarray(jax.lax.bitcast_convert_type(codes, jnp.uint8)).astype(np.int32)
    magnitude = bits & 0x7F
    return np.where(bits & 0x80, -magnitude, magnitude)


def test_unsupported_layouts_are_reported():
    g, mu, nu = fresh_state((4, 130), True, group=128)  # balanced groups of 65
    assert not adam_step.supported(mu, nu)
    with pytest.raises(ValueError, match="unsupported layout"):
        adam_step.fp8_adam_moments(g, mu, nu, adam.coefficients(B1, B2, EPS, 0, 1), interpret=True)
    assert not adam_step.supported(jnp.zeros((4, 128)), nu)
