"""Mosaic GPU per-group quantize (pallas_kernels/quantize_mgpu.py).

On the CPU: the kernel lowers for CUDA (Mosaic GPU's Python lowering runs here, so layout and
API misuse shows up), the block plan and its fallbacks, the wrapper's reshapes (with the kernel
call replaced by its math in jnp) and the error paths. On a Hopper GPU (``-m gpu``, names
contain "compiled"): codes and ``amax`` bitwise equal to ``coat_jax.quantize``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coat_jax.core.formats import get_format
from coat_jax.core.quant import dequantize, quantize
from pallas_kernels import dispatch
from pallas_kernels import quantize_mgpu as km

CASES = [(fmt, g) for fmt in ("e4m3", "e5m2") for g in (16, 128)]


def fresh(shape, dtype=jnp.float32, spread=2.0):
    key = jax.random.key(np.random.default_rng().integers(1 << 30))
    k1, k2 = jax.random.split(key)
    x = jax.random.normal(k1, shape) * jnp.exp(spread * jax.random.normal(k2, shape))
    return x.at[..., :3].set(0.0).astype(dtype)  # exact zeros; an all-zero group when g <= 3


def assert_same_codes(got, want):
    assert got.data.shape == want.data.shape and got.data.dtype == want.data.dtype
    assert got.amax.shape == want.amax.shape and got.last_dim == want.last_dim
    bits = lambda a: np.asarray(a).view(np.uint8)
    np.testing.assert_array_equal(bits(got.data), bits(want.data))
    np.testing.assert_array_equal(np.asarray(got.amax), np.asarray(want.amax))


# ---------------------------------------------------------------------------------------------
# CPU


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(("fmt", "group"), CASES)
def test_kernel_lowers_for_cuda(fmt, group, dtype):
    """Traces and lowers the kernel for CUDA without a GPU (default and a small tuning)."""
    n_rows = 512 * 1024 // group
    x = jax.ShapeDtypeStruct((512, 1024), dtype)
    for tuning in (km.MgpuQuantizeTuning(), km.MgpuQuantizeTuning(64, max_concurrent_steps=2)):
        br, n_ctas = km.block_plan(n_rows, group, dtype, tuning, num_sms=132)

        def fn(x, br=br, n_ctas=n_ctas, depth=tuning.max_concurrent_steps):
            return km._quantize_call(x, get_format(fmt), group, br, depth, n_ctas)

        text = jax.jit(fn).trace(x).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text


def test_candidate_tunings_lower_for_cuda():
    x = jax.ShapeDtypeStruct((8192, 128), jnp.float32)
    for tuning in km.mgpu_tuning_candidates():
        br, n_ctas = km.block_plan(8192, 128, jnp.float32, tuning, num_sms=132)
        fn = lambda x, br=br, n=n_ctas, d=tuning.max_concurrent_steps: km._quantize_call(
            x, get_format("e4m3"), 128, br, d, n
        )
        jax.jit(fn).trace(x).lower(lowering_platforms=("cuda",))


def test_block_plan():
    t = km.MgpuQuantizeTuning()
    assert km.block_plan(8192 * 8192 // 16, 16, jnp.float32, t, 132) == (256, 256)
    assert km.block_plan(8192 * 8192 // 128, 128, jnp.float32, t, 132) == (64, 256)
    assert km.block_plan(192, 16, jnp.float32, t, 132) == (64, 3)  # halved to divide
    assert km.block_plan(4096, 16, jnp.float32, t, 1) == (256, 2)  # CTAs divide the blocks
    assert km.block_plan(96, 16, jnp.float32, t, 132) is None  # no block of >= 64 rows
    assert km.block_plan(640, 24, jnp.float32, t, 132) is None  # group not a multiple of 16
    assert km.block_plan(640, 512, jnp.float32, t, 132) is None  # group too wide
    with pytest.raises(ValueError, match="multiple of 64"):
        km.block_plan(640, 16, jnp.float32, km.MgpuQuantizeTuning(block_rows=96), 132)
    with pytest.raises(ValueError, match="at most 256"):
        km.block_plan(1024, 16, jnp.float32, km.MgpuQuantizeTuning(block_rows=512), 132)
    with pytest.raises(ValueError, match="shared memory"):
        km.block_plan(1024, 256, jnp.float32, km.MgpuQuantizeTuning(256, 0, 8), 132)


def _kernel_math(x, fmt, group, br, depth, n_ctas):
    """The kernel call's math in jnp on the (n_rows, group) view (stands in on the CPU)."""
    lead, n_groups = x.shape[:-1], x.shape[-1] // group
    x2 = x.reshape(-1, group).astype(jnp.float32)
    assert x2.shape[0] % (br * n_ctas) == 0
    amax = jnp.max(jnp.abs(x2), axis=1)
    factor = fmt.max / jnp.where(amax > 0, amax, 1.0)
    scaled = x2 * jax.lax.broadcast_in_dim(factor, x2.shape, (0,))
    codes = jnp.clip(scaled, -fmt.max, fmt.max).astype(fmt.dtype)
    return codes.reshape(*lead, n_groups, group), amax.reshape(*lead, n_groups)


