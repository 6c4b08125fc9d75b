"""Train / eval step builders, the optimizer from a config, and run metrics (JSONL, plot, MFU).

One optimizer step consumes ``batch (grad_accum, micro_batch, seq_len + 1)`` tokens, or a pair
``(tokens, mask (grad_accum, micro_batch, seq_len))`` whose mask selects the targets the loss
counts (fine-tuning on responses only; each micro-batch's loss is its masked mean): gradients
are summed over the micro-batches in fp32 under ``lax.scan`` and averaged. Weight quantization
inside the model is loop-invariant there, so XLA computes the FP8 weights once per step.
"""

from __future__ import annotations

import json
import math
import os

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import coat_jax
from coat_jax import parallel
from coat_jax.data import ExampleSampler
from coat_jax.models.llama import LlamaConfig, loss_fn

__all__ = [
    "compiler_options",
    "config_train_step",
    "flops_per_token",
    "global_norm_fp32",
    "global_batch",
    "loss_points",
    "make_eval_step",
    "make_fused_update",
    "make_optimizer",
    "make_train_step",
    "mfu",
    "peak_flops",
    "plot_metrics",
    "save_loss_figure",
    "MetricsWriter",
]

# Dense BF16 peak TFLOP/s per device (datasheet), for MFU when config.peak_tflops is 0.
_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "L40S": 362.0}


def decay_mask(params):
    """Decay matrices only: no decay on norms, biases or (by default) embeddings."""
    return jax.tree_util.tree_map_with_path(
        lambda path, p: p.ndim >= 2 and "embed" not in jax.tree_util.keystr(path), params
    )


def _decay_mask(o):
    return (lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)) if o.decay_embeddings else decay_mask


def _counted(s) -> bool:
    """An optax state NamedTuple with a step ``count`` (Adam's, a schedule's)."""
    return isinstance(s, tuple) and "count" in getattr(s, "_fields", ())


def make_optimizer(o, steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Global-norm clipping, then AdamW or FP8 AdamW with warmup + cosine decay over
    ``o.decay_steps`` steps (``steps`` when 0)."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=o.lr,
        warmup_steps=o.warmup_steps,
        decay_steps=o.decay_steps or steps,
        end_value=o.lr * o.min_lr_ratio,
    )
    mask = _decay_mask(o)
    common = dict(b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=mask)
    if o.name == "adamw":
        opt = optax.adamw(schedule, **common)
    else:
        opt = coat_jax.fp8_adamw(
            schedule,
            **common,
            group_size=o.group_size,
            mu_format=o.mu_format,
            nu_format=o.nu_format,
            expansion=o.expansion,
            min_size=o.min_size,
            kernels=o.kernels,
        )
    if o.grad_clip > 0:
        opt = optax.chain(optax.clip_by_global_norm(o.grad_clip), opt)
    return opt, schedule


def make_fused_update(o, schedule, placement=None):
    """``update(params, grads, opt_state) -> (params, opt_state)``: :func:`make_optimizer`'s
    step (clipping, FP8 AdamW, ``optax.apply_updates``) as one fused Pallas pass per parameter
    (:func:`coat_jax.fused_fp8_adamw_update`), or ``None`` where the kernel does not run.

    It runs for ``fp8_adamw`` when ``o.kernels`` resolves to the compiled or interpreted
    ``adam_update`` kernel (``"auto"``: on a Hopper GPU once measured faster, see
    ``pallas_kernels.dispatch``); under a multi-device placement on every device's shard
    (``shard_map`` with the parameters' specs; leaves whose groups do not line up with their
    shards take the XLA reference).
    The optimizer state keeps ``make_optimizer``'s structure, so checkpoints do not depend on
    the path: the FP8 moments and every ``count`` in the chain advance as the chain would. The
    clip scale is ``max_norm / ||g||`` above the threshold, the factor ``clip_by_global_norm``
    applies (the products round differently: equal to fp32 rounding, not bitwise).
    """
    from pallas_kernels import dispatch  # pallas_kernels imports coat_jax, not the reverse

    if o.name != "fp8_adamw" or dispatch.resolve(o.kernels, "adam_update") == "reference":
        return None
    specs = None
    if placement is not None and placement.mesh.size > 1:
        specs = jax.tree.map(lambda s: s.spec, placement.params)
    mask = _decay_mask(o)
    kernels = "interpret" if o.kernels == "interpret" else "pallas"
    is_adam = lambda s: isinstance(s, coat_jax.ScaleByFp8AdamState)

    def update(params, grads, opt_state):
        (adam,) = [s for s in jax.tree.leaves(opt_state, is_leaf=_counted) if is_adam(s)]
        clip = 1.0
        if o.grad_clip > 0:
            norm = global_norm_fp32(grads)
            clip = jnp.where(norm < o.grad_clip, 1.0, o.grad_clip / norm)
        params, new_adam = coat_jax.fused_fp8_adamw_update(
            params, grads, adam, schedule, b1=o.b1, b2=o.b2, eps=o.eps,
            weight_decay=o.weight_decay, mask=mask, clip_scale=clip, kernels=kernels,
            specs=specs,
        )  # fmt: skip

        def advance(s):  # Adam's state, and every other count (the schedule's) with it
            if is_adam(s):
                return new_adam
            return s._replace(count=new_adam.count) if _counted(s) else s

        return params, jax.tree.map(advance, opt_state, is_leaf=_counted)

    return update


