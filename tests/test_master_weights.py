"""BF16 master weights with a remainder: the split is exact, training is bit-identical to fp32
master weights (16 bits), and the 8-bit residual stays close."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tiny
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny import tiny_run

import coat_jax
from coat_jax.core import master
from coat_jax.ops import master_weights as master_weights_module
from coat_jax.ops.master_weights import master_weights, to_bf16_parts
from coat_jax.training import configs, parallel
from coat_jax.training.run import assemble
from pallas_kernels import dispatch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def bits_of(x):
    return np.asarray(x, np.float32).view(np.uint32)


@settings(max_examples=30)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64))
def test_split_join_is_exact_for_every_bit_pattern(patterns):
    """All 2^32 patterns (NaN payloads, infinities, denormals, -0) come back bit for bit."""
    w = jnp.asarray(np.asarray(patterns, np.uint32).view(np.float32))
    hi, remainder = master.split(w)
    assert hi.dtype == jnp.bfloat16 and remainder.dtype == jnp.int16
    np.testing.assert_array_equal(bits_of(master.join(hi, remainder)), bits_of(w))


def numpy_split(w):
    """:func:`master.split` (16 bits) in numpy integer arithmetic: the reference."""
    b = np.asarray(w, np.float32).view(np.uint32).astype(np.int64)
    high = ((b + (1 << 15)) >> 16) & 0xFFFF
    r = ((b - (high << 16)) + (1 << 15)) % (1 << 32) - (1 << 15)
    return high.astype(np.uint16), r.astype(np.int16)


@pytest.mark.parametrize("how", ["times", "plus_joined"])
def test_split_of_a_computed_weight_keeps_its_remainder(how):
    """A split fused with the arithmetic that makes its input (as every optimizer step's is):
    parts equal numpy's integer reference. Without the barrier in ``split`` an H200 returned
    zero remainders here (jax 0.11.2, 2026-12-02); on the CPU both ways pass."""
    w = jax.random.normal(jax.random.key(int(np.random.default_rng().integers(1 << 30))),
                          (512, 512)) * 0.02  # fmt: skip
    if how == "times":
        got = jax.jit(lambda w: master.split(w * 1.0001))(w)
        want = np.asarray(w) * np.float32(1.0001)
    else:
        hi, r = master.split(w)
        got = jax.jit(lambda h, r: master.split(master.join(h, r) + 0.001))(hi, r)
        want = np.asarray(w) + np.float32(0.001)
    want_hi, want_r = numpy_split(want)
    np.testing.assert_array_equal(np.asarray(got[0]).view(np.uint16), want_hi)
    np.testing.assert_array_equal(np.asarray(got[1]), want_r)
    assert np.mean(want_r == 0) < 0.01  # the remainders carry information


def test_bf16_part_is_round_to_nearest_ties_away():
    """The BF16 part is the nearest BF16 value (``astype``'s but on exact ties, which go away
    from zero): checked on random finite floats and on ties built bit by bit."""
    w = jax.random.normal(jax.random.key(0), (100_000,)) * jnp.exp(
        jax.random.normal(jax.random.key(1), (100_000,)) * 10
    )
    np.testing.assert_array_equal(master.bf16_part(w), w.astype(jnp.bfloat16))
    ties = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000], np.uint32).view(np.float32)
    want = np.array([0x3F81, 0x3F82, 0xBF81, 0xBF82], np.uint16)  # magnitude rounded up
    got = np.asarray(master.bf16_part(jnp.asarray(ties))).view(np.uint16)
    np.testing.assert_array_equal(got, want)


def test_eight_bit_residual_within_two_to_the_minus_15():
    w = jax.random.normal(jax.random.key(2), (200_000,)) * 0.02
    back = master.join(*master.split(w, 8))
    assert float(jnp.max(jnp.abs(back - w) / jnp.abs(w))) < 2.0**-15


def test_bad_bits_and_remainders():
    with pytest.raises(ValueError, match="remainder bits"):
        master.split(jnp.ones(3), 12)
    with pytest.raises(ValueError, match="remainder bits"):
        master_weights(optax.sgd(0.1), bits=4)
    with pytest.raises(TypeError, match="int16 or int8"):
        master.join(jnp.ones(3, jnp.bfloat16), jnp.ones(3, jnp.int32))


def test_as_an_optax_optimizer_it_tracks_fp32_master_weights():
    """``optax.apply_updates`` of its updates lands on the BF16 parts of the fp32 weights a
    plain fp32 AdamW reaches from the same BF16 views' gradients, upcast (50 steps)."""
    k = jax.random.split(jax.random.key(3), 3)
    params = {"w": jax.random.normal(k[0], (64, 32)) * 0.1, "b": jnp.zeros(32)}
    target = jax.random.normal(k[1], (16, 32))
    x = jax.random.normal(k[2], (16, 64))
    loss = lambda p: jnp.mean((x @ p["w"] + p["b"] - target) ** 2)
    inner = optax.adamw(1e-2, weight_decay=0.1)
    opt = master_weights(inner, bits=16)
    state, ref_state = opt.init(params), inner.init(params)
    ref, bf16 = params, to_bf16_parts(params)
    for _ in range(50):
        updates, state = opt.update(jax.grad(loss)(bf16), state, bf16)
        bf16 = optax.apply_updates(bf16, updates)
        ref_grads = jax.grad(loss)(to_bf16_parts(ref))
        ref_grads = jax.tree.map(lambda g: g.astype(jnp.float32), ref_grads)
        ref_updates, ref_state = inner.update(ref_grads, ref_state, ref)
        ref = optax.apply_updates(ref, ref_updates)
    for a, b, r in zip(jax.tree.leaves(bf16), jax.tree.leaves(to_bf16_parts(ref)),
                       jax.tree.leaves(state.remainder), strict=True):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        assert r.dtype == jnp.int16
    joined = jax.tree.map(master.join, bf16, state.remainder)
    for a, b in zip(jax.tree.leaves(joined), jax.tree.leaves(ref), strict=True):
        np.testing.assert_array_equal(bits_of(a), bits_of(b))


def train(overrides, steps):
    run = tiny_run(**overrides)
    params, opt_state, metrics = tiny.train(run, steps)
    return (run, np.asarray([m["loss"] for m in metrics])), params, opt_state


@pytest.mark.parametrize("optimizer,steps", [("fp8_adamw", 100), ("adamw", 30)])
def test_bf16_plus_16_bit_remainder_trains_bit_identically_to_fp32_master(optimizer, steps):
    """The trainer's step on llama_tiny (COAT, bf16 gradients), 100 steps (adamw: 30): the
    BF16 + 16-bit remainder run's weights, rebuilt, equal the fp32-master run's bit for bit;
    its parameters are the BF16 parts, 2 bytes each."""
    common = {"grad_dtype": "bfloat16", "optimizer.name": optimizer, "optimizer.warmup_steps": 5}
    _, p32, _ = train(common, steps)
    _, hi, state = train({**common, "optimizer.master_weights": "bf16+16"}, steps)
    assert {x.dtype for x in jax.tree.leaves(hi)} == {jnp.dtype(jnp.bfloat16)}
    rebuilt = jax.tree.map(master.join, hi, state.remainder)
    for a, b in zip(jax.tree.leaves(rebuilt), jax.tree.leaves(p32), strict=True):
        np.testing.assert_array_equal(bits_of(a), bits_of(b))


@pytest.mark.xla_cpu
def test_fused_update_with_master_weights_is_bit_identical_to_fp32_master():
    """The fused FP8 AdamW kernel (interpreted) runs between the rebuild and the split: 3 steps
    equal the fused kernel's on fp32 master weights bit for bit."""
    common = {"grad_dtype": "bfloat16", "optimizer.kernels": "interpret",
              "optimizer.warmup_steps": 1}  # fmt: skip
    (run, _), p32, _ = train(common, 3)
    assert run.fused_update
    _, hi, state = train({**common, "optimizer.master_weights": "bf16+16"}, 3)
    rebuilt = jax.tree.map(master.join, hi, state.remainder)
    for a, b in zip(jax.tree.leaves(rebuilt), jax.tree.leaves(p32), strict=True):
        np.testing.assert_array_equal(bits_of(a), bits_of(b))


@pytest.mark.parametrize("kernels", ["interpret"] + (["pallas"] if dispatch.hopper_gpu() else []))
@pytest.mark.parametrize("bits", [16, 8])
def test_the_fused_kernel_reads_and_writes_the_parts(bits, kernels, monkeypatch):
    """``fused_fp8_adamw_update(..., remainder=)``: the kernel on the parts (interpreted; on a
    Hopper GPU also compiled) equals, bit for bit, the fp32 weights rebuilt, updated by the
    fp32 path and split again (what ``"auto"`` does where the parts kernel is off: the
    reference for the interpreted kernel, the compiled fp32 kernel for the compiled one) -
    matrices and the small parameters the reference takes alike."""
    monkeypatch.setitem(dispatch.AUTO_USES_KERNEL, "adam_update_parts", False)
    if kernels == "interpret":  # against the reference everywhere (the GPU's kernel: approx math)
        monkeypatch.setitem(dispatch.AUTO_USES_KERNEL, "adam_update", False)
    k = jax.random.split(jax.random.key(4), 4)
    weights = {"w": jax.random.normal(k[0], (64, 256)) * 0.02, "b": jnp.ones(256)}
    grads = {"w": jax.random.normal(k[1], (64, 256)).astype(jnp.bfloat16) * 1e-3,
             "b": jax.random.normal(k[2], (256,)).astype(jnp.bfloat16) * 1e-3}  # fmt: skip
    state = coat_jax.scale_by_fp8_adam(min_size=1024, group_size=128).init(weights)
    parts = {n: master.split(w, bits) for n, w in weights.items()}
    hi, rem = ({n: p[i] for n, p in parts.items()} for i in (0, 1))

    def update(kernels):
        return jax.jit(lambda h, r, g, s: coat_jax.fused_fp8_adamw_update(
            h, g, s, 1e-3, weight_decay=0.1, clip_scale=0.7, kernels=kernels, remainder=r)
        )(hi, rem, grads, state)  # fmt: skip

    got, want = update(kernels), update("auto")
    assert got[1]["w"].dtype == (jnp.int16 if bits == 16 else jnp.int8)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        bytes_of = lambda x: np.asarray(x).reshape(-1).view(np.uint8)
        np.testing.assert_array_equal(bytes_of(a), bytes_of(b))


def test_eight_bit_residual_trains_close_to_fp32_master():
    """bf16+8 on llama_tiny, 100 steps: the mean loss of the last 20 steps within 0.5% of fp32
    master weights' (the weights themselves drift apart as any two runs' do: Adam turns ulp
    differences into lr-sized steps)."""
    common = {"grad_dtype": "bfloat16", "optimizer.warmup_steps": 5}
    (_, ref), _, _ = train(common, 100)
    (_, run), _, state = train({**common, "optimizer.master_weights": "bf16+8"}, 100)
    assert {x.dtype for x in jax.tree.leaves(state.remainder)} == {jnp.dtype(jnp.int8)}
    last = lambda losses: float(np.mean(losses[-20:]))
    assert abs(last(run) / last(ref) - 1) < 5e-3, (last(run), last(ref))


@pytest.mark.parametrize(
    "overrides,match",
    [({"optimizer.master_weights": "bf16"}, "master_weights='bf16'"),
     ({"optimizer.master_weights": "bf16+16", "grad_dtype": "float32"},
      "set config.grad_dtype=bfloat16")],
)  # fmt: skip
def test_bad_master_weight_configs(overrides, match):
    config = configs.load_file(str(ROOT / "configs" / "llama_tiny.py"), overrides)
    with pytest.raises(ValueError, match=match):
        configs.validate(config)


@pytest.mark.parametrize(
    "overrides,want",
    [({}, "bfloat16" if dispatch.hopper_gpu() else "float32"),  # the fused update: Hopper only
     ({"optimizer.master_weights": "bf16+8"}, "bfloat16"),
     ({"optimizer.kernels": "interpret"}, "bfloat16"),  # the fused update runs
     ({"optimizer.kernels": "interpret", "grad_accum": 2, "batch_size": 4}, "float32"),
     ({"optimizer.kernels": "interpret", "optimizer.name": "adamw"}, "float32"),
     ({"optimizer.kernels": "interpret", "grad_dtype": "float32"}, "float32")],
)  # fmt: skip
def test_auto_gradients_are_bf16_where_the_fused_update_runs(overrides, want):
    """``grad_dtype=auto`` (the default): bf16 with BF16 master weights or where the fused
    update takes one micro-batch's gradients, fp32 elsewhere; an explicit value stays."""
    config = configs.load_file(str(ROOT / "configs" / "llama_tiny.py"), overrides)
    configs.validate(config)
    run = assemble(config)
    assert run.grad_dtype == want


def test_repack_keeps_values_and_frees_the_old_buffers_unless_the_host_is_short(monkeypatch):
    """``parallel.repack`` (run after the split): same values and dtypes in new buffers, the
    old ones deleted; with less host memory available than the arrays it warns and keeps them."""
    tree = {"w": jax.random.normal(jax.random.key(0), (64, 32)).astype(jnp.bfloat16),
            "r": jnp.arange(2048, dtype=jnp.int16).reshape(64, 32), "n": 3}  # fmt: skip
    want = jax.device_get(tree)
    old = jax.tree.leaves(tree)
    monkeypatch.setattr(parallel, "_available_host_bytes", lambda: 1000)
    with pytest.warns(UserWarning, match="repack skipped"):
        assert parallel.repack(tree) is tree
    monkeypatch.setattr(parallel, "_available_host_bytes", lambda: None)
    packed = parallel.repack(tree)
    assert all(x.is_deleted() for x in old if isinstance(x, jax.Array)) and packed["n"] == 3
    for key in ("w", "r"):
        assert packed[key].dtype == want[key].dtype
        np.testing.assert_array_equal(np.asarray(packed[key]), want[key])


def live_bytes():
    return sum(x.nbytes for x in jax.live_arrays())


def spy_live_bytes_before_each_split(monkeypatch) -> list:
    """The devices' live bytes recorded before each leaf's split (``split_leaf_by_leaf``)."""
    seen = []
    real = master_weights_module._split_leaf
    monkeypatch.setattr(master_weights_module, "_split_leaf",
                        lambda w, b: (seen.append(live_bytes()), real(w, b))[1])  # fmt: skip
    return seen


@pytest.mark.xla_cpu  # live bytes as XLA:CPU's client counts them
@pytest.mark.parametrize("bits", [16, 8])
def test_split_leaf_by_leaf_frees_each_fp32_array_once_split(bits, monkeypatch):
    """The devices never hold the fp32 tree and all its parts together: before each leaf's
    split, live bytes stay within the fp32 tree's (plus one leaf's parts); every fp32 array is
    deleted afterwards, and the parts rebuild it (exactly with 16 bits)."""
    keys = jax.random.split(jax.random.key(int(np.random.default_rng().integers(1 << 30))), 6)
    shapes = [(256, 512), (512, 256), (128,), (64, 64, 8), (1000,), (256, 384)]
    baseline = live_bytes()
    weights = {f"w{i}": jax.random.normal(k, shape) for i, (k, shape) in
               enumerate(zip(keys, shapes, strict=True))}  # fmt: skip
    want = {k: np.array(w) for k, w in weights.items()}  # (device_get copies on the CPU)
    total = sum(w.nbytes for w in jax.tree.leaves(weights))
    largest = max(w.nbytes for w in jax.tree.leaves(weights))
    seen = spy_live_bytes_before_each_split(monkeypatch)
    old = jax.tree.leaves(weights)
    hi, remainder = master_weights_module.split_leaf_by_leaf(weights, bits)
    del weights
    assert len(seen) == len(shapes)
    # whole-tree splitting would reach total * (1 + (2 + bits / 8) / 4) before the last leaf
    assert max(seen) - baseline <= total + largest, (max(seen) - baseline, total)
    assert all(w.is_deleted() for w in old)
    for k, w in want.items():
        assert hi[k].dtype == jnp.bfloat16 and remainder[k].dtype == master.remainder_dtype(bits)
        got = np.asarray(master.join(hi[k], remainder[k]))
        if bits == 16:
            np.testing.assert_array_equal(bits_of(got), bits_of(w))
        else:
            np.testing.assert_allclose(got, w, rtol=2.0**-15, atol=0)


def test_split_leaf_by_leaf_splits_a_tied_weight_once():
    w = jax.random.normal(jax.random.key(3), (64, 32))
    want = master.split(w)
    hi, remainder = master_weights_module.split_leaf_by_leaf({"a": w, "b": w, "c": w * 2}, 16)
    assert w.is_deleted() and hi["a"] is hi["b"] and remainder["a"] is remainder["b"]
    np.testing.assert_array_equal(np.asarray(remainder["b"]), np.asarray(want[1]))


@pytest.mark.parametrize("bits", [16, 8])
def test_create_with_master_weights_splits_the_fp32_init_and_keeps_nothing_else(bits, monkeypatch):
    """``Run.create`` with BF16 master weights: the parameters are the BF16 parts of the fp32
    initialization, split leaf by leaf (live bytes within the fp32 weights' plus the largest
    leaf's parts), the state's remainders its remainders, and nothing else it made is left on
    the devices."""
    run = tiny_run(**{"optimizer.master_weights": f"bf16+{bits}"})
    before = {id(x) for x in jax.live_arrays()}
    seen = spy_live_bytes_before_each_split(monkeypatch)
    baseline = live_bytes()
    params, opt_state = run.create()
    fp32 = 4 * sum(x.size for x in jax.tree.leaves(params))
    assert seen and max(seen) - baseline <= 1.5 * fp32, (max(seen) - baseline, fp32)
    kept = before | {id(x) for x in jax.tree.leaves((params, opt_state))}
    stray = [x.shape for x in jax.live_arrays() if id(x) not in kept and x.size > 1]
    assert not stray, stray
    from coat_jax.models.llama import init_params

    fp32 = init_params(run.model, run.config.seed, run.placement.params)[1]
    want_hi, want_r = master_weights_module.split_tree(fp32, bits)
    (remainder,) = [s.remainder for s in jax.tree.leaves(
        opt_state, is_leaf=lambda s: isinstance(s, master_weights_module.MasterWeightsState))
        if isinstance(s, master_weights_module.MasterWeightsState)]  # fmt: skip
    for got, want in zip(jax.tree.leaves((params, remainder)), jax.tree.leaves((want_hi, want_r)),
                         strict=True):  # fmt: skip
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_public_name():
    assert coat_jax.master_weights is master_weights
