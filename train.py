"""Train a Llama model with FP8 optimizer states and FP8 activations (COAT) in JAX.

  python train.py --config configs/llama.py                      # small model, any machine
  python train.py --config configs/llama.py --config.steps=1000 --config.precision=bf16
  python train.py --config configs/llama2_7b.py --dry_run        # memory plan, nothing runs
  python train.py --config configs/llama.py --config.resume=True # continue from the latest
  python train.py --config configs/llama2_7b.py --config.mesh.fsdp=-1 --config.mesh.data=1
  python train.py --config configs/llama_finetune.py --config.init_from=/path/to/hf_llama

Writes to ``config.workdir``: checkpoints/, metrics.jsonl, loss.png, config.json. Runs on every
visible device (``config.mesh``); started as one of several processes (``JAX_COORDINATOR_ADDRESS``
+ ``JAX_NUM_PROCESSES`` + ``JAX_PROCESS_ID``, or SLURM / Open MPI) it joins them first.
"""

from __future__ import annotations

import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from absl import logging as absl_logging
from flax import nnx
from ml_collections import config_flags

from coat_jax import configs, data, finetune, parallel, planner, sharding, train_loop
from coat_jax.checkpoint import Checkpointer
from coat_jax.models.llama import Llama, init_params

_CONFIG = config_flags.DEFINE_config_file("config", "configs/llama.py", "Training config file.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Compile the train step, print a memory plan, exit.")


def is_main() -> bool:
    """Whether this is the process (of one or many) that logs, writes metrics and plots."""
    return jax.process_index() == 0


def log(msg: str) -> None:
    if is_main():
        print(msg, flush=True)


def build(config):
    """Tokenizer, model config, abstract parameters (nothing allocated), their creator, the
    optimizer and its schedule, and where all of it lives on the device mesh."""
    tokenizer = data.load_tokenizer(config.data.tokenizer)
    if config.model.vocab_size < tokenizer.vocab_size:
        raise ValueError(
            f"config.model.vocab_size={config.model.vocab_size} is smaller than the "
            f"tokenizer's vocabulary ({tokenizer.vocab_size})"
        )
    model_config = configs.llama_config(config)
    create = lambda shardings: init_params(model_config, config.seed, shardings)[1]
    graph, params = nnx.split(nnx.eval_shape(lambda: Llama(model_config, rngs=nnx.Rngs(0))))
    if config.init_from:  # the weights to fine-tune, read straight into their shards
        create = lambda shardings: finetune.initial_params(config, params, shardings)
    optimizer, schedule = train_loop.make_optimizer(config.optimizer, config.steps)
    try:
        mesh = sharding.make_mesh(**config.mesh)
    except ValueError as e:
        raise ValueError(f"config.mesh: {e}") from None
    placement = parallel.make_placement(mesh, params, optimizer)
    micro = config.batch_size // config.grad_accum
    if micro % placement.batch_shards:
        raise ValueError(
            f"config.batch_size / grad_accum = {micro} examples per micro-batch must divide "
            f"over mesh data x fsdp = {placement.batch_shards} devices"
        )
    return tokenizer, model_config, graph, params, create, optimizer, schedule, placement


def make_step(config, graph, optimizer, schedule, placement):
    """The jitted train step, with the fused optimizer kernel where it runs."""
    step, fused = train_loop.config_train_step(config, graph, optimizer, schedule, placement)
    if fused:
        log("Optimizer: fused FP8 AdamW kernel (pallas_kernels.adam_update)")
    return step


def dry_run(config, model_config, graph, params, optimizer, schedule, placement) -> None:
    opt_state = jax.eval_shape(optimizer.init, params)
    micro = config.batch_size // config.grad_accum
    batch = jax.ShapeDtypeStruct((config.grad_accum, micro, config.seq_len + 1), jnp.int32)
    step = make_step(config, graph, optimizer, schedule, placement)
    plan = planner.memory_plan(
        step, graph, params, opt_state, batch, model_config, placement, config.grad_dtype
    )
    run = f"{config.precision}, {config.optimizer.name}, batch {config.batch_size} x seq "
    mesh = ", ".join(f"{k} {v}" for k, v in placement.mesh.shape.items())
    log(f"Memory plan per device ({run}{config.seq_len}, grad_accum {config.grad_accum}, "
        f"mesh {mesh}) on {jax.devices()[0].device_kind}:")  # fmt: skip
    log(planner.format_plan(plan))
    if is_main():
        with open(os.path.join(config.workdir, "memory_plan.json"), "w") as f:
            json.dump(plan, f, indent=2)


def evaluate(eval_step, params, sampler, batches: int, placement) -> float:
    shape = (sampler.batch_size, sampler.seq_len + 1)
    batch = lambda i: train_loop.global_batch(sampler, i, "eval", shape, placement.eval_batch)
    return float(np.mean([eval_step(params, batch(i)) for i in range(batches)]))


