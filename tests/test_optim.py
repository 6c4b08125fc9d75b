"""scale_by_fp8_adam / fp8_adamw: exactness harness, state layout and bytes, optax wrappers."""

import inspect

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import coat_jax


def make_params(seed=0, dtype=jnp.float32):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    return {
        "dense": {"kernel": jax.random.normal(k1, (48, 130), dtype), "bias": jnp.zeros(130, dtype)},
        "embed": jax.random.normal(k2, (3, 7, 64), dtype),
        "scalar": jnp.asarray(0.5, dtype),
        "vec": jax.random.normal(k3, (300,), dtype),
    }


def grads_stream(params, steps, seed=1):
    """Fresh random gradients of growing spread per step (deterministic per seed)."""
    keys = jax.random.split(jax.random.key(seed), steps)
    for i, key in enumerate(keys):
        leaves, treedef = jax.tree.flatten(params)
        ks = jax.random.split(key, len(leaves))
        yield treedef.unflatten(
            [
                jax.random.normal(k, p.shape, p.dtype) * (1 + i) ** 0.5
                for k, p in zip(ks, leaves, strict=True)
            ]
        )


def run(opt, params, steps=12, seed=1):
    state = opt.init(params)
    step = jax.jit(lambda g, s, p: opt.update(g, s, p))
    history = []
    for grads in grads_stream(params, steps, seed):
        updates, state = step(grads, state, params)
        params = optax.apply_updates(params, updates)
        history.append(updates)
    return params, state, history


EXACT_CASES = {
    "defaults": dict(learning_rate=1e-3),
    "betas_eps": dict(learning_rate=3e-2, b1=0.8, b2=0.95, eps=1e-6, eps_root=1e-9),
    "schedule": dict(learning_rate=optax.warmup_cosine_decay_schedule(0.0, 1e-2, 4, 12)),
    "nesterov": dict(learning_rate=1e-2, b1=0.8, nesterov=True),
    "masked_decay": dict(
        learning_rate=1e-2,
        weight_decay=0.3,
        mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p),
    ),
}


@pytest.mark.parametrize("case", EXACT_CASES)
def test_formats_off_equals_optax_adamw(case):
    kwargs = EXACT_CASES[case]
    ours = coat_jax.fp8_adamw(**kwargs, mu_format=None, nu_format=None, min_size=0)
    params_a, _, hist_a = run(ours, make_params())
    params_b, _, hist_b = run(optax.adamw(**kwargs), make_params())
    chex.assert_trees_all_close(hist_a, hist_b, rtol=1e-6, atol=1e-9)
    chex.assert_trees_all_close(params_a, params_b, rtol=1e-6, atol=1e-9)


