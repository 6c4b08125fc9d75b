"""Train a Llama model with FP8 optimizer states and FP8 activations (COAT) in JAX.

  python train.py --config configs/llama.py                      # small model, any machine
  python train.py --config configs/llama.py --config.steps=1000 --config.precision=bf16
  python train.py --config configs/llama2_7b.py --dry_run        # memory plan, largest batch
  python train.py --config configs/llama2_7b.py --config.batch_size=-1   # at the largest batch
  python train.py --config configs/llama.py --config.resume=True # continue from the latest
  python train.py --config configs/llama2_7b.py --config.mesh.fsdp=-1 --config.mesh.data=1
  python train.py --config configs/llama_finetune.py --config.init_from=/path/to/hf_llama

Writes to ``config.workdir``: checkpoints/, metrics.jsonl, loss.png, config.json. Runs on every
visible device (``config.mesh``); started as one of several processes (``JAX_COORDINATOR_ADDRESS``
+ ``JAX_NUM_PROCESSES`` + ``JAX_PROCESS_ID``, or SLURM / Open MPI) it joins them first. Unless
set in the environment, it preallocates 95% of each GPU (``coat_jax.training.allocator``).
"""

from __future__ import annotations

import json
import os
import sys
import time

import jax
import numpy as np
from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from coat_jax.core import measure
from coat_jax.training import allocator, configs, data, finetune, metrics, parallel, planner
from coat_jax.training.checkpoint import Checkpointer
from coat_jax.training.run import assemble
from coat_jax.training.step import global_batch

_CONFIG = config_flags.DEFINE_config_file("config", "configs/llama.py", "Training config file.")
_DRY_RUN = flags.DEFINE_bool(
    "dry_run", False, "Compile the train step, print its memory plan and the largest batch that "
    "fits, exit.",
)  # fmt: skip


def is_main() -> bool:
    """Whether this is the process (of one or many) that logs, writes metrics and plots."""
    return jax.process_index() == 0


def log(msg: str) -> None:
    if is_main():
        print(msg, flush=True)


def dry_run(run) -> None:
    """Prints the memory plan at the config's batch and the largest batch that fits; with
    ``batch_size=-1``, the largest batch and then the plan at it."""
    config = run.config
    plan, largest = {}, None

    def show_plan(batch):
        mesh = ", ".join(f"{k} {v}" for k, v in run.placement.mesh.shape.items())
        plan.update(planner.memory_plan(run, batch))
        log(f"Memory plan per device ({config.precision}, {config.optimizer.name}, batch "
            f"{batch} x seq {config.seq_len}, grad_accum {config.grad_accum}, mesh {mesh}) on "
            f"{jax.devices()[0].device_kind}:\n{planner.format_plan(plan)}")  # fmt: skip

    if config.batch_size != -1:
        show_plan(config.batch_size)
    try:
        largest = planner.largest_batch(run)
        log(f"{largest.describe()}\n  train at it: --config.batch_size=-1 (or "
            f"--config.batch_size={largest.batch_size})")  # fmt: skip
    except ValueError as e:
        log(f"largest batch: not planned ({e})")
    if config.batch_size == -1 and largest is not None and largest.batch_size:
        show_plan(largest.batch_size)
    if largest is not None:
        plan["largest_batch"] = largest.batch_size
        plan["largest_batch_search"] = {"limit": largest.limit, "margin": largest.margin,
                                        "compiled_totals": largest.compiled_totals}  # fmt: skip
    if is_main():
        with open(os.path.join(config.workdir, "memory_plan.json"), "w") as f:
            json.dump(plan, f, indent=2)


def evaluate(run, params, sampler) -> float:
    shape = (sampler.batch_size, sampler.seq_len + 1)
    batch = lambda i: global_batch(sampler, i, "eval", shape, run.placement.eval_batch)
    return float(np.mean([run.eval_step(params, batch(i)) for i in range(run.config.eval_batches)]))


def main(argv, allocator_set: dict) -> None:
    del argv
    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every save at INFO
    config = _CONFIG.value
    settings = ", ".join(f"{k}={v}" for k, v in measure.allocator_settings().items())
    log(f"Allocator: {settings}" + (" (set by train.py; export them to choose)"
                                    if allocator_set else ""))  # fmt: skip
    try:
        finetune.resolve_init_from(config)
        configs.validate(config)
        if config.compile_cache_dir:
            jax.config.update("jax_compilation_cache_dir", config.compile_cache_dir)
        run = assemble(config)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"train.py: {e}")
    os.makedirs(config.workdir, exist_ok=True)
    log(f"Llama {run.model.num_params() / 1e6:.2f}M params, precision={config.precision}, "
        f"optimizer={config.optimizer.name}, {jax.device_count()} devices "
        f"({jax.process_count()} processes), mesh {dict(run.placement.mesh.shape)}")  # fmt: skip
    if run.fused_update:
        log("Optimizer: fused FP8 AdamW kernel (pallas_kernels.adam_update)")
    with jax.set_mesh(run.placement.mesh):
        if _DRY_RUN.value:
            return dry_run(run)
        if config.batch_size == -1:
            try:
                largest = planner.largest_batch(run)
            except ValueError as e:
                sys.exit(f"train.py: config.batch_size=-1: {e}")
            if not largest.batch_size:
                sys.exit(f"train.py: config.batch_size=-1: no batch fits; {largest.describe()}")
            log(largest.describe())
            config.batch_size = largest.batch_size
        train(run)


