"""Pallas quantize kernels against the jnp reference: interpret mode on CPU, compiled on GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coat_jax.core.formats import get_format
from coat_jax.core.quant import dequantize, quantize
from pallas_kernels import dispatch
from pallas_kernels import quantize as kq

SHAPES = [(64, 512), (3, 5, 256), (1, 48), (96, 4096), (7, 160)]


def fresh(shape, dtype=jnp.float32, spread=2.0):
    key = jax.random.key(np.random.default_rng().integers(1 << 30))
    k1, k2 = jax.random.split(key)
    x = jax.random.normal(k1, shape) * jnp.exp(spread * jax.random.normal(k2, shape))
    return x.at[..., :3].set(0.0).astype(dtype)  # include exact zeros and an all-zero group


def assert_same_codes(got, want):
    assert got.data.shape == want.data.shape and got.data.dtype == want.data.dtype
    bits = lambda a: np.asarray(a).view(np.uint8)
    np.testing.assert_array_equal(bits(got.data), bits(want.data))
    np.testing.assert_array_equal(np.asarray(got.amax), np.asarray(want.amax))


def run_modes():
    """Interpret mode everywhere, compiled too on a Hopper GPU (ids interpret / compiled)."""
    compiled = [pytest.param(False, id="compiled")] if dispatch.hopper_gpu() else []
    return [pytest.param(True, id="interpret"), *compiled]


@pytest.mark.parametrize("interpret", run_modes())
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("fmt", "group"), [("e4m3", 16), ("e4m3", 128), ("e5m2", 16)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_per_group_codes_equal_reference(shape, fmt, group, dtype, interpret):
    x = fresh(shape, dtype)
    got = kq.quantize_per_group(x, fmt, group, interpret=interpret)
    want = quantize(x, fmt, group_size=group)
    assert_same_codes(got, want)
    back = kq.dequantize_per_group(got, interpret=interpret)
    np.testing.assert_allclose(back, dequantize(want), rtol=1e-6, atol=0)


@pytest.mark.parametrize("interpret", run_modes())
@pytest.mark.parametrize("shape", [(64, 512), (2, 16, 256), (5, 160)])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_per_tensor_two_stage_equals_reference(shape, fmt, interpret):
    x = fresh(shape)
    assert_same_codes(kq.quantize_per_tensor(x, fmt, interpret=interpret), quantize(x, fmt))


def test_block_choice_and_fallbacks():
    tuning = kq.QuantizeTuning(block_rows=32, block_cols=512)
    assert kq._blocks(96, 4096, 16, tuning) == (32, 512)
    assert kq._blocks(7, 160, 16, tuning) == (1, 32)
    assert kq._blocks(8, 130, 16, tuning) is None  # ragged last axis
    assert kq._blocks(8, 96, 24, tuning) is None  # group not a power of two
    x = fresh((4, 130))
    got = kq.quantize_per_group(x, "e4m3", 16, interpret=True)
    assert_same_codes(got, quantize(x, "e4m3", group_size=16))


def test_nan_is_never_hidden():
    x = fresh((32, 512)).at[5, 7].set(jnp.nan)
    q = kq.quantize_per_group(x, "e4m3", 16, interpret=True)
    assert np.isnan(np.asarray(kq.dequantize_per_group(q, interpret=True))[5, :16]).any()


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        (dict(group_size=0), ValueError),
        (dict(group_size=2.0), ValueError),
        (dict(fmt="x"), ValueError),
    ],
)
def test_bad_input(kwargs, error):
    with pytest.raises(error):
        kq.quantize_per_group(jnp.ones((4, 32)), **{"fmt": "e4m3", "group_size": 16, **kwargs})
    with pytest.raises(TypeError):
        kq.quantize_per_group(jnp.ones((4, 32), jnp.int32), "e4m3", 16)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the CPU message")
@pytest.mark.skipif(dispatch.hopper_gpu(), reason="compiled mode runs on this machine")
def test_compiled_mode_off_gpu_says_how_to_run():
    with pytest.raises(ValueError, match="interpret=True"):
        kq.quantize_per_group(jnp.ones((4, 32)), "e4m3", 16)


@pytest.mark.parametrize("interpret", run_modes())
@pytest.mark.parametrize("shape", [(64, 512), (96, 160), (7, 160), (5, 130)])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_transpose_quantize_equals_quantize_then_transpose(shape, fmt, dtype, interpret):
    x = fresh(shape, dtype)
    # an amax below max|x| (as from an earlier step's statistics) exercises saturation too
    amax = jnp.max(jnp.abs(x.astype(jnp.float32))) * 0.5
    q, q_t = kq.quantize_transpose_per_tensor(x, amax, fmt, interpret=interpret)
    want = quantize(x, fmt, amax=amax)
    assert_same_codes(q, want)
    assert_same_codes(q_t, type(want)(want.data.T, want.amax))
    assert np.abs(np.asarray(q.data.astype(jnp.float32))).max() == get_format(fmt).max


@pytest.mark.parametrize("interpret", run_modes())
@pytest.mark.parametrize("transpose_codes", [False, True])
def test_transpose_quantize_tiles_in_both_layouts(transpose_codes, interpret):
    tuning = kq.QuantizeTuning(block_rows=16, block_cols=32, transpose_codes=transpose_codes)
    x = fresh((64, 128))
    q, q_t = kq.quantize_transpose_per_tensor(x, 3.0, tuning=tuning, interpret=interpret)
    want = quantize(x, "e4m3", amax=jnp.float32(3.0)).data
    bits = lambda a: np.asarray(a).view(np.uint8)
    np.testing.assert_array_equal(bits(q.data), bits(want))
    np.testing.assert_array_equal(bits(q_t.data), bits(want).T)
    with pytest.raises(ValueError, match="2-D float"):
        kq.quantize_transpose_per_tensor(jnp.ones((2, 3, 4)), 1.0, interpret=True)


@pytest.mark.parametrize("transpose_codes", [False, True])
def test_transpose_quantize_lowers_to_triton_for_cuda(transpose_codes):
    """Without a GPU: the in-tile transpose (of the input tile or of its codes) lowers to
    Triton IR."""
    x = jnp.ones((64, 256), jnp.bfloat16)
    tuning = kq.QuantizeTuning(transpose_codes=transpose_codes)
    traced = kq._transpose_call.trace(x, jnp.ones((1, 1)), get_format("e4m3"), 32, 128, tuning,
                                      False)  # fmt: skip
    assert "__gpu$xla.gpu.triton" in traced.lower(lowering_platforms=("cuda",)).as_text()