def test_takes_optax_adamws_arguments_in_its_order():
    """A positional call written for optax.adamw means the same to fp8_adamw (its parameters
    are a prefix of ours, keyword-only ones included), and steps the same with fp32 moments."""
    ours = inspect.signature(coat_jax.fp8_adamw).parameters
    theirs = inspect.signature(optax.adamw).parameters
    positional = [n for n, p in theirs.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert list(ours)[: len(positional)] == positional
    assert all(ours[n].kind is theirs[n].kind for n in theirs)
    args = (3e-2, 0.8, 0.95, 1e-6, 0.0, None, 0.1, None)
    fp32_moments = dict(mu_format=None, nu_format=None, min_size=0)
    params_a, _, hist_a = run(coat_jax.fp8_adamw(*args, **fp32_moments), make_params())
    params_b, _, hist_b = run(optax.adamw(*args), make_params())
    chex.assert_trees_all_close(hist_a, hist_b, rtol=1e-6, atol=1e-9)
    chex.assert_trees_all_close(params_a, params_b, rtol=1e-6, atol=1e-9)


def test_mu_dtype_stores_the_first_moment_in_it():
    """mu_dtype=bfloat16 (positional, as optax.adamw takes it) stores m in BF16 and steps in
    fp32: the updates stay within 2% of their scale (0.01) of fp32 Adam's and of
    optax.adamw(mu_dtype=bfloat16)'s (which also rounds b1 m in BF16; measured 2026-12-07:
    0.55% and 1.2% after 12 steps). With FP8 formats it applies to the moments kept out of
    FP8 only (the small params')."""
    fp32_moments = dict(mu_format=None, nu_format=None, min_size=0)
    _, state, hist = run(coat_jax.fp8_adamw(1e-2, 0.9, 0.999, 1e-8, 0.0, jnp.bfloat16,
                                            **fp32_moments), make_params())  # fmt: skip
    assert state[0].mu["dense"]["kernel"].dtype == jnp.bfloat16
    assert state[0].nu["dense"]["kernel"].dtype == jnp.float32
    for reference in (optax.adamw(1e-2), optax.adamw(1e-2, mu_dtype=jnp.bfloat16)):
        _, _, expected = run(reference, make_params())
        chex.assert_trees_all_close(hist, expected, atol=2e-4)
    state = coat_jax.fp8_adamw(1e-3, mu_dtype=jnp.bfloat16, min_size=1000).init(make_params())
    adam = state[0]
    assert adam.mu["dense"]["kernel"].dtype == jnp.float8_e4m3fn
    assert adam.mu["vec"].dtype == jnp.bfloat16 and adam.nu["vec"].dtype == jnp.float32


def test_nesterov_with_fp8_moments_tracks_optax_nesterov_and_skips_the_kernel():
    """Nesterov on FP8 moments: close to optax.adamw(nesterov=True), farther from plain Adam
    than from it, and identical whether the Pallas kernel was asked for or not (the kernel
    does not take it, so every parameter steps on the reference)."""
    kw = dict(learning_rate=1e-2, b1=0.8, min_size=0, nesterov=True)
    _, _, hist = run(coat_jax.fp8_adamw(**kw, kernels="reference"), make_params())
    _, _, hist_kernel = run(coat_jax.fp8_adamw(**kw, kernels="interpret"), make_params())
    chex.assert_trees_all_equal(hist, hist_kernel)
    _, _, nesterov = run(optax.adamw(1e-2, b1=0.8, nesterov=True), make_params())
    _, _, plain = run(optax.adamw(1e-2, b1=0.8), make_params())
    last = lambda h: np.concatenate([np.ravel(x) for x in jax.tree.leaves(h[-1])])
    gap = lambda a, b: np.linalg.norm(last(a) - last(b)) / np.linalg.norm(last(b))
    assert gap(hist, nesterov) < 0.1
    assert gap(hist, nesterov) < 0.5 * gap(hist, plain)


def test_first_step_uses_fresh_fp32_moments():
    """Step 1 dequantizes zeros exactly and computes the update before requantizing: exact."""
    opt = coat_jax.fp8_adamw(1e-2, min_size=0)
    params = make_params()
    grads = next(grads_stream(params, 1))
    u8, _ = opt.update(grads, opt.init(params), params)
    u32, _ = optax.adamw(1e-2).update(grads, optax.adamw(1e-2).init(params), params)
    chex.assert_trees_all_close(u8, u32, rtol=1e-6)


@pytest.mark.parametrize("expansion", [True, False])
@pytest.mark.parametrize(("mu", "nu"), [("e4m3", "e4m3"), ("e4m3", "e5m2"), ("e5m2", "e5m2")])
def test_fp8_updates_track_fp32_adamw(mu, nu, expansion):
    kw = dict(learning_rate=1e-2, min_size=0, mu_format=mu, nu_format=nu, expansion=expansion)
    params_a, state, hist_a = run(coat_jax.fp8_adamw(**kw), make_params())
    params_b, _, hist_b = run(optax.adamw(1e-2), make_params())
    adam = state[0]
    assert adam.mu["dense"]["kernel"].dtype == jnp.dtype(coat_jax.get_format(mu).dtype)
    assert (adam.mu_k is not None) == expansion
    for a, b in zip(jax.tree.leaves(hist_a[-1]), jax.tree.leaves(hist_b[-1]), strict=True):
        rel = np.linalg.norm(np.asarray(a) - b) / np.linalg.norm(b)
        assert rel < 0.1, rel
    chex.assert_trees_all_close(params_a, params_b, atol=0.03)


def test_state_codes_have_the_params_shape_and_scales_divide_the_last_axis():
    params = make_params()
    state = coat_jax.scale_by_fp8_adam(min_size=0).init(params)
    for codes, amax, k in [
        (state.mu, state.mu_amax, state.mu_k),
        (state.nu, state.nu_amax, state.nu_k),
    ]:
        chex.assert_trees_all_equal_shapes(codes, params)
        assert codes["dense"]["kernel"].dtype == jnp.float8_e4m3fn
        assert amax["dense"]["kernel"].shape == (48, 2) and amax["embed"].shape == (3, 7, 1)
        assert k["embed"].shape == (3, 7, 1) and k["embed"].dtype == jnp.uint8
        assert codes["scalar"].dtype == jnp.float32 and amax["scalar"].shape == ()
    assert jax.tree.structure(state.mu_amax) == jax.tree.structure(params)


def test_state_maps_like_the_params():
    """Whatever maps over the params maps over every per-parameter field of the state."""
    params = make_params()
    state = coat_jax.scale_by_fp8_adam(min_size=0).init(params)
    specs = optax.tree_utils.tree_map_params(
        coat_jax.scale_by_fp8_adam(min_size=0), lambda leaf, p: leaf.ndim - p.ndim, state, params
    )
    assert all(d == 0 for d in jax.tree.leaves((specs.mu, specs.nu_amax, specs.mu_k)))


def test_min_size_keeps_small_params_fp32():
    params = make_params()
    state = coat_jax.scale_by_fp8_adam(min_size=200).init(params)
    assert state.mu["vec"].dtype == jnp.float8_e4m3fn  # 300 elements
    assert state.mu["dense"]["bias"].dtype == jnp.float32  # 130 elements
    assert coat_jax.DEFAULT_MIN_SIZE == 16384


def test_state_bytes_per_parameter():
    """<= 2.1 bytes per quantized parameter (m + v + scales), from abstract params."""
    shapes = {"q": (4096, 4096), "up": (4096, 11008), "down": (11008, 4096), "emb": (32000, 4096)}
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
    for expansion, limit in [(True, 2.1), (False, 2.07)]:
        opt = coat_jax.scale_by_fp8_adam(expansion=expansion)
        state = jax.eval_shape(opt.init, params)
        n_params = sum(np.prod(s) for s in shapes.values())
        state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state)) - 4
        assert state_bytes / n_params <= limit, state_bytes / n_params
        assert state_bytes / n_params == pytest.approx(2 + 2 * (5 if expansion else 4) / 128)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_update_dtype_follows_gradient_and_state_dtypes_never_drift(dtype):
    params = make_params(dtype=dtype)
    opt = coat_jax.fp8_adamw(1e-3, min_size=0)
    state0 = opt.init(params)
    grads = next(grads_stream(params, 1))

    traces = []

    @jax.jit
    def step(grads, state):
        traces.append(1)  # once per trace: a recompilation adds one
        # under lax.cond, as optax tests do: both branches must agree on dtypes
        return jax.lax.cond(True, lambda: opt.update(grads, state, params), lambda: (grads, state))

    updates, state1 = step(grads, state0)
    chex.assert_trees_all_equal_dtypes(updates, grads)
    chex.assert_trees_all_equal_shapes_and_dtypes(state0, state1)
    _, state2 = step(grads, state1)
    assert len(traces) == 1  # no recompilation on the second step
    chex.assert_trees_all_equal_shapes_and_dtypes(state0, state2)


