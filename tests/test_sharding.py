"""Sharding specs for params and the FP8 optimizer state, on 8 virtual CPU devices."""

import ast
import pathlib
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from coat_jax.ops import sharding

SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    import coat_jax
    from coat_jax.ops import sharding
    from coat_jax.models.llama import Llama, LlamaConfig

    cfg = LlamaConfig(vocab_size=256, dim=256, n_layers=1, n_heads=4, n_kv_heads=4, ffn_dim=512)
    graph, params = nnx.split(Llama(cfg, rngs=nnx.Rngs(0)))
    opt = coat_jax.fp8_adamw(1e-3, min_size=0)
    state = opt.init(params)
    for shape in [(2, 4, 1), (2, 2, 2)]:  # (8, 1, 1): test_parallel's two-process run
        mesh = sharding.make_mesh(*shape)
        pspec = sharding.param_specs(mesh, params)
        sspec = sharding.optimizer_specs(mesh, opt, state, pspec)
        ps, ss = sharding.shardings(mesh, pspec), sharding.shardings(mesh, sspec)
        p, s = jax.device_put(params, ps), jax.device_put(state, ss)
        grads = jax.tree.map(lambda x: jnp.sin(x) * 1e-2, params)
        step = jax.jit(opt.update, in_shardings=(ps, ss, ps), out_shardings=(ps, ss))
        u, new_state = step(jax.device_put(grads, ps), s, p)
        u_ref, state_ref = jax.jit(opt.update)(grads, state, params)
        for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(u_ref), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)
        for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(state_ref), strict=True):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        codes = new_state[0].mu["blocks"][0]["mlp"]["w_gate"]
        amax = new_state[0].mu_amax["blocks"][0]["mlp"]["w_gate"]
        assert codes.dtype == jnp.float8_e4m3fn
        # w_gate (256, 512) is ("embed", "mlp"): codes (256, 512) shard like it on
        # ("fsdp", "tensor"), its 4 groups per row too
        local = codes.addressable_shards[0].data.shape
        assert local == (256 // shape[1], 512 // shape[2]), (shape, local)
        assert amax.addressable_shards[0].data.shape == (256 // shape[1], 4 // shape[2])

    # Groups aligned with the shards (Llama-like: last axes are multiples of 128 x mesh size):
    # the compiled update moves no FP8 state between devices.
    cfg = LlamaConfig(vocab_size=512, dim=1024, n_layers=1, n_heads=8, ffn_dim=2048)
    graph, params = nnx.split(Llama(cfg, rngs=nnx.Rngs(0)))
    state = opt.init(params)
    for shape in [(1, 2, 4), (2, 2, 2)]:
        mesh = sharding.make_mesh(*shape)
        pspec = sharding.param_specs(mesh, params)
        ps = sharding.shardings(mesh, pspec)
        ss = sharding.shardings(mesh, sharding.optimizer_specs(mesh, opt, state, pspec))
        step = jax.jit(opt.update, in_shardings=(ps, ss, ps), out_shardings=(ps, ss))
        hlo = step.lower(params, state, params).compile().as_text()
        assert "all-gather" not in hlo and "all-to-all" not in hlo, shape

    # parallel.repack: every shard's value and every sharding kept, the old buffers freed
    from coat_jax.training import parallel
    placed = jax.device_put((params, state), (ps, ss))
    old, want = jax.tree.leaves(placed), jax.device_get(jax.tree.leaves(placed))
    packed = jax.tree.leaves(parallel.repack(placed))
    assert all(x.is_deleted() for x in old)
    for x, w, o in zip(packed, want, jax.tree.leaves((ps, ss)), strict=True):
        assert x.sharding == o and x.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(w, np.float32))
    print("OK")
    """
)


@pytest.mark.slow
def test_sharded_fp8_update_matches_single_device():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr[-3000:]


FUSED_SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    import coat_jax
    from coat_jax.ops import sharding
    from coat_jax.models.llama import Llama, LlamaConfig
    from coat_jax.ops import fused_update

    cfg = LlamaConfig(vocab_size=256, dim=256, n_layers=1, n_heads=4, n_kv_heads=4, ffn_dim=512)
    graph, params = nnx.split(Llama(cfg, rngs=nnx.Rngs(0)))
    adam = coat_jax.scale_by_fp8_adam(b1=0.9, b2=0.95, min_size=0, group_size=128)
    grads = jax.tree.map(lambda x: jnp.sin(x * 7.0) * 1e-2, params)

    def update(p, g, s, **kw):
        return fused_update.fp8_adamw_update(p, g, s, 1e-3, b1=0.9, b2=0.95, weight_decay=0.1,
                                             clip_scale=0.5, **kw)

    # from a state with nonzero moments: one reference step first
    params, state = jax.jit(lambda p, g, s: update(p, g, s, kernels="reference"))(
        params, grads, adam.init(params))
    want_p, want_s = jax.jit(lambda p, g, s: update(p, g, s, kernels="interpret"))(
        params, grads, state)
    sharded = []
    kernel = fused_update._leaf_sharded
    fused_update._leaf_sharded = lambda *a, **k: sharded.append(a[0].shape) or kernel(*a, **k)

    def sharded_step(shape, params, state):  # the update jitted on a (data, fsdp, tensor) mesh
        sharded.clear()
        mesh = sharding.make_mesh(*shape)
        pspec = sharding.param_specs(mesh, params)
        ps = sharding.shardings(mesh, pspec)
        ss = sharding.shardings(mesh, sharding.optimizer_specs(mesh, adam, state, pspec))
        step = jax.jit(lambda p, g, s: update(p, g, s, kernels="interpret", specs=pspec),
                       in_shardings=(ps, ps, ss), out_shardings=(ps, ss))
        return mesh, step, (ps, ps, ss)

    for shape in [(8, 1, 1), (2, 2, 2)]:  # (1, 8, 1) below, with aligned groups
        mesh, step, placed = sharded_step(shape, params, state)
        with jax.set_mesh(mesh):
            got_p, got_s = step(*jax.device_put((params, grads, state), placed))
        # the matrices whose groups line up with their shards ran the kernel on their shard;
        # the others (256 columns = 2 groups over 8 devices) ran the reference
        assert len(sharded) >= 6, (shape, sharded)
        for a, b in zip(jax.tree.leaves(got_p), jax.tree.leaves(want_p), strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=3e-8)  # kernel vs reference: an ulp
        for a, b in zip(jax.tree.leaves(got_s), jax.tree.leaves(want_s), strict=True):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            assert np.mean(a != b) < 1e-3, shape

    # BF16 master weights: on each shard the kernel reads and writes the BF16 part and the
    # 16-bit remainder (they shard like the parameter), as on one device
    from coat_jax.core import master
    is_part = lambda x: isinstance(x, tuple)
    parts = jax.tree.map(master.split, params)
    hi, rem = (jax.tree.map(lambda t: t[i], parts, is_leaf=is_part) for i in (0, 1))
    parts_update = lambda h, r, g, s, **kw: update(h, g, s, kernels="interpret", remainder=r, **kw)
    want = jax.jit(parts_update)(hi, rem, grads, state)
    mesh = sharding.make_mesh(2, 2, 2)
    pspec = sharding.param_specs(mesh, params)
    ps = sharding.shardings(mesh, pspec)
    ss = sharding.shardings(mesh, sharding.optimizer_specs(mesh, adam, state, pspec))
    step = jax.jit(lambda h, r, g, s: parts_update(h, r, g, s, specs=pspec),
                   in_shardings=(ps, ps, ps, ss), out_shardings=(ps, ps, ss))
    sharded.clear()
    with jax.set_mesh(mesh):
        got = step(*jax.device_put((hi, rem, grads, state), (ps, ps, ps, ss)))
    assert len(sharded) >= 6, sharded
    assert {x.dtype for x in jax.tree.leaves(got[1])} == {jnp.dtype(jnp.int16)}
    joined = lambda out: jax.tree.leaves(jax.tree.map(master.join, out[0], out[1]))
    for a, b in zip(joined(got), joined(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=3e-8)

    # Groups aligned with the shards (last axes multiples of 128 x mesh size): every leaf
    # runs the kernel on its shard and the compiled update has no collectives at all.
    cfg = LlamaConfig(vocab_size=512, dim=1024, n_layers=1, n_heads=8, ffn_dim=2048)
    params = nnx.split(Llama(cfg, rngs=nnx.Rngs(0)))[1]
    state = adam.init(params)
    for shape in [(1, 8, 1), (2, 2, 2)]:
        mesh, step, _ = sharded_step(shape, params, state)
        with jax.set_mesh(mesh):
            hlo = step.lower(params, params, state).compile().as_text()
        assert len(sharded) == len(jax.tree.leaves(params)), (shape, sharded)  # norms too
        for op in ("all-gather", "all-to-all", "all-reduce", "collective-permute"):
            assert op not in hlo, (shape, op)
    with jax.set_mesh(mesh):
        try:
            jax.eval_shape(lambda p, g, s: update(p, g, s, kernels="interpret"),
                           params, grads, state)
        except ValueError as e:
            assert "needs specs=" in str(e)
        else:
            raise AssertionError("a kernel mode under a mesh without specs must raise")
    print("OK")
    """
)


