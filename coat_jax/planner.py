"""Memory planner for ``train.py --dry_run``: what a training step needs, before running it.

Two views of the same step, side by side:

* **compiled**: XLA's own memory analysis of the compiled train step (arguments, outputs,
  temporaries) - what the device will allocate;
* **analytic**: params, gradients and optimizer state from their shapes, and the activations
  saved for backward from the residuals of the loss's VJP (``jax.eval_shape``), plus the
  logits of one micro-batch.

Under a mesh (a :class:`coat_jax.parallel.Placement`) every figure is per device: parameter,
gradient and state bytes of each array's shard, activations and logits divided over the devices
that split the batch (``data x fsdp``); XLA's analysis of a partitioned step is per device too.

Nothing is allocated on the device: every tree here is abstract.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from coat_jax.models.llama import LlamaConfig, loss_fn
from coat_jax.residuals import saved_activation_bytes_abstract

__all__ = ["format_plan", "layer_workspace", "memory_plan"]


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


def memory_plan(
    train_step, graph, params, opt_state, batch, model_config: LlamaConfig, placement=None,
    grad_dtype=jnp.float32,
) -> dict:  # fmt: skip
    """Planned bytes of one step (per device under ``placement``); ``params``, ``opt_state``,
    ``batch`` may be abstract; ``grad_dtype`` as the step's (``make_train_step``)."""
    compiled = train_step.lower(params, opt_state, batch).compile()
    analysis = compiled.memory_analysis()
    accum, micro, tokens = batch.shape
    micro_tokens = jax.ShapeDtypeStruct((micro, tokens), batch.dtype)
    activations = saved_activation_bytes_abstract(
        lambda p, t: loss_fn(nnx.merge(graph, p), t), params, micro_tokens, batch_dims=(micro,)
    )
    vocab = jax.eval_shape(lambda p, t: nnx.merge(graph, p)(t[:, :-1]), params, micro_tokens)
    logits = vocab.size * 4
    split = 1
    param_shardings = state_shardings = None
    if placement is not None:
        split = placement.batch_shards
        param_shardings, state_shardings = placement.params, placement.opt_state
        activations, logits = activations // split, logits // split
    param_bytes = _bytes(params, param_shardings)
    grad_bytes = _bytes(params, param_shardings, itemsize=jnp.dtype(grad_dtype).itemsize)
    plan = {
        "params": param_bytes,
        "grads": grad_bytes,
        "optimizer_state": _bytes(opt_state, state_shardings),
        "activations_estimate": activations,
        "logits_estimate": logits,
        "compiled_arguments": int(analysis.argument_size_in_bytes),
        "compiled_outputs": int(analysis.output_size_in_bytes),
        "compiled_aliased": int(analysis.alias_size_in_bytes),
        "compiled_temp": int(analysis.temp_size_in_bytes),
    }
    plan["compiled_total"] = (
        plan["compiled_arguments"]
        + plan["compiled_outputs"]
        - plan["compiled_aliased"]
        + plan["compiled_temp"]
    )
    # Working set of one layer's backward, fp32: the attention scores, probabilities and their
    # gradient where attention is not a fused flash kernel, and the MLP's gate/up/hidden.
    plan["workspace_estimate"] = layer_workspace(model_config, -(-micro // split), tokens - 1)
    # Temporaries. Backward frees a layer's saved activations as it produces that layer's
    # gradients, so one micro-batch peaks at max(activations + logits and their gradient,
    # gradients), plus one layer's working set; with grad_accum > 1 the fp32 accumulator
    # lives through the whole step on top.
    accumulator = grad_bytes if accum > 1 else 0
    backward = max(activations + 2 * logits, grad_bytes)
    plan["temp_estimate"] = accumulator + backward + plan["workspace_estimate"]
    plan["analytic_total"] = param_bytes + plan["optimizer_state"] + plan["temp_estimate"]
    stats = jax.devices()[0].memory_stats() or {}
    plan["device_limit"] = int(stats["bytes_limit"]) if "bytes_limit" in stats else None
    return plan


def format_plan(plan: dict) -> str:
    gb = lambda b: f"{b / 2**30:9.3f} GiB" if b >= 2**30 else f"{b / 2**20:9.1f} MiB"
    rows = [
        ("params", plan["params"]),
        ("gradients", plan["grads"]),
        ("optimizer state", plan["optimizer_state"]),
        ("saved activations (1 micro-batch)", plan["activations_estimate"]),
        ("logits (1 micro-batch, fp32)", plan["logits_estimate"]),
        ("one layer's backward workspace", plan["workspace_estimate"]),
        ("temporaries, analytic", plan["temp_estimate"]),
        ("temporaries, compiled", plan["compiled_temp"]),
        ("total, analytic", plan["analytic_total"]),
        ("total, compiled", plan["compiled_total"]),
    ]
    lines = [f"  {name:36s}{gb(value)}" for name, value in rows]
    limit = plan["device_limit"]
    if limit:
        verdict = "fits" if plan["compiled_total"] <= limit else "does NOT fit"
        lines.append(f"  {'device memory (allocator limit)':36s}{gb(limit)}  -> {verdict}")
        lines.append("  (the limit is XLA_PYTHON_CLIENT_MEM_FRACTION of the GPU, 0.75 by default)")
    else:
        lines.append("  device memory: unknown on this backend (host RAM)")
    return "\n".join(lines)