def main(argv):
    del argv
    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every save at INFO
    config = _CONFIG.value
    try:
        finetune.resolve_init_from(config)
        configs.validate(config)
        tokenizer, model_config, graph, params, create, optimizer, schedule, placement = build(
            config
        )
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"train.py: {e}")
    os.makedirs(config.workdir, exist_ok=True)
    n_params = model_config.num_params()
    log(f"Llama {n_params / 1e6:.2f}M params, precision={config.precision}, "
        f"optimizer={config.optimizer.name}, {jax.device_count()} devices "
        f"({jax.process_count()} processes), mesh {dict(placement.mesh.shape)}")  # fmt: skip
    with jax.set_mesh(placement.mesh):
        if _DRY_RUN.value:
            dry_run(config, model_config, graph, params, optimizer, schedule, placement)
        else:
            train(config, model_config, graph, params, create, optimizer, schedule, placement,
                  tokenizer)  # fmt: skip


def train(config, model_config, graph, params, create, optimizer, schedule, placement, tokenizer):
    """The training loop; ``params`` are abstract (shapes) until created or restored."""
    try:
        sampler = data.make_sampler(config, tokenizer)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"train.py: config.data: {e}")
    train_step = make_step(config, graph, optimizer, schedule, placement)
    eval_step = train_loop.make_eval_step(graph, placement)
    ckpt = Checkpointer(os.path.join(config.workdir, "checkpoints"), config.keep_checkpoints)
    metrics = train_loop.MetricsWriter(config.workdir)

    start_step, latest = 0, ckpt.latest_step()
    if latest is not None and not config.resume:
        sys.exit(
            f"train.py: {ckpt.directory} already holds checkpoints (latest step {latest}); pass "
            "--config.resume=True to continue that run or choose another --config.workdir"
        )
    started = time.perf_counter()
    if latest is None:
        params = create(placement.params)
        opt_state = placement.init_opt_state(optimizer, params)
        log(f"Initialized in {time.perf_counter() - started:.0f} s")
        if is_main() and os.path.exists(metrics.path):
            os.remove(metrics.path)  # no checkpoint: these metrics belong to nothing resumable
    else:  # restored straight into this run's shards, whatever mesh saved them
        opt_state = jax.eval_shape(optimizer.init, params)
        params, opt_state = placement.abstract(params, opt_state)
        params, opt_state, meta = ckpt.restore(latest, params, opt_state)
        start_step = meta["step"]
        if meta.get("seed") != config.seed:
            sys.exit(f"train.py: config.seed={config.seed} differs from the checkpoint's {meta}")
        if is_main():
            kept = [r for r in metrics.read() if r["step"] <= start_step]
            with open(metrics.path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)
        log(f"Resumed from step {start_step} ({ckpt.directory})")
    if is_main():
        with open(os.path.join(config.workdir, "config.json"), "w") as f:
            f.write(config.to_json(indent=2))

    batch_shape = (config.grad_accum, config.batch_size // config.grad_accum, config.seq_len + 1)
    tokens_per_step = config.batch_size * config.seq_len
    bar = None
    if config.progress and is_main():
        from tqdm import tqdm

        bar = tqdm(total=config.steps, initial=start_step, unit="step", dynamic_ncols=True)
    window_start, window_steps = time.perf_counter(), 0
    for step in range(start_step, config.steps):
        batch = train_loop.global_batch(sampler, step, "train", batch_shape, placement.batch)
        params, opt_state, m = train_step(params, opt_state, batch)
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
                      "lr": float(schedule(step)), "tokens_per_s": tokens_per_step / seconds,
                      "step_ms": seconds * 1e3}  # fmt: skip
            record["tokens_per_s_per_device"] = record["tokens_per_s"] / jax.device_count()
            mfu = train_loop.mfu(model_config, config.seq_len, record["tokens_per_s"],
                                 jax.device_count(), config.peak_tflops)  # fmt: skip
            if mfu is not None:
                record["mfu"] = mfu
            stats = [d.memory_stats() or {} for d in jax.local_devices()]
            if all("peak_bytes_in_use" in st for st in stats):  # the fullest device's
                record["peak_mem_gb"] = max(st["peak_bytes_in_use"] for st in stats) / 1e9
            if done % config.eval_interval == 0 or done == config.steps:
                record["eval_loss"] = evaluate(
                    eval_step, params, sampler, config.eval_batches, placement
                )
            if is_main():
                metrics.write(record)
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
        train_loop.plot_metrics(metrics.read(), os.path.join(config.workdir, "loss.png"))
    log(f"Done: {config.steps} steps; metrics, loss.png and checkpoints in {config.workdir}")


if __name__ == "__main__":
    parallel.initialize_from_env()  # before the config file asks JAX which backend it has
    sys.exit(app.run(main))