def _batch_loss(graph, params, batch):
    tokens, mask = batch if isinstance(batch, tuple) else (batch, None)
    return loss_fn(nnx.merge(graph, params), tokens, mask)


def global_batch(sampler, index: int, split: str, shape, target):
    """Batch ``index`` of ``split`` as global arrays with sharding ``target``, each process
    reading only its rows (:func:`coat_jax.parallel.sharded_batch`): tokens of ``shape``, or
    ``(tokens, mask)`` from an :class:`~coat_jax.data.ExampleSampler` (mask: ``seq_len``)."""
    rows = lambda r: sampler.batch(index, split, rows=r)
    if not isinstance(sampler, ExampleSampler):
        return parallel.sharded_batch(rows, shape, target)
    tokens = parallel.sharded_batch(lambda r: rows(r)[0], shape, target)
    mask = parallel.sharded_batch(lambda r: rows(r)[1], (*shape[:-1], shape[-1] - 1), target)
    return tokens, mask


def compiler_options(precision: str) -> dict | None:
    """XLA options for the train step of ``precision``: on a GPU, FP8 policies compile their
    GEMMs to cuBLASLt only (``xla_gpu_enable_triton_gemm=False``); BF16 keeps XLA's defaults.

    Why (2 x H200, jax 0.11.2, Llama-2-7B, COAT, FSDP 2, 2026-11-30): with Triton GEMM fusions
    on, autotuning their FP8 variants kept the compile going past 3 minutes; with autotuning
    off (``--xla_gpu_autotune_level=0``) they ran untuned at 4.2 s a step (17x bf16); with
    Triton GEMMs off: 62 s to compile, 259 ms a step, the FP8 dots on cuBLASLt. On one H200
    the step is the same either way (Triton GEMMs were 2.6% of it).
    """
    if precision == "bf16" or jax.default_backend() != "gpu":
        return None
    return {"xla_gpu_enable_triton_gemm": False}


def global_norm_fp32(tree) -> jax.Array:
    """``optax.global_norm`` with every leaf read as fp32 (a bf16 gradient's squares summed in
    fp32; XLA fuses the casts into the reduction, nothing is copied)."""
    return optax.global_norm(jax.tree.map(lambda g: g.astype(jnp.float32), tree))


def make_train_step(
    graph, optimizer, placement=None, fused_update=None, compiler_options=None,
    grad_dtype=jnp.float32,
):  # fmt: skip
    """``step(params, opt_state, batch) -> (params, opt_state, {loss, grad_norm})``, jitted with
    params and optimizer state donated; with a :class:`coat_jax.parallel.Placement`, its inputs
    and outputs stay in their shards (call it under ``jax.set_mesh(placement.mesh)``).
    ``fused_update`` (from :func:`make_fused_update`) replaces ``optimizer.update`` +
    ``optax.apply_updates`` when given; ``compiler_options`` (XLA's, e.g. from
    :func:`compiler_options`) go to ``jax.jit``.

    ``grad_dtype``: ``float32`` (default) differentiates the fp32 master weights. ``bfloat16``
    differentiates a bf16 view of them (the forward reads bf16-rounded weights; an FP8 GEMM
    weight is rounded to FP8 from it) so that each gradient comes out in bf16: half the bytes
    of the largest buffer after the weights (Llama-2-7B: 13.5 GB instead of 27). The fused
    update consumes bf16 gradients as they are (its math is fp32); the optax chain gets them
    upcast to fp32 (its own arithmetic follows the gradient's dtype), and with ``grad_accum``
    above 1 the micro-batch gradients are summed in fp32, so the saving needs both the fused
    update and one micro-batch per step. The gradient norm is always taken in fp32.
    """
    if jnp.dtype(grad_dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"grad_dtype must be float32 or bfloat16, got {jnp.dtype(grad_dtype)}")
    low = jnp.dtype(grad_dtype) != jnp.float32

    def micro_loss(params, tokens):
        return _batch_loss(graph, params, tokens)

    def step(params, opt_state, batch):
        wrt = jax.tree.map(lambda p: p.astype(grad_dtype), params) if low else params

        def accumulate(grads, tokens):
            loss, g = jax.value_and_grad(micro_loss)(wrt, tokens)
            return jax.tree.map(lambda a, b: a + b.astype(a.dtype), grads, g), loss

        micro_batches = jax.tree.leaves(batch)[0].shape[0]
        if low and micro_batches == 1:  # no fp32 accumulator: the gradients stay bf16
            loss, grads = jax.value_and_grad(micro_loss)(wrt, jax.tree.map(lambda x: x[0], batch))
            losses = loss[None]
        else:
            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
            grads, losses = jax.lax.scan(accumulate, zeros, batch)
            grads = jax.tree.map(lambda g: g / losses.shape[0], grads)
        if fused_update is not None:
            params, opt_state = fused_update(params, grads, opt_state)
        else:
            grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": losses.mean(), "grad_norm": global_norm_fp32(grads)}

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