def test_init_from_shape_dtype_structs():
    params = make_params()
    opt = coat_jax.fp8_adamw(1e-3, min_size=0)
    structs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    abstract = jax.eval_shape(opt.init, structs)
    chex.assert_trees_all_equal_shapes_and_dtypes(abstract, opt.init(params))


def test_inject_hyperparams():
    opt = optax.inject_hyperparams(coat_jax.fp8_adamw, static_args=("group_size", "min_size"))(
        learning_rate=1e-2, weight_decay=0.1, min_size=0, group_size=64
    )
    params, state, _ = run(opt, make_params(), steps=3)
    assert float(state.hyperparams["learning_rate"]) == pytest.approx(1e-2)
    state.hyperparams["learning_rate"] = jnp.asarray(0.0)
    updates, _ = opt.update(next(grads_stream(params, 1)), state, params)
    assert all(float(jnp.abs(u).max()) == 0 for u in jax.tree.leaves(updates))


def test_inject_hyperparams_needs_no_static_args_for_the_defaults():
    opt = optax.inject_hyperparams(coat_jax.fp8_adamw)(learning_rate=1e-2)
    params = make_params()
    state = opt.init(params)
    step = jax.jit(opt.update)
    u1, state = step(next(grads_stream(params, 1)), state, params)
    state.hyperparams["learning_rate"] = jnp.asarray(5e-3)
    u2, _ = step(next(grads_stream(params, 1)), state, params)
    ratio = jnp.abs(u2["dense"]["kernel"]).sum() / jnp.abs(u1["dense"]["kernel"]).sum()
    assert float(ratio) < 0.6  # the halved learning rate reached the traced update
    assert isinstance(state.inner_state[0], coat_jax.ScaleByFp8AdamState)


