"""The jitted train and eval steps, and the batches they read.

One optimizer step consumes ``batch (grad_accum, micro_batch, seq_len + 1)`` tokens, or a pair
``(tokens, mask (grad_accum, micro_batch, seq_len))`` whose mask selects the targets the loss
counts (fine-tuning on responses only): gradients are summed over the micro-batches in fp32
under ``lax.scan``, each weighted by its share of the step's targets
(:func:`micro_batch_weights`), so the step's loss is the mean over all of them, as with one
micro-batch. Weight quantization inside the model is loop-invariant there, so XLA computes the
FP8 weights once per step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from coat_jax.core import master
from coat_jax.models.llama import loss_fn
from coat_jax.ops import master_weights
from coat_jax.training import parallel
from coat_jax.training.data import ExampleSampler
from coat_jax.training.optimizer import global_norm_fp32

__all__ = [
    "FlatTrainStep",
    "NonFiniteSteps",
    "NonFiniteStepsError",
    "frozen_heap",
    "global_batch",
    "make_eval_step",
    "make_train_step",
    "micro_batch_weights",
]


def micro_batch_weights(batch) -> jax.Array:
    """``(grad_accum,)`` fp32 weights of the micro-batches' losses (and gradients) in a step's:
    ``1 / grad_accum`` each for tokens, and for ``(tokens, mask)`` each micro-batch's share of
    the step's targets, ``n_i / sum_j n_j`` (1 / grad_accum each where there are none).

    A micro-batch's loss is the mean over its own targets, so with masks of different sizes
    (responses of different lengths) the plain average of the micro-batch losses weighs a
    target by ``1 / (grad_accum n_i)``; weighted by ``n_i / sum_j n_j``, the step's loss and
    gradient are the mean over all of its targets, as with one micro-batch of the same rows."""
    if not isinstance(batch, tuple):
        micro_batches = batch.shape[0]
        return jnp.full((micro_batches,), 1.0 / micro_batches, jnp.float32)
    mask = batch[1]
    counts = mask.reshape(mask.shape[0], -1).astype(jnp.float32).sum(axis=1)
    total = counts.sum()
    even = jnp.full_like(counts, 1.0 / counts.shape[0])
    return jnp.where(total > 0, counts / jnp.maximum(total, 1.0), even)


def _batch_loss(graph, params, batch):
    tokens, mask = batch if isinstance(batch, tuple) else (batch, None)
    return loss_fn(nnx.merge(graph, params), tokens, mask)


def global_batch(sampler, index: int, split: str, shape, target):
    """Batch ``index`` of ``split`` as global arrays with sharding ``target``, each process
    reading only its rows (:func:`coat_jax.training.parallel.sharded_batch`): tokens of
    ``shape``, or ``(tokens, mask)`` from an :class:`~coat_jax.training.data.ExampleSampler`
    (mask: ``seq_len``)."""
    rows = lambda r: sampler.batch(index, split, rows=r)
    if not isinstance(sampler, ExampleSampler):
        return parallel.sharded_batch(rows, shape, target)
    tokens = parallel.sharded_batch(lambda r: rows(r)[0], shape, target)
    mask = parallel.sharded_batch(lambda r: rows(r)[1], (*shape[:-1], shape[-1] - 1), target)
    return tokens, mask


def make_train_step(
    graph, optimizer, placement=None, fused_update=None, compiler_options=None,
    grad_dtype=jnp.float32, skip_nonfinite=True, master_bits=None, update_in_backward=False,
    treedef=None,
):  # fmt: skip
    """``step(params, opt_state, batch) -> (params, opt_state, {loss, grad_norm, skipped})``,
    jitted with params and optimizer state donated; with ``treedef`` (the structure of
    ``(params, opt_state)``), the same step on the flat list of their arrays, a
    :class:`FlatTrainStep`; with a :class:`~coat_jax.training.parallel.Placement`,
    its inputs and outputs stay in their shards (call it under ``jax.set_mesh(placement.mesh)``).
    ``optimizer`` is an optax transformation; ``fused_update`` (from
    :func:`coat_jax.training.optimizer.make_fused_update`) replaces ``optimizer.update`` +
    ``optax.apply_updates`` when given; ``compiler_options`` (XLA's: the precision policy's
    ``compiler_options()``) go to ``jax.jit``.

    ``grad_dtype``: ``float32`` (default) differentiates the fp32 master weights. ``bfloat16``
    differentiates a bf16 view of them (the forward reads bf16-rounded weights; an FP8 GEMM
    weight is rounded to FP8 from it) so that each gradient comes out in bf16: half the bytes
    of the largest buffer after the weights (Llama-2-7B: 13.5 GB instead of 27). The fused
    update consumes bf16 gradients as they are (its math is fp32); the optax chain gets them
    upcast to fp32 (its own arithmetic follows the gradient's dtype), and with ``grad_accum``
    above 1 the micro-batch gradients are summed in fp32, so the saving needs both the fused
    update and one micro-batch per step. The gradient norm is always taken in fp32.

    ``master_bits``: 16 or 8 for BF16 master weights (``coat_jax.ops.master_weights``):
    ``params`` are then BF16, ``opt_state`` a ``MasterWeightsState`` whose ``inner`` is
    ``optimizer``'s state, and each update runs on the fp32 weights rebuilt from both and
    splits them again (with 16 bits bit-identical to fp32 master weights and
    ``grad_dtype=bfloat16``, whose BF16 view rounds the same way,
    ``coat_jax.core.master.bf16_part``).

    ``skip_nonfinite``: a step whose loss or gradient norm is NaN or Inf returns ``params`` and
    ``opt_state`` unchanged (the update runs under ``lax.cond``; no step count advances) and
    ``skipped = True``, so no non-finite value ever reaches the state (``optax.apply_if_finite``
    for the whole step, at the cost of two scalar tests).

    ``update_in_backward``: the backward pass and the update form one computation in which each
    parameter's update needs only its own gradient (``optimizer``'s clipping must be
    :func:`~coat_jax.ops.clipping.clip_by_previous_global_norm`), so XLA applies it as soon as
    that gradient exists and the step never holds all gradients at once. The non-finite test
    then reads the loss alone and keeps each array's old value by a select (no ``lax.cond``
    around the backward pass: on XLA's CPU backend the FP8 backward computed inside one came
    out different from the same backward outside it); the fused update takes the test as
    its ``skip`` flag instead, so that its kernel still updates in place (a select after it
    would keep the old parameters and state beside the new); a finite loss whose gradients
    are not finite updates the parameters as ``optax.adamw`` would (the next steps' losses are then
    non-finite and skipped, and no checkpoint keeps such a state). One micro-batch a step.
    """
    if jnp.dtype(grad_dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"grad_dtype must be float32 or bfloat16, got {jnp.dtype(grad_dtype)}")
    low = jnp.dtype(grad_dtype) != jnp.float32

    def micro_loss(params, tokens):
        return _batch_loss(graph, params, tokens)

    def apply(state, grads, skip=None):
        """``state`` ``(params, opt_state)`` after the optimizer step on ``grads``; ``skip``
        (traced), where given, goes to the fused update, which then returns ``state``
        unchanged where it is true."""
        flag = {} if skip is None else {"skip": skip}

        def fp32_update(params, opt_state):
            if fused_update is not None:
                return fused_update(params, grads, opt_state, **flag)
            g32 = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
            updates, opt_state = optimizer.update(g32, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        if master_bits is None:
            return fp32_update(*state)
        if fused_update is not None:  # the kernel reads and writes the parts
            params, opt_state = state
            params, remainder, inner = fused_update(params, grads, opt_state.inner,
                                                    opt_state.remainder, **flag)  # fmt: skip
            return params, master_weights.MasterWeightsState(remainder, inner)
        return master_weights.apply_exactly(*state, master_bits, fp32_update)

    def step_in_backward(params, opt_state, batch):
        wrt = jax.tree.map(_bf16_view, params) if low else params
        if jax.tree.leaves(batch)[0].shape[0] != 1:
            raise ValueError("update_in_backward runs one micro-batch a step (grad_accum=1)")
        tokens = jax.tree.map(lambda x: x[0], batch)
        loss, grads = jax.value_and_grad(micro_loss)(wrt, tokens)
        finite = jnp.isfinite(loss)
        if skip_nonfinite and fused_update is not None:  # the kernel keeps what it skips
            state = apply((params, opt_state), grads, skip=~finite)
        else:
            state = apply((params, opt_state), grads)
            if skip_nonfinite:  # per array: no update waits for another's gradient
                keep = lambda new, old: jnp.where(finite, new, old)
                state = jax.tree.map(keep, state, (params, opt_state))
        return *state, {"loss": loss, "grad_norm": global_norm_fp32(grads), "skipped": ~finite}

    def step(params, opt_state, batch):
        wrt = jax.tree.map(_bf16_view, params) if low else params

        def accumulate(grads, tokens_and_weight):
            tokens, weight = tokens_and_weight
            loss, g = jax.value_and_grad(micro_loss)(wrt, tokens)
            return jax.tree.map(lambda a, b: a + weight * b.astype(a.dtype), grads, g), loss

        micro_batches = jax.tree.leaves(batch)[0].shape[0]
        weights = micro_batch_weights(batch)
        if low and micro_batches == 1:  # no fp32 accumulator: the gradients stay bf16
            loss, grads = jax.value_and_grad(micro_loss)(wrt, jax.tree.map(lambda x: x[0], batch))
            losses = loss[None]
        else:
            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
            grads, losses = jax.lax.scan(accumulate, zeros, (batch, weights))
        loss, grad_norm = (weights * losses).sum(), global_norm_fp32(grads)
        update = lambda state: apply(state, grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        if skip_nonfinite:
            params, opt_state = jax.lax.cond(finite, update, lambda s: s, (params, opt_state))
        else:
            params, opt_state = update((params, opt_state))
        return params, opt_state, {"loss": loss, "grad_norm": grad_norm, "skipped": ~finite}

    step = step_in_backward if update_in_backward else step
    if treedef is not None:
        return FlatTrainStep(_jit_on_leaves(step, treedef, placement, compiler_options), treedef)
    if placement is None:
        return jax.jit(step, donate_argnums=(0, 1), compiler_options=compiler_options)
    p, s = placement.params, placement.opt_state
    return jax.jit(
        step,
        in_shardings=(p, s, placement.batch),
        out_shardings=(p, s, placement.replicated),
        donate_argnums=(0, 1),
        compiler_options=compiler_options,
    )


def _jit_on_leaves(step, treedef, placement, compiler_options):
    """``step`` jitted on ``(leaves, batch) -> (leaves, metrics)``, the leaves those of
    ``(params, opt_state)`` in ``treedef``'s order (donated, kept in ``placement``'s shards).
    XLA names its module ``jit_step_on_leaves``: dumps filtered on ``step`` find it."""

    def step_on_leaves(leaves, batch):
        params, opt_state, metrics = step(*treedef.unflatten(leaves), batch)
        return treedef.flatten_up_to((params, opt_state)), metrics

    if placement is None:
        return jax.jit(step_on_leaves, donate_argnums=0, compiler_options=compiler_options)
    shards = treedef.flatten_up_to((placement.params, placement.opt_state))
    return jax.jit(
        step_on_leaves,
        in_shardings=(shards, placement.batch),
        out_shardings=(shards, placement.replicated),
        donate_argnums=0,
        compiler_options=compiler_options,
    )


@dataclasses.dataclass(frozen=True)
class FlatTrainStep:
    """The train step on the flat list of ``(params, opt_state)``'s arrays: what a training
    loop carries from step to step (:func:`make_train_step` with ``treedef``).

    The computation is the tree step's; only the call differs. flax NNX's ``Variable``s are
    Python pytree nodes, so a jitted call on ``(params, opt_state)`` flattens every array out
    of them and wraps every result back, in Python, on each step: on an H200 the 114M COAT
    step (1,031 arrays) returned to the host after 15.6 ms instead of 9.9 ms on the flat list,
    and 50 steps back to back took 34.0 ms a step instead of 23.9
    (``bench/results/host_dispatch_114m_coat_flat_h200_2026-12-03.json``); through
    ``train.py`` its 50-step windows took 24.3-28.7 ms instead of 24.4-38.9, alternating
    (``pending_gpu_part31_h200_2026-12-03.log``). The loop flattens once (:meth:`flatten`)
    and rebuilds the trees only where it needs them (:meth:`unflatten`: a checkpoint, an
    eval); neither copies an array.

    Attributes:
      step: ``(leaves, batch) -> (leaves, metrics)``, jitted, ``leaves`` donated.
      treedef: the structure of ``(params, opt_state)``.
    """

    step: Any
    treedef: Any

    def flatten(self, params, opt_state) -> list:
        """The arrays of ``(params, opt_state)`` in the step's order.

        Raises:
          ValueError: their structure is not the one the step was built for.
        """
        leaves, treedef = jax.tree.flatten((params, opt_state))
        if treedef != self.treedef:
            raise ValueError(
                f"(params, opt_state) has {treedef.num_leaves} arrays in a structure other than "
                f"the train step's ({self.treedef.num_leaves} arrays): a state made for another "
                "config or optimizer"
            )
        return leaves

    def unflatten(self, leaves) -> tuple:
        """``(params, opt_state)`` around ``leaves`` (the same arrays)."""
        return self.treedef.unflatten(leaves)

    def __call__(self, leaves, batch):
        return self.step(leaves, batch)

    def lower(self, params, opt_state, batch):
        """The step lowered for ``(params, opt_state)`` (arrays or ``jax.ShapeDtypeStruct``s)
        and ``batch``, as :meth:`__call__` will run it."""
        return self.step.lower(self.flatten(params, opt_state), batch)


def _bf16_view(p):
    """What a model computing with ``grad_dtype=bfloat16`` reads of a weight: fp32 rounded
    as BF16 master weights keep it (:func:`coat_jax.core.master.bf16_part`)."""
    return master.bf16_part(p) if p.dtype == jnp.float32 else p.astype(jnp.bfloat16)


def make_eval_step(graph, placement=None):
    """``eval_step(params, batch) -> loss``, jitted (sharded like the train step; ``batch``:
    tokens or ``(tokens, mask)``)."""
    loss = lambda params, batch: _batch_loss(graph, params, batch)
    if placement is None:
        return jax.jit(loss)
    return jax.jit(
        loss,
        in_shardings=(placement.params, placement.eval_batch),
        out_shardings=placement.replicated,
    )


class NonFiniteStepsError(FloatingPointError):
    """More steps in a row had a non-finite loss or gradient norm than the run allows."""


class NonFiniteSteps:
    """Counts the steps :func:`make_train_step` skipped (its ``skipped`` metric), and stops
    the run when more than ``allowed`` come in a row.

    Each step's metrics are read one step late (:meth:`record`), so the host never waits for
    the step it has just dispatched; :meth:`flush` reads the one still held (before a log line
    or a checkpoint, and at the end).

    Args:
      allowed: consecutive skipped steps tolerated (``config.skip_nonfinite``; 0: none).
      log: where each skipped step is reported, one line each.
    """

    def __init__(self, allowed: int, log=print):
        self.allowed, self.log = allowed, log
        self.total = self.in_a_row = 0
        self._held = None  # (step, metrics) of the last step recorded and not yet read

    def record(self, step: int, metrics) -> None:
        """Reads the step recorded before (waits for it only), then holds step ``step``'s."""
        self.flush()
        self._held = (step, metrics)

    def flush(self) -> None:
        """Reads the held step's metrics, if any.

        Raises:
          NonFiniteStepsError: the ``allowed + 1``-th non-finite step in a row.
        """
        if self._held is None:
            return
        (step, metrics), self._held = self._held, None
        if not bool(metrics["skipped"]):
            self.in_a_row = 0
            return
        self.total += 1
        self.in_a_row += 1
        loss, norm = float(metrics["loss"]), float(metrics["grad_norm"])
        self.log(f"step {step}: loss {loss:.4g}, gradient norm {norm:.4g}: not finite; "
                 "skipped (parameters and optimizer state unchanged)")  # fmt: skip
        if self.in_a_row > self.allowed:
            raise NonFiniteStepsError(
                f"{self.in_a_row} steps in a row up to step {step} had a non-finite loss or "
                f"gradient norm (config.skip_nonfinite={self.allowed}); stopping. No state was "
                "updated from them, every checkpoint is finite; the newest may still diverge: "
                "roll back with --config.resume=True --config.resume_step=<an earlier step>, "
                "with a lower config.optimizer.lr or checked data"
            )


@contextlib.contextmanager
def frozen_heap():
    """A training loop's garbage collection: yields ``freeze``, to call where new long-lived
    objects exist (after the first step, after an eval: jax's traces and compiled
    executables, the model's graph, the data); each call collects garbage once, then moves every
    live Python object to the interpreter's permanent generation (:func:`gc.freeze`), so that
    later collections walk only what the loop itself allocates. On exit the frozen objects
    return to the collector (:func:`gc.unfreeze`), so a process that goes on after the loop
    (tests, notebooks) frees their cycles as before.

    A training process holds ~4x10^5 objects after its first step, and every full collection
    walked them all: ``train.py`` on the CPU (``configs/llama_tiny.py``, 600 steps of ~30 ms)
    paused 0.40 s in one full collection inside its loop, enqueuing nothing; frozen, its
    loop's full collections took 0.014 and 0.007 s.
    """

    def freeze():
        gc.collect()
        gc.freeze()

    try:
        yield freeze
    finally:
        gc.unfreeze()