def config_train_step(config, graph, optimizer, schedule, placement=None):
    """``(step, fused)``: :func:`make_train_step` as ``config`` asks for it (``train.py``'s and
    the benches' step): the fused FP8 AdamW update where it runs (``fused`` says whether),
    the precision's :func:`compiler_options` and ``config.grad_dtype``."""
    fused = make_fused_update(config.optimizer, schedule, placement)
    step = make_train_step(
        graph, optimizer, placement, fused_update=fused,
        compiler_options=compiler_options(config.precision), grad_dtype=config.grad_dtype,
    )  # fmt: skip
    return step, fused is not None


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


def flops_per_token(config: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 x (non-embedding params + LM head) + attention (12 L T d)."""
    n = config.num_params() - config.vocab_size * config.dim
    if config.tie_embeddings:
        n += config.vocab_size * config.dim
    return 6.0 * n + 12.0 * config.n_layers * seq_len * config.dim


def peak_flops(override_tflops: float = 0.0) -> float | None:
    """Peak FLOP/s of one device: the override, else by device kind; ``None`` if unknown."""
    if override_tflops > 0:
        return override_tflops * 1e12
    kind = jax.devices()[0].device_kind
    for name, tflops in _PEAK_TFLOPS.items():
        if name in kind:
            return tflops * 1e12
    return None


def mfu(config: LlamaConfig, seq_len: int, tokens_per_s: float, devices: int,
        override_tflops: float = 0.0) -> float | None:  # fmt: skip
    """Model FLOP utilisation per device: ``flops_per_token x tokens/s`` over ``devices`` times
    one device's peak (:func:`peak_flops`); ``None`` where the peak is unknown."""
    peak = peak_flops(override_tflops)
    if not peak:
        return None
    return flops_per_token(config, seq_len) * tokens_per_s / (peak * devices)


class MetricsWriter:
    """Appends one JSON object per line to ``<workdir>/metrics.jsonl``."""

    def __init__(self, workdir: str):
        self.path = os.path.join(workdir, "metrics.jsonl")

    def write(self, record: dict) -> None:
        clean = {k: v if isinstance(v, (int, str)) else float(v) for k, v in record.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(clean) + "\n")

    def read(self) -> list[dict]:
        if not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            return [json.loads(line) for line in f if line.strip()]


def loss_points(records: list[dict], key: str) -> tuple | None:
    """``(steps, values)`` of the metrics ``records`` that hold a finite ``key``, else ``None``."""
    points = [(r["step"], r[key]) for r in records if key in r and math.isfinite(r[key])]
    return tuple(zip(*points, strict=True)) if points else None


def plot_metrics(records: list[dict], path: str) -> None:
    """Train and eval loss against step, written to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, style in (("train_loss", "-"), ("eval_loss", "o-")):
        if points := loss_points(records, key):
            ax.plot(*points, style, label=key.replace("_", " "))
    save_loss_figure(fig, [ax], path, "loss (nats/token)")


def save_loss_figure(fig, axes, path: str, ylabel: str) -> None:
    """Labels, grid and legend on each loss-curve axis of ``fig``; writes it to ``path`` (PNG)
    and closes it (the trainer's plot and bench/fidelity.py's)."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
