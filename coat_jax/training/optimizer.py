"""The optimizer a training config asks for, and its fused update.

:func:`make_optimizer` builds from ``config.optimizer`` the optax chain (global-norm clipping,
by this step's norm or, with ``update_in_backward``, the previous step's; then ``optax.adamw``
or ``coat_jax.fp8_adamw``, warmup + cosine learning rate) and records the hyperparameters it
used (:class:`OptimizerSetup`). :func:`make_fused_update` builds, from the
same record, the trainer's one-pass FP8 AdamW update (``coat_jax.ops.fused_update``) where the
kernel runs: the chain and the fused update cannot disagree on a hyperparameter, and the state
keeps the chain's structure, so checkpoints do not depend on which path ran.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from coat_jax.core.adam import ScaleByFp8AdamState
from coat_jax.ops import clipping, fused_update, optim
from coat_jax.ops.master_weights import master_weights
from coat_jax.training.configs import MASTER_WEIGHTS
from pallas_kernels import dispatch

__all__ = [
    "OptimizerSetup",
    "decay_mask",
    "global_norm_fp32",
    "make_fused_update",
    "make_optimizer",
]


def decay_mask(params):
    """Decay matrices only: no decay on norms, biases or (by default) embeddings."""
    return jax.tree_util.tree_map_with_path(
        lambda path, p: p.ndim >= 2 and "embed" not in jax.tree_util.keystr(path), params
    )


def _matrices(params):
    return jax.tree.map(lambda x: x.ndim >= 2, params)


global_norm_fp32 = clipping.norm_fp32
"""``optax.tree.norm`` with every leaf read as fp32 (a bf16 gradient's squares summed in fp32;
XLA fuses the casts into the reduction, nothing is copied)."""


@dataclasses.dataclass(frozen=True)
class OptimizerSetup:
    """An optimizer built from a config, and the values it was built with.

    Attributes:
      tx: what ``init`` runs: the optax chain, wrapped by
        :func:`~coat_jax.ops.master_weights.master_weights` when ``master_bits`` is set.
      chain: the optax chain itself (what the unfused update runs on fp32 weights).
      master_bits: remainder bits of BF16 master weights (16 or 8), or ``None`` (fp32).
      schedule: the learning-rate schedule (a function of the step count).
      name: ``"adamw"`` or ``"fp8_adamw"``.
      adamw: the AdamW keyword arguments both paths take (``b1``, ``b2``, ``eps``,
        ``weight_decay``, ``mask``).
      grad_clip: global-norm clipping threshold (0: none).
      kernels: the ``kernels=`` option of the FP8 optimizer (``pallas_kernels.dispatch``).
      update_in_backward: clipping by the previous step's norm
        (:func:`coat_jax.ops.clipping.clip_by_previous_global_norm`), so that each update
        needs only its own gradient (``config.optimizer.update_in_backward``).
    """

    tx: optax.GradientTransformation
    chain: optax.GradientTransformation
    master_bits: int | None
    schedule: optax.Schedule
    name: str
    adamw: dict[str, Any]
    grad_clip: float
    kernels: str
    update_in_backward: bool = False


def make_optimizer(o, steps: int) -> OptimizerSetup:
    """``config.optimizer`` ``o`` as an :class:`OptimizerSetup`: global-norm clipping, then
    AdamW or FP8 AdamW with warmup + cosine decay over ``o.decay_steps`` steps (``steps``
    when 0)."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=o.lr,
        warmup_steps=o.warmup_steps,
        decay_steps=o.decay_steps or steps,
        end_value=o.lr * o.min_lr_ratio,
    )
    mask = _matrices if o.decay_embeddings else decay_mask
    adamw = dict(b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=mask)
    if o.name == "adamw":
        tx = optax.adamw(schedule, **adamw)
    else:
        tx = optim.fp8_adamw(
            schedule,
            **adamw,
            group_size=o.group_size,
            mu_format=o.mu_format,
            nu_format=o.nu_format,
            expansion=o.expansion,
            min_size=o.min_size,
            kernels=o.kernels,
        )
    in_backward = bool(o.get("update_in_backward", False))
    if o.grad_clip > 0:
        clip = clipping.clip_by_previous_global_norm if in_backward else optax.clip_by_global_norm
        tx = optax.chain(clip(o.grad_clip), tx)
    bits = MASTER_WEIGHTS[o.get("master_weights", "fp32")]
    wrapped = tx if bits is None else master_weights(tx, bits)
    return OptimizerSetup(wrapped, tx, bits, schedule, o.name, adamw, float(o.grad_clip),
                          o.kernels, in_backward)  # fmt: skip


