"""The update in the backward pass (``config.optimizer.update_in_backward``): clipping by the
previous step's norm, the same training where nothing is clipped, no step-wide gradient buffer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny
from tiny import ROOT, tiny_run

from coat_jax.ops.clipping import ClipByPreviousNormState, clip_by_previous_global_norm
from coat_jax.training import configs, planner

# The three marked xla_cpu compare two differently compiled steps bit for bit (or to one fp32
# rounding), and XLA:CPU's buffer assignment: claims the README makes for the CPU. On an H200
# (2026-12-04) the two runs drifted (losses 1-3% apart after 8 steps) and the tiny step's
# temporary memory stayed level; the GPU's numbers for the option are train.py's (README).


def test_clipping_by_the_previous_norm():
    """Step 0 passes the gradients through; step t scales by min(1, c / ||g_{t-1}||), fp32
    reference; the state holds this step's norm; bf16 leaves stay bf16."""
    c = 1.0
    tx = clip_by_previous_global_norm(c)
    sizes = [0.01, 3.0, 0.2, 5.0, 0.5, 0.05, 2.0, 1.0]
    keys = jax.random.split(jax.random.key(0), len(sizes))
    grads = [{"w": jax.random.normal(k, (33, 7)) * s, "b": jnp.ones(7, jnp.bfloat16) * s}
             for k, s in zip(keys, sizes, strict=True)]  # fmt: skip
    state = tx.init(grads[0])
    assert isinstance(state, ClipByPreviousNormState) and float(state.norm) == 0.0
    previous = 0.0
    for g in grads:
        out, state = tx.update(g, state)
        scale = 1.0 if previous < c else c / previous
        for got, x in zip(jax.tree.leaves(out), jax.tree.leaves(g), strict=True):
            assert got.dtype == x.dtype
            want = np.asarray(x, np.float64) * scale
            np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-2 if
                                       x.dtype == jnp.bfloat16 else 1e-6)  # fmt: skip
            if scale == 1.0:  # the identity, bit for bit
                np.testing.assert_array_equal(np.asarray(got), np.asarray(x))
        norm = np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(g)))
        np.testing.assert_allclose(float(state.norm), norm, rtol=1e-5)
        previous = float(state.norm)
    with pytest.raises(ValueError, match="max_norm"):
        clip_by_previous_global_norm(0.0)


def small(overrides):
    return tiny_run(**{"batch_size": 4, "seq_len": 32, **overrides})


def train(overrides, steps):
    params, opt_state, metrics = tiny.train(small(overrides), steps)
    return params, opt_state, np.asarray([float(m["grad_norm"]) for m in metrics])


@pytest.mark.xla_cpu
@pytest.mark.parametrize("fused", [True, False])
def test_unclipped_training_matches_the_update_after_backward(fused):
    """Norms below the threshold (grad_clip 1e6): 8 steps of llama_tiny (COAT, fp8_adamw) with
    the update in the backward pass see the same gradient norms and, with the fused update
    (interpreted), reach the same parameters and optimizer state bit for bit; the optax chain,
    fused by XLA differently inside the backward pass, within one fp32 rounding (3e-8 measured
    on the CPU), its FP8 moments a code apart here and there. The clip state holds the last
    step's norm."""
    common = {"optimizer.grad_clip": 1e6, "optimizer.warmup_steps": 2}
    if fused:
        common.update({"optimizer.kernels": "interpret", "optimizer.min_size": 1024})
    p0, s0, n0 = train(common, 8)
    p1, s1, n1 = train({**common, "optimizer.update_in_backward": True}, 8)
    np.testing.assert_array_equal(n0, n1)
    (clip_state,) = [s for s in jax.tree.leaves(s1, is_leaf=lambda s: isinstance(
        s, ClipByPreviousNormState)) if isinstance(s, ClipByPreviousNormState)]  # fmt: skip
    np.testing.assert_allclose(float(clip_state.norm), n1[-1], rtol=1e-6)
    if not fused:
        for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(p1), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-7)
        return
    same = [leaf for leaf in jax.tree.leaves(s1) if leaf is not clip_state.norm]
    raw = lambda leaves: [np.atleast_1d(np.asarray(x)).view(np.uint8) for x in leaves]
    for a, b in zip(raw(jax.tree.leaves((p0, s0))), raw(jax.tree.leaves(p1) + same), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.xla_cpu
def test_the_fused_update_clips_by_the_previous_norm_like_the_chain():
    """With clipping active every step (grad_clip 0.05), the fused update (interpreted) and the
    optax chain, both in the backward pass, agree to fp32 rounding over 6 steps: the kernel
    reads the previous step's norm from the state as the chain does. The two are fused by XLA
    differently, so a moment may land a code apart (one of 250k on 2026-12-02): its element's
    parameter then moves by a fraction of one step's update; all others within 1e-4."""
    common = {"optimizer.grad_clip": 0.05, "optimizer.update_in_backward": True,
              "optimizer.min_size": 1024, "grad_dtype": "float32"}  # fmt: skip
    chain, _, norms = train(common, 6)
    fused, _, _ = train({**common, "optimizer.kernels": "interpret"}, 6)
    assert (norms > 0.05).all()  # clipped at every step after the first
    apart = 0
    for a, b in zip(jax.tree.leaves(chain), jax.tree.leaves(fused), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-6)
        apart += int(np.sum(~np.isclose(a, b, rtol=1e-4, atol=1e-6)))
    assert apart <= 4, apart


@pytest.mark.xla_cpu
def test_the_step_holds_no_buffer_of_all_gradients():
    """XLA's memory analysis of the compiled step (a 4-layer, 256-wide llama, batch 4 x 32:
    gradients outweigh activations): the update in the backward pass needs less temporary
    memory by at least half the gradients' bytes, and the planner counts no gradients among
    the persistent bytes."""
    shape = {"model.dim": 256, "model.n_layers": 4, "model.n_heads": 4, "model.n_kv_heads": 4,
             "model.ffn_dim": 768}  # fmt: skip
    plans = [planner.memory_plan(small({**shape, "optimizer.update_in_backward": flag}))
             for flag in (False, True)]  # fmt: skip
    after, during = plans
    assert during["compiled_temp"] <= after["compiled_temp"] - after["grads"] // 2, plans
    assert during["update_in_backward"] and not after["update_in_backward"]
    grad_per_param = after["grads"] / sum(x.size for x in jax.tree.leaves(small(shape).params))
    assert during["persistent_bytes_per_param"] == pytest.approx(
        after["persistent_bytes_per_param"] - grad_per_param
    )


def test_bad_configs_are_refused():
    tiny_file = str(ROOT / "configs" / "llama_tiny.py")
    config = configs.load_file(tiny_file, {"optimizer.update_in_backward": True, "grad_accum": 2})
    with pytest.raises(ValueError, match="grad_accum=1"):
        configs.validate(config)
    with pytest.raises(TypeError, match="update_in_backward"):  # ml_collections' own check
        configs.load_file(tiny_file, {"optimizer.update_in_backward": "yes"})


def test_a_checkpoint_from_before_the_option_resumes_with_its_default():
    """A saved config without the key (runs from before it existed) reads as its default:
    nothing refused or reported; switching it on is refused (the clip state changes)."""
    config = configs.load_file(str(ROOT / "configs" / "llama_tiny.py"), {})
    saved = config.to_dict()
    del saved["optimizer"]["update_in_backward"]
    assert configs.resume_changes(saved, config) == ([], [])
    config.optimizer.update_in_backward = True
    refused, _ = configs.resume_changes(saved, config)
    assert refused and "update_in_backward" in refused[0]