def test_inject_hyperparams_with_an_explicit_group_size_says_how():
    opt = optax.inject_hyperparams(coat_jax.fp8_adamw)(learning_rate=1e-2, group_size=64)
    with pytest.raises(TypeError, match="static_args"):
        jax.jit(opt.init)(make_params())


def test_apply_if_finite_skips_bad_steps_and_keeps_fp8_state():
    opt = optax.apply_if_finite(coat_jax.fp8_adamw(1e-2, min_size=0), max_consecutive_errors=5)
    params = make_params()
    state = opt.init(params)
    step = jax.jit(opt.update)
    good = list(grads_stream(params, 3))
    _, state = step(good[0], state, params)
    before = state.inner_state
    bad = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.nan), good[1])
    updates, state = step(bad, state, params)
    assert int(state.notfinite_count) == 1
    assert all(float(jnp.abs(u).max()) == 0 for u in jax.tree.leaves(updates))
    chex.assert_trees_all_equal(before, state.inner_state)  # bit-identical FP8 state
    updates, state = step(good[2], state, params)
    assert int(state.notfinite_count) == 0
    assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in jax.tree.leaves(state))
    assert all(np.isfinite(np.asarray(u)).all() for u in jax.tree.leaves(updates))


def test_multisteps_accumulates_then_applies():
    kw = dict(learning_rate=1e-2, min_size=0)
    ms = optax.MultiSteps(coat_jax.fp8_adamw(**kw), every_k_schedule=2)
    ref = optax.MultiSteps(
        coat_jax.fp8_adamw(**kw, mu_format=None, nu_format=None), every_k_schedule=2
    )
    params_a, state_a, hist_a = run(ms, make_params(), steps=6)
    params_b, _, hist_b = run(ref, make_params(), steps=6)
    for i in (0, 2, 4):  # accumulation steps apply nothing
        assert all(float(jnp.abs(u).max()) == 0 for u in jax.tree.leaves(hist_a[i]))
    assert int(state_a.inner_opt_state[0].count) == 3
    chex.assert_trees_all_close(params_a, params_b, atol=0.02)
    chex.assert_trees_all_equal_shapes_and_dtypes(state_a, ms.init(make_params()))


def test_masked_wraps_a_subset():
    params = make_params()
    mask = jax.tree.map(lambda x: x.ndim >= 2, params)
    opt = optax.chain(
        optax.masked(coat_jax.scale_by_fp8_adam(min_size=0), mask),
        optax.scale_by_learning_rate(1e-2),
    )
    new_params, state, _ = run(opt, params, steps=2)
    inner = state[0].inner_state
    assert inner.mu["dense"]["kernel"].dtype == jnp.float8_e4m3fn
    assert isinstance(inner.mu["vec"], optax.MaskedNode)
    assert not np.allclose(new_params["embed"], params["embed"])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(group_size=0), ValueError, "group_size"),
        (dict(group_size=12.0), TypeError, "group_size"),
        (dict(min_size=-1), ValueError, "min_size"),
        (dict(mu_format="e3m4"), ValueError, "mu_format: unknown FP8 format"),
        (dict(nu_format="fp16"), ValueError, "nu_format: unknown FP8 format"),
        (dict(expansion="yes"), TypeError, "expansion"),
        (dict(b1=1.0), ValueError, "b1"),
        (dict(b2=-0.1), ValueError, "b2"),
        (dict(nesterov="yes"), TypeError, "nesterov must be a bool"),
        (dict(mu_dtype=jnp.int8), TypeError, "mu_dtype must be a 16- or 32-bit floating"),
        (dict(mu_dtype=jnp.float8_e4m3fn), TypeError, "mu_dtype must be a 16- or 32-bit"),
        (dict(mu_dtype="fp42"), TypeError, "mu_dtype must be a dtype or None"),
    ],
)
def test_bad_options_fail_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        coat_jax.fp8_adamw(1e-3, **kwargs)


