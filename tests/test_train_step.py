"""coat_jax.training.step and .optimizer: the jitted train step, gradient accumulation, bf16
gradients, and the fused FP8 AdamW update against the optax chain it replaces."""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny import assert_trains_identically

from coat_jax.models.llama import Llama
from coat_jax.training import configs
from coat_jax.training.optimizer import make_fused_update, make_optimizer
from coat_jax.training.step import make_train_step

ROOT = pathlib.Path(__file__).resolve().parents[1]


def tiny(precision=None, **optimizer):
    """llama_tiny's config (its own precision unless ``precision`` is given), model config,
    graph and (real) params."""
    config = configs.load_file(str(ROOT / "configs" / "llama_tiny.py"))
    if precision is not None:
        config.precision = precision
    config.optimizer.update(**optimizer)
    model_config = configs.llama_config(config)
    graph, params = nnx.split(Llama(model_config, rngs=nnx.Rngs(0)))
    return config, model_config, graph, params


@pytest.mark.xla_cpu  # reads XLA:CPU's optimized HLO (XLA:GPU names its fusions otherwise)
def test_fp8_weights_are_quantized_once_per_step_not_per_micro_batch():
    """With grad_accum > 1, XLA hoists the (loop-invariant) weight quantization out of the
    micro-batch loop: no FP8 weight-shaped value is produced inside the loop body."""
    config, model_config, graph, params = tiny()
    optimizer = make_optimizer(config.optimizer, config.steps).tx
    step = make_train_step(graph, optimizer)
    batch = jnp.zeros((4, 2, 65), jnp.int32)
    hlo = step.lower(params, optimizer.init(params), batch).compile().as_text()
    computations, current = {}, None
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?(%?[\w.\-]+) .*\{$", line)
        if header:
            current = computations.setdefault(header.group(1), [])
        elif current is not None:
            current.append(line)
    (body,) = re.findall(r"while\(.*?body=(%?[\w.\-]+)", hlo)
    inside, todo = {body}, [body]
    while todo:
        for line in computations.get(todo.pop(), []):
            for callee in re.findall(r"(?:calls|to_apply|body|condition)=(%?[\w.\-]+)", line):
                if callee not in inside:
                    inside.add(callee)
                    todo.append(callee)
    d, f = model_config.dim, model_config.ffn_dim
    kv = model_config.kv_heads * model_config.head_dim
    shapes = "|".join(f"{a},{b}" for a, b in [(d, d), (d, kv), (d, f), (f, d)])
    pattern = re.compile(rf"= f8e4m3fn\[({shapes})\]")

    def count(names):
        return sum(len(pattern.findall(line)) for n in names for line in computations[n])

    assert count(set(computations) - inside) > 0
    assert count(inside) == 0


def test_requantized_weights_train_bit_identically():
    """``fp8.saved_weights=requantize`` through the trainer's step (llama_tiny, COAT, 3 steps,
    fp32 and BF16 master weights): losses and weights equal the default's bit for bit."""
    for master in ("fp32", "bf16+16"):
        assert_trains_identically({"optimizer.master_weights": master}, "fp8.saved_weights",
                                  ("fp8", "requantize"))  # fmt: skip


@pytest.mark.slow
def test_fused_optimizer_step_matches_the_optax_chain():
    """``make_fused_update`` (the adam_update kernel, interpreted here) against
    ``make_optimizer``'s chain + ``apply_updates``, from the same start over 3 steps with
    clipping active: losses and parameters to fp32 rounding of the moments' FP8 codes (a code one
    step apart moves a parameter by at most lr x the update's change), the state's structure
    and every count identical."""
    config, model_config, graph, params = tiny(kernels="interpret", grad_clip=0.05, warmup_steps=1)
    setup = make_optimizer(config.optimizer, 3)
    optimizer, fused = setup.tx, make_fused_update(setup)
    assert fused is not None
    config.optimizer.kernels = "reference"
    assert make_fused_update(make_optimizer(config.optimizer, 3)) is None
    runs = {}
    for name, update in (("chain", None), ("fused", fused)):
        step = make_train_step(graph, optimizer, fused_update=update)
        p, s = jax.tree.map(jnp.copy, params), optimizer.init(params)
        losses = []
        for i in range(3):
            batch = jax.random.randint(jax.random.key(i), (1, 4, 33), 0, model_config.vocab_size)
            p, s, metrics = step(p, s, batch)
            losses.append(float(metrics["loss"]))
        runs[name] = (p, s, losses)
    (p_c, s_c, l_c), (p_f, s_f, l_f) = runs["chain"], runs["fused"]
    assert metrics["grad_norm"] > 0.05  # clipping was active
    np.testing.assert_allclose(l_f, l_c, rtol=1e-5)
    assert jax.tree.structure(s_f) == jax.tree.structure(s_c)
    counts = lambda s: [x for x in jax.tree.leaves(s) if x.dtype == jnp.int32 and x.ndim == 0]
    assert [int(c) for c in counts(s_f)] == [int(c) for c in counts(s_c)]
    assert int(counts(s_f)[0]) == 3
    lr = config.optimizer.lr
    for a, b in zip(jax.tree.leaves(p_f), jax.tree.leaves(p_c), strict=True):
        np.testing.assert_allclose(a, b, atol=0.05 * lr, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_bf16_gradients_reach_the_fused_update_and_train_like_fp32(grad_accum):
    """grad_dtype=bfloat16: with one micro-batch the fused update receives bf16 gradients (no
    fp32 buffer), with two they are summed in fp32; the chain always gets fp32. Losses over 4
    steps follow the fp32-gradient run (bf16 rounding of weights and gradients: 1%; measured
    at most 0.11% over 10 batches), the gradient norm is an fp32 scalar. The model computes
    in BF16: under COAT, E5M2's rounding of every gradient re-rolls with any perturbation and
    the two runs' losses drifted 0.3-2.3% apart by step 4 (8 batches), more than the rounding
    this test is about."""
    config, model_config, graph, params = tiny("bf16", kernels="interpret", warmup_steps=1)
    setup = make_optimizer(config.optimizer, 4)
    optimizer, fused = setup.tx, make_fused_update(setup)
    seen = []

    def spy(params, grads, opt_state):  # runs while tracing
        seen.append({jnp.dtype(g.dtype).name for g in jax.tree.leaves(grads)})
        return fused(params, grads, opt_state)

    shape = (grad_accum, 4 // grad_accum, 33)
    losses = {}
    for dtype, update in (("float32", fused), ("bfloat16", spy), ("chain", None)):
        step = make_train_step(
            graph, optimizer, fused_update=update,
            grad_dtype=jnp.float32 if dtype == "chain" else dtype,
        )  # fmt: skip
        p, s = jax.tree.map(jnp.copy, params), optimizer.init(params)
        losses[dtype] = []
        batch = jax.random.randint(jax.random.key(0), shape, 0, model_config.vocab_size)
        for _ in range(4):  # one batch, learnt
            p, s, metrics = step(p, s, batch)
            losses[dtype].append(float(metrics["loss"]))
        assert metrics["grad_norm"].dtype == jnp.float32
    assert seen == [{"bfloat16"}] if grad_accum == 1 else seen == [{"float32"}]
    np.testing.assert_allclose(losses["bfloat16"], losses["float32"], rtol=1e-2)
    assert losses["float32"][-1] < losses["float32"][0]
    with pytest.raises(ValueError, match="grad_dtype"):
        make_train_step(graph, optimizer, grad_dtype=jnp.float16)


def test_bf16_gradients_sum_embedding_rows_in_fp32():
    """With grad_dtype=bfloat16 every scatter-add of the step (the embedding gradient sums the
    rows of repeated tokens) runs in fp32, the result cast once: a bf16 scatter-add rounds at
    each repeat (and runs as compare-and-swap loops on a GPU)."""
    config, model_config, graph, params = tiny()
    optimizer = make_optimizer(config.optimizer, config.steps).tx
    step = make_train_step(graph, optimizer, grad_dtype=jnp.bfloat16)
    batch = jax.ShapeDtypeStruct((1, 2, 33), jnp.int32)
    jaxpr = str(jax.make_jaxpr(step)(params, optimizer.init(params), batch))
    scatters = re.findall(r":(\w+)\[([\d,]*)\] = scatter-add", jaxpr)
    table = f"{model_config.vocab_size},{model_config.dim}"
    assert ("f32", table) in scatters, scatters
    assert all(dtype == "f32" for dtype, _ in scatters), scatters


class _Node:
    """A Python object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self):
        self.me = self


def _dropped_cycle():
    import weakref

    node = _Node()
    return weakref.ref(node)  # the cycle is unreachable once this returns


def test_frozen_heap_keeps_setup_out_of_collections_and_frees_the_loop_s_cycles():
    import gc
    import weakref

    from coat_jax.training.step import frozen_heap

    before = gc.get_freeze_count()
    with frozen_heap() as freeze:
        setup = _Node()  # alive at the freeze: frozen
        dropped_before = _dropped_cycle()  # garbage at the freeze: collected by it
        freeze()
        assert dropped_before() is None
        assert gc.get_freeze_count() > before
        setup_ref = weakref.ref(setup)
        del setup  # a frozen cycle is not collected while the loop runs...
        in_loop = _dropped_cycle()  # ...but what the loop allocates is
        gc.collect()
        assert in_loop() is None and setup_ref() is not None
    assert gc.get_freeze_count() == 0  # ...and on exit everything returns to the collector
    gc.collect()
    assert setup_ref() is None


def test_the_loop_step_on_flat_arrays_is_the_tree_step():
    """``Run.loop_step`` (what train.py calls) computes the tree step: after two steps from
    the same state its arrays and loss equal ``Run.train_step``'s bit for bit; ``unflatten``
    hands back the very arrays, and a state of another structure is refused in one line."""
    from coat_jax.training.run import assemble

    config = configs.load_file(str(ROOT / "configs" / "llama.py"))
    config.update(batch_size=2, seq_len=32)
    run = assemble(config)
    with jax.set_mesh(run.placement.mesh):
        batch = jax.random.randint(jax.random.key(1), run.batch_shape(), 0, 256)
        state = run.create()
        leaves = [jnp.copy(x) for x in run.loop_step.flatten(*state)]  # the tree call donates
        for _ in range(2):
            *state, m_tree = run.train_step(*state, batch)
            leaves, m_flat = run.loop_step(leaves, batch)
    for a, b in zip(jax.tree.leaves(state), leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(m_tree["loss"]) == float(m_flat["loss"])
    params, opt_state = run.loop_step.unflatten(leaves)
    assert all(a is b for a, b in zip(jax.tree.leaves((params, opt_state)), leaves, strict=True))
    with pytest.raises(ValueError, match="structure other than the train step's"):
        run.loop_step.flatten(params, None)


def test_micro_batches_of_masked_rows_weigh_each_target_as_one_batch():
    """grad_accum=2 on rows whose masks count 1 and 29 targets: the step's loss and gradient
    are the mean over all targets, as one micro-batch of the same rows gives (fp32, SGD with
    lr 1 so that the parameters' change is the gradient; tolerance: fp32 summation order,
    1e-4 of each leaf's largest element). The plain mean of the two micro-batch losses, used
    before, weighed the lone target of the first micro-batch 29x the others."""
    import optax

    from coat_jax.training.step import micro_batch_weights

    _, model_config, graph, params = tiny("fp32")
    tokens = jax.random.randint(jax.random.key(1), (4, 33), 0, model_config.vocab_size)
    mask = np.zeros((4, 32), bool)
    mask[0, 5] = True  # micro-batch 0: rows 0-1, one target
    mask[2, 3:18] = mask[3, 10:24] = True  # micro-batch 1: 29 targets
    results = {}
    for accum in (1, 2):
        step = make_train_step(graph, optax.sgd(1.0), skip_nonfinite=False)
        rows = 4 // accum
        batch = (tokens.reshape(accum, rows, 33), jnp.asarray(mask.reshape(accum, rows, 32)))
        p, _, metrics = step(jax.tree.map(jnp.copy, params), optax.sgd(1.0).init(params), batch)
        results[accum] = (float(metrics["loss"]), jax.tree.leaves(p))
    np.testing.assert_allclose(results[2][0], results[1][0], rtol=1e-6)
    for a, b, p0 in zip(results[2][1], results[1][1], jax.tree.leaves(params), strict=True):
        scale = float(jnp.abs(b - p0).max())  # cancellation in fp32 sums: relative to the leaf
        np.testing.assert_allclose(a - p0, b - p0, rtol=1e-4, atol=1e-4 * scale)
    weights = micro_batch_weights((tokens.reshape(2, 2, 33), jnp.asarray(mask.reshape(2, 2, 32))))
    np.testing.assert_allclose(weights, [1 / 30, 29 / 30], rtol=1e-6)
    no_targets = jnp.zeros((2, 2, 32), bool)
    even = micro_batch_weights((tokens.reshape(2, 2, 33), no_targets))
    np.testing.assert_array_equal(even, [0.5, 0.5])
    np.testing.assert_array_equal(micro_batch_weights(tokens.reshape(4, 1, 33)), [0.25] * 4)
