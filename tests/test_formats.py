import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from coat_jax.core.formats import E4M3, E5M2, get_format, saturating_cast


@pytest.mark.parametrize(
    ("fmt", "dtype", "fmax", "normal", "mbits"),
    [(E4M3, jnp.float8_e4m3fn, 448.0, 2.0**-6, 3), (E5M2, jnp.float8_e5m2, 57344.0, 2.0**-14, 2)],
)
def test_format_constants(fmt, dtype, fmax, normal, mbits):
    assert fmt.dtype == jnp.dtype(dtype)
    assert (fmt.max, fmt.smallest_normal, fmt.mantissa_bits) == (fmax, normal, mbits)
    assert fmt.expansion_target_range == fmax**2 / 2


@pytest.mark.parametrize("spec", ["e4m3", "E4M3", E4M3, jnp.float8_e4m3fn, ml_dtypes.float8_e4m3fn])
def test_get_format_accepts_names_descriptors_and_dtypes(spec):
    assert get_format(spec) is E4M3


@pytest.mark.parametrize("spec", ["e4m3fnuz", "fp8", jnp.float16, "", 3])
def test_get_format_rejects_unknown(spec):
    with pytest.raises(ValueError, match="unknown FP8 format"):
        get_format(spec)


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_saturating_cast_clips_instead_of_nan(fmt):
    x = jnp.array([fmt.max * 1.06, -fmt.max * 3, 1e30, -jnp.inf, jnp.nan], jnp.float32)
    y = np.asarray(saturating_cast(x, fmt).astype(jnp.float32))
    np.testing.assert_array_equal(y[:4], [fmt.max, -fmt.max, fmt.max, -fmt.max])
    assert np.isnan(y[4])


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_rounding_bound_holds_for_every_code(fmt):
    # Every representable value and the midpoints just inside their rounding intervals.
    codes = np.arange(256, dtype=np.uint8).view(fmt.dtype).astype(np.float32)
    codes = np.sort(np.unique(codes[np.isfinite(codes)]))
    mids = (codes[1:] + codes[:-1]) / 2
    probes = np.concatenate([codes, np.nextafter(mids, codes[1:]), np.nextafter(mids, codes[:-1])])
    probes = probes.astype(np.float32)
    rounded = np.asarray(saturating_cast(jnp.asarray(probes), fmt).astype(jnp.float32))
    bound = np.asarray(fmt.rounding_bound(jnp.asarray(probes)))
    assert np.all(np.abs(rounded - probes) <= bound)