@pytest.mark.slow
def test_fused_update_runs_the_kernel_on_each_shard():
    """``fp8_adamw_update(specs=...)`` under 8 virtual devices: the kernel (interpreted) runs on
    each device's shard via shard_map, matches one device, and the step has no collectives."""
    out = subprocess.run([sys.executable, "-c", FUSED_SCRIPT], capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr[-3000:]


@pytest.mark.parametrize(
    ("sizes", "match"),
    [((-1, -1, 1), "at most one -1"), ((3, 1, 1), "needs 3 devices"), ((0, 1, 1), "positive")],
)
def test_bad_mesh_sizes(sizes, match):
    with pytest.raises(ValueError, match=match):
        sharding.make_mesh(*sizes)


def test_specs_follow_the_parameter():
    import jax
    from flax import nnx

    import coat_jax
    from coat_jax.models.llama import Llama, LlamaConfig

    mesh = sharding.make_mesh(1, 1, 1)
    cfg = LlamaConfig(vocab_size=256, dim=256, n_layers=1, n_heads=4, ffn_dim=512)
    _, params = nnx.split(Llama(cfg, rngs=nnx.Rngs(0)))
    opt = coat_jax.fp8_adamw(1e-3, min_size=0)
    specs = sharding.param_specs(mesh, params)
    state_specs = sharding.optimizer_specs(mesh, opt, opt.init(params), specs)
    w = specs["blocks"][0]["mlp"]["w_gate"]
    w = w.get_value() if hasattr(w, "get_value") else w
    mu = state_specs[0].mu["blocks"][0]["mlp"]["w_gate"]
    assert tuple(w) == ("fsdp", "tensor")
    mu_amax = state_specs[0].mu_amax["blocks"][0]["mlp"]["w_gate"]
    assert tuple(mu) == ("fsdp", "tensor") and tuple(mu_amax) == ("fsdp", "tensor")
    assert tuple(state_specs[0].count) == ()
    assert jax.tree.structure(state_specs) is not None


FSDP_GATHER_SCRIPT = textwrap.dedent(
    """
    import os, sys
    os.environ["XLA_FLAGS"] = (
        "--xla_force_host_platform_device_count=2 --xla_dump_to={dump} "
        "--xla_dump_hlo_pass_re=spmd-partitioning"
    )
    os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"  # a cached executable dumps nothing
    import jax
    from coat_jax.training import configs, planner
    from coat_jax.training.run import assemble

    config = configs.load_file(os.path.join({root!r}, "configs", "llama_tiny.py"), dict(
        precision="coat", **{{"mesh.data": 1, "mesh.fsdp": 2}}, batch_size=2))
    run = assemble(config)  # the trainer's own step
    planner.compiled_total(run, 2)
    model = run.model
    d, f, kv = model.dim, model.ffn_dim, model.kv_heads * model.head_dim
    print("SHAPES", [(d, d), (d, kv), (d, f), (f, d)])
    """
)


def test_fsdp_gathers_projection_weights_as_fp8_codes(tmp_path):
    """Under FSDP the COAT step quantizes each weight shard and all-gathers FP8 codes (1 byte
    per parameter, after the per-tensor amax is reduced): in the partitioned HLO every
    projection weight's all-gather is f8e4m3fn, none is fp32 or bf16."""
    root = pathlib.Path(__file__).resolve().parents[1]
    script = FSDP_GATHER_SCRIPT.format(dump=tmp_path, root=str(root))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=root, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    shapes = ast.literal_eval(out.stdout.split("SHAPES", 1)[1].strip().splitlines()[0])
    (hlo,) = [p for p in tmp_path.iterdir() if "jit_step" in p.name and "after_spmd" in p.name]
    gathers = re.findall(r"= (\w+)\[([\d,]+)\]\{[\d,]*\} all-gather\(", hlo.read_text())
    by_shape = {}
    for dtype, dims in gathers:
        by_shape.setdefault(tuple(int(x) for x in dims.split(",")), set()).add(dtype)
    for shape in shapes:
        assert by_shape.get(shape) == {"f8e4m3fn"}, (shape, by_shape)


GRAD_REDUCE_SCRIPT = textwrap.dedent(
    """
    import os, sys
    os.environ["XLA_FLAGS"] = (
        "--xla_force_host_platform_device_count=8 --xla_dump_to={dump} "
        "--xla_dump_hlo_pass_re=spmd-partitioning"
    )
    os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"  # a cached executable dumps nothing
    import jax, jax.numpy as jnp
    from coat_jax.training import configs, planner
    from coat_jax.training.run import assemble

    ROW = {{"fp8.scaling": "row", "fp8.grad_format": "e4m3"}}

    def assembled(mesh, extra=None):
        overrides = dict(precision="coat", grad_dtype="bfloat16", batch_size=8, **(extra or {{}}),
                         **{{f"mesh.{{k}}": v for k, v in zip(("data", "fsdp", "tensor"), mesh)}})
        config = configs.load_file(os.path.join({root!r}, "configs", "llama_tiny.py"), overrides)
        n = mesh[0] * mesh[1] * mesh[2]
        return assemble(config, devices=jax.devices()[:n])

    def losses(run, steps=3):
        params, opt_state = run.create()
        out = []
        with jax.set_mesh(run.placement.mesh):
            for i in range(steps):
                tokens = jax.random.randint(jax.random.key(i), run.batch_shape(), 0, 256)
                batch = jax.device_put(tokens, run.placement.batch)
                params, opt_state, metrics = run.train_step(params, opt_state, batch)
                out.append(float(metrics["loss"]))
        return out

    planner.compiled_total(assembled((1, 8, 1)), 8)  # the trainer's own step, dumped
    planner.compiled_total(assembled((2, 2, 2), ROW), 8)
    print("LOSSES", (losses(assembled((1, 1, 1))), losses(assembled((2, 2, 2)))))
    model = assembled((1, 1, 1)).model
    d, f, kv = model.dim, model.ffn_dim, model.kv_heads * model.head_dim
    print("SHAPES", [(d, d), (d, kv), (d, f), (f, d)])
    """
)


def test_bf16_weight_gradients_are_reduced_in_bf16(tmp_path):
    """COAT with ``grad_dtype=bfloat16`` on 8 virtual devices (FSDP 8, per-tensor scales;
    data x FSDP x tensor 2x2x2, per-tensor and row scales): in the partitioned HLO of the
    trainer's step every cross-device reduction (all-reduce or reduce-scatter) of a projection
    weight's gradient, whole or a shard of it, in either orientation, is BF16 and none fp32,
    as the BF16 policy's are (the FP8 weight-gradient GEMMs emit BF16); the 2x2x2 run's
    first losses match one device's. (Tensor-parallel activations still reduce in fp32.)"""
    root = pathlib.Path(__file__).resolve().parents[1]
    script = GRAD_REDUCE_SCRIPT.format(dump=tmp_path, root=str(root))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=root, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    head, tail = out.stdout.split("SHAPES", 1)
    shapes = ast.literal_eval(tail.strip().splitlines()[0])
    one, mesh = ast.literal_eval(head.split("LOSSES", 1)[1].strip())
    np.testing.assert_allclose(mesh, one, rtol=5e-3)  # test_parallel's COAT loss tolerance
    dumps = [p for p in tmp_path.iterdir() if "jit_step" in p.name and "after_spmd" in p.name]
    assert len(dumps) >= 3, [p.name for p in tmp_path.iterdir()]  # 2 compiles + the 2x2x2 run
    splits = (1, 2, 4, 8)
    weight_parts = {(r // a, c // b) for r, c in shapes for a in splits for b in splits}
    weight_parts |= {s[::-1] for s in weight_parts}
    for dump in dumps:
        reductions = re.findall(r"= (\w+)\[([\d,]+)\]\{[\d,]*\} (?:all-reduce|reduce-scatter)\(",
                                dump.read_text())  # fmt: skip
        by_shape = {}
        for dtype, dims in reductions:
            by_shape.setdefault(tuple(int(x) for x in dims.split(",")), set()).add(dtype)
        grads = {s: d for s, d in by_shape.items() if s in weight_parts}
        assert grads and all(d == {"bf16"} for d in grads.values()), (dump.name, by_shape)


FUSED_QUANTIZE_SCRIPT = textwrap.dedent(
    """
    import itertools, os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp, numpy as np
    from coat_jax.core.recipe import Fp8Recipe
    from coat_jax.ops import flow, sharding
    from pallas_kernels import fused_quantize as fq

    P = jax.sharding.PartitionSpec
    mesh = sharding.make_mesh(2, 2, 2)
    k = jax.random.split(jax.random.key(0), 6)
    x, u = (jax.random.normal(kk, (8, 16, 128)).astype(jnp.bfloat16) for kk in k[:2])
    scale = (1 + 0.1 * jax.random.normal(k[2], (128,))).astype(jnp.bfloat16)
    w1, w2 = (jax.random.normal(kk, (128, 128)) * 0.05 for kk in k[3:5])
    cot = jax.random.normal(k[5], (8, 16, 128)).astype(jnp.bfloat16)
    ops = {
        "norm": lambda r, x, s, u, w1, w2: flow.fp8_norm_project(x, s, (w1, w2), 1e-5, r)[0],
        "swiglu": lambda r, x, s, u, w1, w2: flow.fp8_swiglu_project(x, u, w2, r),
    }
    calls = []
    kernel = fq.save_and_operand
    fq.save_and_operand = lambda *a, **kw: calls.append(a[0][0].shape) or kernel(*a, **kw)

    def sharded(op, recipe):
        loss = lambda *a: jnp.sum(ops[op](recipe, *a).astype(jnp.float32) * cot)
        specs = (P(("data", "fsdp")), P(), P(("data", "fsdp"), None, "tensor"),
                 P(None, "tensor"), P(None, "tensor"))
        with jax.set_mesh(mesh):
            args = [jax.device_put(a, jax.sharding.NamedSharding(mesh, s))
                    for a, s in zip((x, scale, u, w1, w2), specs)]
            return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))(*args)

    for (op, local), pow2 in itertools.product((("norm", (32, 128)), ("swiglu", (32, 64))),
                                               (False, True)):  # fmt: skip
        calls.clear()
        got = sharded(op, Fp8Recipe(fused_quantize="interpret", pow2_scales=pow2))
        assert calls == [local], (op, calls)  # each device's rows (and MLP columns) only
        want = sharded(op, Fp8Recipe(fused_quantize="reference", pow2_scales=pow2))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    print("OK")
    """
)


def test_fused_quantize_runs_on_each_shard_with_the_tensors_amax():
    """``fp8.fused_quantize`` under a 2x2x2 mesh of 8 virtual devices: the kernels (interpreted)
    run on each device's rows (the SwiGLU's on its MLP columns too) with the ``pmax`` of the
    shards' maxima as the operand's scale (rounded to a power of two after the ``pmax`` with
    ``pow2_scales``); outputs and gradients equal the XLA ops' on the same mesh bit for bit."""
    out = subprocess.run([sys.executable, "-c", FUSED_QUANTIZE_SCRIPT], capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr[-3000:]


GRAD_TRANSPOSE_SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp, numpy as np
    from coat_jax.core.recipe import Fp8Recipe
    from coat_jax.ops import flow, sharding
    from pallas_kernels import quantize as kq

    P = jax.sharding.PartitionSpec
    mesh = sharding.make_mesh(2, 2, 2)
    k = jax.random.split(jax.random.key(int(np.random.default_rng().integers(2**31))), 4)
    x = jax.random.normal(k[0], (8, 16, 128)).astype(jnp.bfloat16)
    w1, w2 = (jax.random.normal(kk, (128, 128)) * 0.05 for kk in k[1:3])
    cot = jax.random.normal(k[3], (8, 16, 128)).astype(jnp.bfloat16)
    calls = []
    kernel = kq.quantize_transpose_per_tensor
    kq.quantize_transpose_per_tensor = lambda x, *a, **kw: calls.append(x.shape) or kernel(
        x, *a, **kw)

    def grads(recipe):
        loss = lambda *a: sum(jnp.sum(o.astype(jnp.float32) * cot)
                              for o in flow.fp8_project(a[0], a[1:], recipe))
        specs = (P(("data", "fsdp")), P("fsdp", "tensor"), P("fsdp", "tensor"))
        with jax.set_mesh(mesh):
            args = [jax.device_put(a, jax.sharding.NamedSharding(mesh, s))
                    for a, s in zip((x, w1, w2), specs)]
            return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)

    for pow2 in (False, True):
        calls.clear()
        got = grads(Fp8Recipe(grad_transpose="interpret", pow2_scales=pow2))
        assert calls == [(32, 64)] * 2, calls  # each device's 32 tokens, its tensor half of N
        want = grads(Fp8Recipe(grad_transpose="reference", pow2_scales=pow2))
        np.testing.assert_array_equal(np.asarray(got[0], np.float32),
                                      np.asarray(want[0], np.float32))  # fmt: skip
        for g, w in zip(got[1:], want[1:]):  # the same products summed in another order (K = 128)
            rel = float(jnp.linalg.norm(g - w) / jnp.linalg.norm(w))
            assert rel <= 2 * 128**1.5 * 2.0**-24, rel
    print("OK")
    """
)


def test_output_gradients_are_quantized_in_both_layouts_on_each_shard():
    """``fp8.grad_transpose`` under a 2x2x2 mesh of 8 virtual devices: the quantize-transpose
    kernel (interpreted) runs on each device's tokens and MLP columns with the tensor's
    ``amax`` (and with ``pow2_scales``); the input gradient equals the XLA path's on the same
    mesh bit for bit, the weight gradients to fp32 summation order."""
    out = subprocess.run([sys.executable, "-c", GRAD_TRANSPOSE_SCRIPT], capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr[-3000:]


SHARDED_GEMM_SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from coat_jax.core.recipe import Fp8Recipe
    from coat_jax.ops import flow, sharding
    from pallas_kernels import dispatch, fp8_matmul

    # The Mosaic GPU kernel does not run on a CPU: its reference math stands in for it, and
    # each call's operand shapes (the device's shard) are recorded.
    seen = set()

    def kernel(a, b, scale, contract, out_dtype, config=None, autotune=True):
        seen.add((a.shape, b.shape, contract))
        dims = (((contract[0],), (contract[1],)), ((), ()))
        out = jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)
        return (out * scale).astype(out_dtype)

    fp8_matmul.fp8_dot_general = kernel
    dispatch.hopper_gpu = lambda devices=None: True
    # the fake Hopper is for the GEMM: one device's reference path keeps the flow's XLA ops
    for family in dispatch.AUTO_ONE_DEVICE:
        dispatch.AUTO_USES_KERNEL[family] = False

    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((4, 16, 64)), jnp.bfloat16)
    w1, w2 = (jnp.asarray(rng.standard_normal((64, 96)) / 8, jnp.bfloat16) for _ in range(2))

    def loss(recipe):
        outs = lambda x, w1, w2: flow.fp8_project(x, (w1, w2), recipe)
        return lambda *a: sum(jnp.sum(o.astype(jnp.float32) ** 2) for o in outs(*a))

    grad = lambda recipe: jax.jit(jax.value_and_grad(loss(recipe), argnums=(0, 1, 2)))
    want = grad(Fp8Recipe())(x, w1, w2)  # one device, XLA's FP8 dots
    assert not seen
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    with jax.set_mesh(mesh):
        put = lambda a, *spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))
        args = (put(x, ("data", "fsdp")), put(w1, "fsdp", "tensor"), put(w2, "fsdp", "tensor"))
        got = grad(Fp8Recipe(gemm="pallas"))(*args)
    # each device: 16 of the 64 tokens, its tensor half of the weight's free axis
    assert seen == {((16, 64), (64, 48), (1, 0)),    # x W
                    ((16, 96), (32, 96), (1, 1)),    # dy W^T
                    ((16, 32), (16, 96), (0, 0))}, seen  # x^T dy, psum over data x fsdp
    rel = lambda a, b: float(jnp.linalg.norm((a - b).astype(jnp.float32))
                             / jnp.linalg.norm(b.astype(jnp.float32)))
    assert rel(got[0], want[0]) < 1e-3, (got[0], want[0])
    # dx: no cross-device sum; dW: BF16 partial sums over 4 token shards, then their psum
    assert rel(got[1][0], want[1][0]) < 2e-3, rel(got[1][0], want[1][0])
    for g, w in zip(got[1][1:], want[1][1:]):
        assert rel(g, w) < 1e-2, rel(g, w)

    # the trainer's step (llama_tiny, COAT, 3 steps) on that mesh with every FP8 GEMM on the
    # kernel, against one device's XLA GEMMs: the same losses to FP8 rounding noise
    from coat_jax.training import configs
    from coat_jax.training.run import assemble

    def run(devices, **overrides):
        overrides = {"fp8.fused_quantize": "reference", "optimizer.kernels": "reference",
                     **overrides}
        config = configs.load_file("configs/llama_tiny.py", overrides)
        configs.validate(config)
        r = assemble(config, devices=devices)
        with jax.set_mesh(r.placement.mesh):
            params, opt_state = r.create()
            out = []
            for i in range(3):
                tokens = jax.random.randint(jax.random.key(100 + i), r.batch_shape(), 0, 256)
                tokens = jax.device_put(tokens, r.placement.batch)
                params, opt_state, m = r.train_step(params, opt_state, tokens)
                out.append(float(m["loss"]))
        return out

    seen.clear()
    losses = [run(jax.devices()[:1]),
              run(None, **{"fp8.gemm": "pallas", "mesh.data": 2, "mesh.fsdp": 2,
                           "mesh.tensor": 2})]
    assert len(seen) >= 6, seen  # the block's GEMMs, forward and backward, per shard
    np.testing.assert_allclose(losses[1], losses[0], rtol=2e-3)
    print("OK")
    """
)


def test_the_pallas_gemm_runs_on_each_shard():
    """``fp8.gemm=pallas`` under a 2x2x2 mesh of 8 virtual devices: the kernel (its reference
    math standing in on the CPU) runs on each device's shard of every GEMM of a projection's
    forward and backward (forward and ``dx`` on a device's tokens and tensor slice, ``dW``
    summed over the token shards); loss and gradients match one device's XLA path (loss to
    1e-3, ``dx`` 2e-3, ``dW`` 1e-2 relative: BF16 partial sums), and three trainer steps of
    llama_tiny on that mesh give one device's losses (2e-3 relative)."""
    out = subprocess.run([sys.executable, "-c", SHARDED_GEMM_SCRIPT], capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr[-3000:]


EXPLICIT_SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import coat_jax

    def step(mesh, shape, spec, **options):
        with jax.set_mesh(mesh):
            p = {"w": jax.device_put(jnp.ones(shape), NamedSharding(mesh, spec))}
            opt = coat_jax.fp8_adamw(1e-3, min_size=0, **options)
            try:
                return jax.jit(opt.update)(p, jax.jit(opt.init)(p), p)[0]["w"]
            except ValueError as e:
                return str(e)

    explicit = jax.make_mesh((4,), ("model",), (AxisType.Explicit,))
    auto = jax.make_mesh((4,), ("model",), (AxisType.Auto,))
    # shards of 96 hold no whole group of 128: one line naming the param
    error = step(explicit, (256, 384), P(None, "model"))
    assert isinstance(error, str) and "\\n" not in error, error
    assert error.startswith("param ['w']: its last axis (384) is split over mesh axes "
                            "('model',) (explicit) into 4 shards"), error
    assert isinstance(step(explicit, (384,), P("model")), str)
    # groups that fit the shards, another axis sharded, or Auto axes: the same update
    want = step(auto, (256, 384), P(None, "model"))
    for mesh, spec, options in [(explicit, P(None, "model"), dict(group_size=96)),
                                (explicit, P("model", None), {}), (auto, P(None, "model"), {})]:
        got = step(mesh, (256, 384), spec, **options)
        assert not isinstance(got, str), got
        np.testing.assert_allclose(got, want, rtol=1e-6)
    print("OK")
    """
)


def test_explicit_axes_that_split_groups_are_one_line():
    """jax.make_mesh's Explicit axes put the sharding in the array's type, where splitting
    a sharded last axis into FP8 groups that straddle shards is a reshape jax refuses (a
    ShardingTypeError from inside the quantizer): fp8_adamw names the param at init."""
    out = subprocess.run([sys.executable, "-c", EXPLICIT_SCRIPT], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr[-3000:]
