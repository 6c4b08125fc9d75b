"""Memory planner: what a training step needs before it runs, and the largest batch that fits.

Two views of the same step, side by side (:func:`memory_plan`):

* **compiled**: XLA's own memory analysis of the compiled train step (arguments, outputs,
  temporaries) - what the device will allocate;
* **analytic**: params, gradients and optimizer state from their shapes, and the activations
  saved for backward from the residuals of the loss's VJP (``jax.eval_shape``), plus the
  logits of one micro-batch.

Every figure is per device: parameter, gradient and state bytes of each array's shard,
activations and logits divided over the devices that split the batch (``data x fsdp``); XLA's
analysis of a partitioned step is per device too.

:func:`largest_batch` finds the largest batch whose compiled step fits the allocator's limit,
by compiles alone (nothing runs): the compiled total at the smallest batch and at a probe from
the analytic model, then where a curve through the compiled totals nearest the limit crosses it
(:func:`batch_on_curve`), inside the bracket of the largest batch known to fit and the smallest
known not to, until the two are one step apart. The limit is the allocator's (``bytes_limit``:
``XLA_PYTHON_CLIENT_MEM_FRACTION`` of the GPU; ``train.py`` sets the allocator it assumes)
less :data:`MARGIN` for what the compiled plan does not hold.

Nothing is allocated on the device: every tree here is abstract.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from coat_jax.core import measure
from coat_jax.models.llama import LlamaConfig, loss_fn
from coat_jax.training.residuals import saved_activation_bytes_abstract
from coat_jax.training.run import Run

__all__ = [
    "MARGIN",
    "LargestBatch",
    "analysis_total",
    "batch_on_curve",
    "compiled_total",
    "device_limit",
    "format_plan",
    "largest_batch",
    "layer_workspace",
    "memory_plan",
]

MARGIN = 256 * 2**20
"""Bytes kept free beyond the compiled plan: a step's measured peak exceeded its compiled total
by 0.34-0.41 GB at batch 1 (autotuning scratch, freed before the step's own buffers) and by
nothing at the largest batches (Llama-2-7B on an H200, bench/results/e2e_llama2_7b_h200_*)."""


def _bytes(tree, shardings=None, itemsize=None) -> int:
    """Bytes of ``tree``'s leaves (of one shard each, given their ``shardings``)."""
    leaves = jax.tree.leaves(tree)
    shapes = [x.shape for x in leaves]
    if shardings is not None:
        shapes = [s.shard_shape(x) for x, s in zip(shapes, jax.tree.leaves(shardings), strict=True)]
    sizes = [itemsize or jnp.dtype(x.dtype).itemsize for x in leaves]
    return sum(math.prod(shape) * size for shape, size in zip(shapes, sizes, strict=True))


def layer_workspace(config: LlamaConfig, batch: int, seq_len: int) -> int:
    """fp32 bytes of one layer's backward working set: attention scores, probabilities and
    their gradient (unless cuDNN's flash attention runs) and the MLP's gate, up and hidden."""
    flash = jax.default_backend() == "gpu"
    attention = 0 if flash else 3 * batch * config.n_heads * seq_len * seq_len * 4
    return attention + 3 * batch * seq_len * config.ffn_dim * 4


def memory_plan(run: Run, batch_size: int | None = None) -> dict:
    """Planned bytes per device of ``run``'s train step at ``batch_size`` (default: the
    config's), compiled (XLA's analysis) and analytic; see the module docstring."""
    params, opt_state = run.abstract_state()
    batch = run.abstract_batch(batch_size)
    analysis = _compiled(run, batch_size).memory_analysis()
    accum, micro, tokens = batch.shape
    micro_tokens = jax.ShapeDtypeStruct((micro, tokens), batch.dtype)
    graph = run.graph
    activations = saved_activation_bytes_abstract(
        lambda p, t: loss_fn(nnx.merge(graph, p), t), run.params, micro_tokens, batch_dims=(micro,)
    )
    positions = tokens - 1
    if run.model.loss_chunk:  # the chunked loss holds one chunk of logits at a time
        positions = min(positions, run.model.loss_chunk)
    logits = micro * positions * run.model.vocab_size * 4
    split = run.placement.batch_shards
    activations, logits = activations // split, logits // split
    param_bytes = _bytes(run.params, run.placement.params)
    grad_itemsize = jnp.dtype(run.grad_dtype).itemsize
    grad_bytes = _bytes(run.params, run.placement.params, itemsize=grad_itemsize)
    plan = {
        "batch_size": accum * micro,
        "params": param_bytes,
        "grads": grad_bytes,
        "optimizer_state": _bytes(opt_state, run.placement.opt_state),
        "activations_estimate": activations,
        "logits_estimate": logits,
        "compiled_arguments": int(analysis.argument_size_in_bytes),
        "compiled_outputs": int(analysis.output_size_in_bytes),
        "compiled_aliased": int(analysis.alias_size_in_bytes),
        "compiled_temp": int(analysis.temp_size_in_bytes),
    }
    plan["compiled_total"] = analysis_total(analysis)
    # Whole-model bytes per parameter that live through the run: weights, gradients (not with
    # the update in the backward pass, which consumes each as it is made), state.
    n_params = sum(x.size for x in jax.tree.leaves(run.params))
    in_backward = run.optimizer.update_in_backward
    all_grads = 0 if in_backward else _bytes(run.params, itemsize=grad_itemsize)
    persistent = _bytes(run.params) + all_grads + _bytes(opt_state)
    plan["persistent_bytes_per_param"] = persistent / max(n_params, 1)
    plan["update_in_backward"] = in_backward
    # Working set of one layer's backward, fp32: the attention scores, probabilities and their
    # gradient where attention is not a fused flash kernel, and the MLP's gate/up/hidden.
    plan["workspace_estimate"] = layer_workspace(run.model, -(-micro // split), tokens - 1)
    # Temporaries. Backward frees a layer's saved activations as it produces that layer's
    # gradients, so one micro-batch peaks at max(activations + logits and their gradient,
    # gradients), plus one layer's working set; with grad_accum > 1 the fp32 accumulator
    # lives through the whole step on top.
    # The update in the backward pass holds about one gradient at a time (the largest leaf's).
    accumulator = grad_bytes if accum > 1 else 0
    backward = max(activations + 2 * logits, grad_bytes)
    if in_backward:
        largest = max((x.size for x in jax.tree.leaves(run.params)), default=0)
        backward = activations + 2 * logits + grad_bytes * largest // max(n_params, 1)
    plan["temp_estimate"] = accumulator + backward + plan["workspace_estimate"]
    plan["analytic_total"] = param_bytes + plan["optimizer_state"] + plan["temp_estimate"]
    plan["device_limit"] = device_limit(run)
    return plan


def _lowered(run: Run, batch_size: int | None):
    """``run``'s train step, as ``train.py`` calls it (:attr:`Run.loop_step`), lowered for a
    batch of ``batch_size`` (nothing runs)."""
    params, opt_state = run.abstract_state()
    with jax.set_mesh(run.placement.mesh):
        return run.loop_step.lower(params, opt_state, run.abstract_batch(batch_size))


def _compiled(run: Run, batch_size: int | None):
    """``run``'s train step compiled for a batch of ``batch_size`` (nothing runs)."""
    return _lowered(run, batch_size).compile()


def analysis_total(analysis) -> int:
    """Bytes a compiled step holds at its peak: arguments, outputs not aliased to arguments,
    temporaries (XLA's memory analysis, per device)."""
    return int(analysis.argument_size_in_bytes + analysis.output_size_in_bytes
               - analysis.alias_size_in_bytes + analysis.temp_size_in_bytes)  # fmt: skip


def compiled_total(run: Run, batch_size: int) -> int:
    """:func:`memory_plan`'s ``compiled_total`` alone (one compile, no analytic model)."""
    return analysis_total(_compiled(run, batch_size).memory_analysis())


def device_limit(run: Run) -> int | None:
    """Bytes the planner may plan for on each device: ``config.memory_limit_gb`` when set,
    else the smallest allocator limit of this process's devices in the mesh (``None`` on a
    backend that reports none, a CPU)."""
    if run.config.memory_limit_gb:
        return int(run.config.memory_limit_gb * 1e9)
    local = [d for d in run.placement.mesh.devices.flat if d.process_index == jax.process_index()]
    return measure.device_memory(local).limit


@dataclasses.dataclass(frozen=True)
class LargestBatch:
    """What :func:`largest_batch` found.

    Attributes:
      batch_size: the largest batch (sequences per step) whose compiled step fits; 0 if none.
      limit: the bytes per device it planned against (:func:`device_limit`).
      margin: bytes kept free beyond the compiled plan.
      compiled_totals: compiled bytes per device of each batch it compiled.
      allocator: the allocator's environment variables (``coat_jax.core.measure``).
      from_record: read from an earlier search of the same program (:func:`largest_batch`).
    """

    batch_size: int
    limit: int
    margin: int
    compiled_totals: dict[int, int]
    allocator: dict[str, str]
    from_record: bool = False

    def describe(self) -> str:
        """One line: the batch, the limit and the allocator settings it assumed."""
        unit, size = ("GiB", 2**30) if self.limit >= 2**30 else ("MiB", 2**20)
        totals = ", ".join(f"{b}: {t / size:.1f}" for b, t in sorted(self.compiled_totals.items()))
        return (f"largest batch that fits: {self.batch_size} (limit {self.limit / size:.1f} {unit} "
                f"per device, less {self.margin / 2**20:.0f} MiB; compiled {unit} by batch: "
                f"{totals}; allocator {_settings_text(self.allocator)}"
                f"{'; as found by an earlier search' if self.from_record else ''})")  # fmt: skip


def _settings_text(settings: dict[str, str]) -> str:
    return ", ".join(f"{k.removeprefix('XLA_PYTHON_CLIENT_')}={v}" for k, v in settings.items())


def batch_on_curve(totals: dict[int, int], room: float, step: int, lo: int,
                   hi: int | None) -> int | None:  # fmt: skip
    """The largest batch (a multiple of ``step``) that a curve through compiled totals says
    fits ``room``: a parabola through the three batches whose totals lie nearest ``room`` where
    it bends upwards (XLA's totals grow faster than linearly at large batches), else the line
    through ``lo`` (fits) and ``hi`` (does not; near the limit XLA rematerializes, which bends
    the totals down), else through the two largest batches; ``None`` where it does not rise."""
    near = sorted(totals, key=lambda b: abs(totals[b] - room))[:3]
    quad = lin = 0.0
    if len(near) == 3:
        quad, lin, const = np.polyfit(near, [totals[b] for b in near], 2)
    if quad <= 0:
        a, b = (lo, hi) if hi is not None else sorted(totals)[-2:]
        quad, (lin, const) = 0.0, np.polyfit([a, b], [totals[a], totals[b]], 1)
    if quad > 0:
        b = (-lin + math.sqrt(max(lin * lin - 4 * quad * (const - room), 0.0))) / (2 * quad)
    elif lin > 0:
        b = (room - const) / lin
    else:
        return None
    return step * math.floor(b / step)


def largest_batch(run: Run, *, limit: int | None = None, margin: int = MARGIN,
                  max_compiles: int = 8) -> LargestBatch:  # fmt: skip
    """The largest batch of ``run`` whose compiled train step fits ``limit`` - ``margin``
    bytes per device (see the module docstring). Batches move in steps of one sequence per
    device that splits the batch, times ``grad_accum``. With ``config.compile_cache_dir`` set,
    the result is kept there and an identical search later reads it (:func:`_record_path`).

    Raises:
      ValueError: no limit is known (a CPU: set ``config.memory_limit_gb``).
    """
    limit = limit or device_limit(run)
    if not limit:
        raise ValueError(
            "the largest batch needs a device memory limit: this backend reports none "
            f"({jax.default_backend()}); set config.memory_limit_gb"
        )
    room = limit - margin
    step = run.placement.batch_shards * run.config.grad_accum
    record = _record_path(run, step, limit, margin)
    if record is not None and os.path.exists(record):
        with open(record) as f:
            found = json.load(f)
        totals = {int(b): t for b, t in found["compiled_totals"].items()}
        return LargestBatch(found["batch_size"], limit, margin, totals,
                            measure.allocator_settings(), from_record=True)  # fmt: skip
    first = memory_plan(run, step)  # the analytic model's, for the first probe
    totals = {step: first["compiled_total"]}

    def compile_at(b: int) -> bool:
        totals[b] = compiled_total(run, b)
        return totals[b] <= room

    def result(b: int) -> LargestBatch:
        if record is not None:
            os.makedirs(os.path.dirname(record), exist_ok=True)
            with open(record + ".tmp", "w") as f:
                json.dump({"batch_size": b, "compiled_totals": totals}, f)
            os.replace(record + ".tmp", record)
        return LargestBatch(b, limit, margin, dict(totals), measure.allocator_settings())

    if totals[step] > room:
        return result(0)
    lo, hi = step, None
    candidate = max(_analytic_batch(first, step, room), 2 * step)
    while len(totals) < max_compiles:
        candidate = max(candidate, lo + step)
        if hi is not None:
            candidate = min(candidate, hi - step)
        if compile_at(candidate):
            lo = candidate
        else:
            hi = candidate
        if hi is not None and hi - lo <= step:
            break
        on_curve = batch_on_curve(totals, room, step, lo, hi)
        candidate = lo + step if on_curve is None else on_curve
    return result(lo)


def _record_path(run: Run, step: int, limit: int, margin: int) -> str | None:
    """Where the search's result for this program is kept, beside JAX's persistent compilation
    cache (``config.compile_cache_dir``; ``None`` when it is off): a file named by a hash of
    the step's lowered program at the smallest batch, its compiler options, the limit, the
    margin, jax's version and the device kind. A dry run's search then serves the
    ``batch_size=-1`` run after it when the two configs differ in nothing but ``batch_size``
    and what never reaches the step (the learning-rate schedule does: ``steps`` is part of
    the program)."""
    directory = run.config.compile_cache_dir
    if not directory:
        return None
    key = hashlib.sha256(_lowered(run, step).as_text().encode())
    options = run.model.policy().compiler_options()
    devices = {d.device_kind for d in run.placement.mesh.devices.flat}
    key.update(repr((options, limit, margin, jax.__version__, sorted(devices))).encode())
    return os.path.join(directory, "largest_batch", key.hexdigest()[:32] + ".json")


def _analytic_batch(plan: dict, batch: int, room: float, cap: int = 1 << 16) -> int:
    """The largest batch the analytic model of ``plan`` (at ``batch``) says fits ``room``:
    activations, logits and workspace per sequence, scaled from ``plan``."""
    per = lambda key: plan[key] / batch
    fixed = plan["params"] + plan["optimizer_state"]
    accumulator = plan["temp_estimate"] - max(
        plan["activations_estimate"] + 2 * plan["logits_estimate"], plan["grads"]
    ) - plan["workspace_estimate"]

    def total(b):
        backward = max((per("activations_estimate") + 2 * per("logits_estimate")) * b,
                       plan["grads"])  # fmt: skip
        return fixed + accumulator + backward + per("workspace_estimate") * b

    b = batch
    while b < cap and total(2 * b) <= room:  # doubling, then bisection
        b *= 2
    lo, hi = b, 2 * b
    while hi - lo > batch:
        mid = (lo + hi) // 2 // batch * batch
        lo, hi = (mid, hi) if total(mid) <= room else (lo, mid)
    return lo
def format_plan(plan: dict) -> str:
    """The plan as an aligned table, with the device limit and whether it fits."""
    gb = lambda b: f"{b / 2**30:9.3f} GiB" if b >= 2**30 else f"{b / 2**20:9.1f} MiB"
    rows = [
        ("params", plan["params"]),
        ("gradients", plan["grads"]),
        ("optimizer state", plan["optimizer_state"]),
        ("saved activations (1 micro-batch)", plan["activations_estimate"]),
        ("logits (1 micro-batch or loss chunk)", plan["logits_estimate"]),
        ("one layer's backward workspace", plan["workspace_estimate"]),
        ("temporaries, analytic", plan["temp_estimate"]),
        ("temporaries, compiled", plan["compiled_temp"]),
        ("total, analytic", plan["analytic_total"]),
        ("total, compiled", plan["compiled_total"]),
    ]
    lines = [f"  {name:36s}{gb(value)}" for name, value in rows]
    if "persistent_bytes_per_param" in plan:  # plans recorded before 2026-12-01 lack it
        lines.append(f"  {'weights+grads+state per parameter':36s}"
                     f"{plan['persistent_bytes_per_param']:9.2f} B")  # fmt: skip
    limit = plan["device_limit"]
    if limit:
        verdict = "fits" if plan["compiled_total"] <= limit else "does NOT fit"
        lines.append(f"  {'device memory (allocator limit)':36s}{gb(limit)}  -> {verdict}")
        lines.append("  (the limit: XLA_PYTHON_CLIENT_MEM_FRACTION of the GPU; allocator "
                     f"{_settings_text(measure.allocator_settings())})")  # fmt: skip
    else:
        lines.append("  device memory: unknown on this backend (host RAM)")
    return "\n".join(lines)