def _counted(s) -> bool:
    """An optax state NamedTuple with a step ``count`` (Adam's, a schedule's)."""
    return isinstance(s, tuple) and "count" in getattr(s, "_fields", ())


def make_fused_update(setup: OptimizerSetup, placement=None) -> Callable | None:
    """``update(params, grads, opt_state) -> (params, opt_state)``: ``setup``'s step (clipping,
    FP8 AdamW, ``optax.apply_updates``) as one fused Pallas pass per parameter, or ``None``
    where the kernel does not run. With BF16 master weights, ``update(params, grads,
    opt_state, remainder) -> (params, remainder, opt_state)``.

    It runs for ``fp8_adamw`` when ``setup.kernels`` resolves to the compiled or interpreted
    ``adam_update`` kernel (``"auto"``: on a Hopper GPU once measured faster, see
    ``pallas_kernels.dispatch``); under a multi-device placement on every device's shard.
    Every ``count`` in the chain's state advances as the chain would. The clip scale is
    ``max_norm / ||g||`` above the threshold, the factor ``clip_by_global_norm`` applies (the
    products round differently: equal to fp32 rounding, not bitwise); with
    ``update_in_backward`` the previous step's norm from the chain's state, which the update
    advances to this step's. ``update(..., skip=flag)``: where the traced ``flag`` is true,
    everything comes back unchanged (the kernel's skipped programs touch nothing: no copy
    of the old state is kept for a select).
    """
    mode = dispatch.resolve(setup.kernels, "adam_update", placed=placement is not None)
    if setup.name != "fp8_adamw" or mode == "reference":
        return None
    specs = None
    if placement is not None and placement.mesh.size > 1:
        specs = jax.tree.map(lambda s: s.spec, placement.params)
    kernels = "interpret" if setup.kernels == "interpret" else "pallas"
    is_adam = lambda s: isinstance(s, ScaleByFp8AdamState)
    is_previous = lambda s: isinstance(s, clipping.ClipByPreviousNormState)
    is_state = lambda s: _counted(s) or is_previous(s)

    def update(params, grads, opt_state, remainder=None, *, skip=False):
        (adam,) = [s for s in jax.tree.leaves(opt_state, is_leaf=_counted) if is_adam(s)]
        clip = 1.0
        if setup.grad_clip > 0:
            previous = [s for s in jax.tree.leaves(opt_state, is_leaf=is_state) if is_previous(s)]
            norm = previous[0].norm if previous else global_norm_fp32(grads)
            clip = clipping.clip_scale(norm, setup.grad_clip)
        # BF16 master weights: the parts kernel follows the config's own option ("auto": where
        # measured faster, else fp32 rebuilt around the kernel above)
        out = fused_update.fp8_adamw_update(
            params, grads, adam, setup.schedule, **setup.adamw, clip_scale=clip,
            kernels=kernels if remainder is None else setup.kernels, specs=specs,
            remainder=remainder, skip=skip,
        )  # fmt: skip
        *params, new_adam = out

        def advance(s):  # Adam's state, every other count (the schedule's) with it, the norm
            if is_adam(s):
                return new_adam
            if is_previous(s):
                norm = jnp.where(skip, s.norm, global_norm_fp32(grads))
                return clipping.ClipByPreviousNormState(norm)
            return s._replace(count=new_adam.count) if _counted(s) else s

        return (*params, jax.tree.map(advance, opt_state, is_leaf=is_state))

    return update