@pytest.mark.parametrize("shape", [(64, 512), (3, 8, 256), (7, 160), (4, 130), (1, 48)])
@pytest.mark.parametrize(("fmt", "group"), CASES)
def test_wrapper_layout_and_fallback(monkeypatch, shape, fmt, group):
    """With the compile check passed and the kernel call replaced by its math: the wrapper's
    view, reshapes and fallback give exactly the reference's QuantizedArray."""
    calls = []
    monkeypatch.setattr(dispatch, "hopper_gpu", lambda *_: True)
    monkeypatch.setattr(km, "_quantize_call", lambda *a: calls.append(a[2:]) or _kernel_math(*a))
    x = fresh(shape)
    got = km.quantize_per_group_mgpu(x, fmt, group)
    assert_same_codes(got, quantize(x, fmt, group_size=group))
    takes = shape[-1] % group == 0 and (x.size // group) % 64 == 0
    assert bool(calls) == takes


@pytest.mark.skipif(dispatch.hopper_gpu(), reason="compiled mode runs on this machine")
def test_off_hopper_raises_value_error():
    with pytest.raises(ValueError, match="Hopper GPU"):
        km.quantize_per_group_mgpu(jnp.ones((64, 256)), "e4m3", 16)
    with pytest.raises(ValueError, match="Hopper GPU"):  # even for a shape that falls back
        km.quantize_per_group_mgpu(jnp.ones((4, 130)), "e4m3", 16)


@pytest.mark.parametrize(
    ("x", "kwargs", "error"),
    [
        (jnp.ones((64, 256)), dict(group_size=0), ValueError),
        (jnp.ones((64, 256)), dict(group_size=16.0), ValueError),
        (jnp.ones((64, 256)), dict(group_size=True), ValueError),
        (jnp.ones((64, 256)), dict(fmt="x"), ValueError),
        (jnp.ones(()), {}, ValueError),
        (jnp.ones((64, 256), jnp.int32), {}, TypeError),
    ],
)
def test_bad_input(x, kwargs, error):
    with pytest.raises(error):
        km.quantize_per_group_mgpu(x, **{"fmt": "e4m3", "group_size": 16, **kwargs})


# ---------------------------------------------------------------------------------------------
# GPU: compiled kernel against the reference, bitwise

GPU_SHAPES = [
    (8192, 8192),  # bench size
    (4096, 11008),  # Llama-2-7B MLP activations
    (2, 512, 4096),  # leading axes
    (64, 1024),  # fewer blocks than SMs
    (96, 160),  # rows that need the block halved (or fall back at g = 128)
    (7, 160),  # falls back: 70 / 8.75 groups
    (4, 130),  # falls back: ragged last axis
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize(("fmt", "group"), CASES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_compiled_mgpu_codes_equal_reference(shape, fmt, group, dtype):
    x = fresh(shape, dtype)
    got = km.quantize_per_group_mgpu(x, fmt, group)
    assert_same_codes(got, quantize(x, fmt, group_size=group))


@pytest.mark.gpu
@pytest.mark.parametrize("tuning", km.mgpu_tuning_candidates())
def test_compiled_mgpu_every_tuning(tuning):
    x = fresh((1024, 4096))
    for group in (16, 128):
        got = km.quantize_per_group_mgpu(x, "e4m3", group, tuning=tuning)
        assert_same_codes(got, quantize(x, "e4m3", group_size=group))


@pytest.mark.gpu
def test_compiled_mgpu_nan_is_never_hidden():
    x = fresh((256, 1024)).at[5, 7].set(jnp.nan)
    q = km.quantize_per_group_mgpu(x, "e4m3", 16)
    assert np.isnan(np.asarray(dequantize(q))[5, :16]).any()