def train(run) -> None:
    """The training loop."""
    config, placement = run.config, run.placement
    try:
        sampler = data.make_sampler(config, run.tokenizer)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"train.py: config.data: {e}")
    ckpt = Checkpointer(os.path.join(config.workdir, "checkpoints"), config.keep_checkpoints)
    writer = metrics.MetricsWriter(config.workdir)

    start_step, latest = 0, ckpt.latest_step()
    if latest is not None and not config.resume:
        sys.exit(
            f"train.py: {ckpt.directory} already holds checkpoints (latest step {latest}); pass "
            "--config.resume=True to continue that run or choose another --config.workdir"
        )
    started = time.perf_counter()
    if latest is None:
        params, opt_state = run.create()
        log(f"Initialized in {time.perf_counter() - started:.0f} s")
        if is_main() and os.path.exists(writer.path):
            os.remove(writer.path)  # no checkpoint: these metrics belong to nothing resumable
    else:  # restored straight into this run's shards, whatever mesh saved them
        params, opt_state, meta = ckpt.restore(latest, *run.abstract_state())
        start_step = meta["step"]
        if meta.get("seed") != config.seed:
            sys.exit(f"train.py: config.seed={config.seed} differs from the checkpoint's {meta}")
        if is_main():
            kept = [r for r in writer.read() if r["step"] <= start_step]
            with open(writer.path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)
        log(f"Resumed from step {start_step} ({ckpt.directory})")
    if is_main():
        with open(os.path.join(config.workdir, "config.json"), "w") as f:
            f.write(config.to_json(indent=2))

    batch_shape = run.batch_shape()
    tokens_per_step = config.batch_size * config.seq_len
    bar = None
    if config.progress and is_main():
        from tqdm import tqdm

        bar = tqdm(total=config.steps, initial=start_step, unit="step", dynamic_ncols=True)
    window_start, window_steps = time.perf_counter(), 0
    for step in range(start_step, config.steps):
        batch = global_batch(sampler, step, "train", batch_shape, placement.batch)
        params, opt_state, m = run.train_step(params, opt_state, batch)
        window_steps += 1
        done = step + 1
        if step == start_step:  # keep compilation out of the throughput numbers
            jax.block_until_ready(m)
            log(f"First step (with compilation): {time.perf_counter() - window_start:.0f} s")
            window_start, window_steps = time.perf_counter(), 0
        if done % config.log_interval == 0 or done == config.steps:
            loss, grad_norm = float(m["loss"]), float(m["grad_norm"])  # waits for the device
            seconds = (time.perf_counter() - window_start) / max(window_steps, 1)
            record = {"step": done, "train_loss": loss, "grad_norm": grad_norm,
                      "lr": float(run.optimizer.schedule(step)),
                      "tokens_per_s": tokens_per_step / seconds,
                      "step_ms": seconds * 1e3}  # fmt: skip
            record["tokens_per_s_per_device"] = record["tokens_per_s"] / jax.device_count()
            mfu = metrics.mfu(run.model, config.seq_len, record["tokens_per_s"],
                              jax.device_count(), config.peak_tflops)  # fmt: skip
            if mfu is not None:
                record["mfu"] = mfu
            peak = measure.device_memory().peak  # the fullest local device's
            if peak is not None:
                record["peak_mem_gb"] = peak / 1e9
            if done % config.eval_interval == 0 or done == config.steps:
                record["eval_loss"] = evaluate(run, params, sampler)
            if is_main():
                writer.write(record)
            if not np.isfinite(loss):
                raise FloatingPointError(f"loss is {loss} at step {done}; stopping")
            line = " ".join(
                f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items()
            )
            if bar:
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
                bar.write(line)
            else:
                log(line)
            window_start, window_steps = time.perf_counter(), 0
        if bar:
            bar.update(1)
        interval = config.checkpoint_interval
        if interval and (done % interval == 0 or done == config.steps):
            ckpt.save(done, params, opt_state, {"seed": config.seed, "data_position": done})
    if bar:
        bar.close()
    ckpt.wait()
    ckpt.close()
    if is_main():
        metrics.plot_metrics(writer.read(), os.path.join(config.workdir, "loss.png"))
    log(f"Done: {config.steps} steps; metrics, loss.png and checkpoints in {config.workdir}")


if __name__ == "__main__":
    _allocator_set = allocator.configure()  # before anything starts JAX's backend
    parallel.initialize_from_env()  # before the config file asks JAX which backend it has
    app.run(lambda argv: main(argv, _allocator_set))