def test_non_float_params_and_grads_fail_with_the_leaf_named():
    opt = coat_jax.fp8_adamw(1e-3)
    with pytest.raises(TypeError, match=r"param \['steps'\] has dtype int32"):
        opt.init({"w": jnp.ones(3), "steps": jnp.zeros(3, jnp.int32)})
    state = opt.init({"w": jnp.ones(3)})
    with pytest.raises(TypeError, match=r"gradient \['w'\] has dtype int32"):
        opt.update({"w": jnp.ones(3, jnp.int32)}, state, {"w": jnp.ones(3)})
    # the way the message names: masked, the integer leaf passes through untouched
    params = {"w": jnp.ones(3), "steps": jnp.zeros(3, jnp.int32)}
    floats = lambda tree: jax.tree.map(lambda x: jnp.issubdtype(x.dtype, jnp.floating), tree)
    masked = optax.masked(opt, floats)
    grads = {"w": jnp.ones(3), "steps": jnp.ones(3, jnp.int32)}
    updates, _ = masked.update(grads, masked.init(params), params)
    want, _ = opt.update({"w": grads["w"]}, opt.init({"w": params["w"]}), {"w": params["w"]})
    np.testing.assert_array_equal(updates["w"], want["w"])
    np.testing.assert_array_equal(updates["steps"], grads["steps"])


@pytest.mark.parametrize("expansion", [True, False])
def test_fused_kernel_path_matches_reference_path(expansion):
    """The optimizer through the Pallas kernel (interpret mode here) equals the jnp path."""
    params = {"w": jax.random.normal(jax.random.key(0), (16, 512)), "odd": jnp.ones((4, 130))}
    kw = dict(learning_rate=1e-2, min_size=0, expansion=expansion)
    fused, ref = (coat_jax.fp8_adamw(**kw, kernels=k) for k in ("interpret", "reference"))
    _, state_a, hist_a = run(fused, params, steps=3)
    _, state_b, hist_b = run(ref, params, steps=3)
    chex.assert_trees_all_close(hist_a, hist_b, rtol=1e-4, atol=1e-7)
    chex.assert_trees_all_equal_shapes_and_dtypes(state_a, state_b)


def test_kernels_option_is_checked():
    with pytest.raises(ValueError, match="kernels='triton'"):
        coat_jax.fp8_adamw(1e-3, kernels="triton")
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="needs a Hopper GPU"):
            coat_jax.fp8_adamw(1e-3, kernels="pallas")


def test_pallas_kernel_refuses_a_multi_device_mesh():
    opt = coat_jax.scale_by_fp8_adam(min_size=0, kernels="interpret")
    params = {"w": jnp.ones((4, 256))}
    state = opt.init(params)
    mesh = jax.sharding.AbstractMesh((2,), ("fsdp",))
    with jax.sharding.use_abstract_mesh(mesh), pytest.raises(ValueError, match="2-device mesh"):
        jax.eval_shape(opt.update, params, state)


def test_auto_takes_the_xla_path_under_a_multi_device_mesh(monkeypatch):
    """``kernels="auto"`` picks the moment kernel on a Hopper GPU, but not under a multi-device
    mesh: there the XLA path runs (and shards); a forced ``"pallas"`` refuses instead."""
    from pallas_kernels import adam_step, dispatch

    monkeypatch.setattr(dispatch, "hopper_gpu", lambda devices=None: True)
    monkeypatch.setitem(dispatch.AUTO_USES_KERNEL, "adam_step", True)

    def no_kernel(*args, **kwargs):
        raise AssertionError("the kernel ran under a 2-device mesh")

    monkeypatch.setattr(adam_step, "fp8_adam_moments", no_kernel)
    opt = coat_jax.scale_by_fp8_adam(min_size=0, kernels="auto")
    params = {"w": jnp.ones((4, 256))}
    state = opt.init(params)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((2,), ("fsdp",))):
        updates, _ = jax.eval_shape(opt.update, params, state)
    assert updates["w"].shape == (4, 256)
    with pytest.raises(AssertionError, match="2-device"):  # without a mesh: the kernel
        jax.eval_shape(opt.update, params, state)
