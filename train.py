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

import contextlib
import difflib
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
from coat_jax.ops import flow
from coat_jax.training import allocator, configs, data, finetune, metrics, parallel, planner
from coat_jax.training.checkpoint import Checkpointer, NonFiniteStateError, StateLayoutError
from coat_jax.training.generate import eval_sampler
from coat_jax.training.preemption import StopRequest
from coat_jax.training.run import assemble
from coat_jax.training.step import NonFiniteSteps, NonFiniteStepsError, frozen_heap, global_batch

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "llama.py")
_CONFIG = config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, "Training config file.")
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
    absl_logging.set_verbosity(absl_logging.ERROR)  # orbax: INFO per save, WARNING per damage
    config = _CONFIG.value
    settings = ", ".join(f"{k}={v}" for k, v in measure.allocator_settings().items())
    log(f"Allocator: {settings}" + (" (set by train.py; export them to choose)"
                                    if allocator_set else ""))  # fmt: skip
    try:
        from_weights = finetune.resolve_init_from(config)
        configs.validate(config)
        if config.compile_cache_dir:
            jax.config.update("jax_compilation_cache_dir", config.compile_cache_dir)
        run = assemble(config)
        samples = eval_sampler(run)  # None unless config.eval_samples
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"train.py: {e}")
    corpus = None
    if not _DRY_RUN.value:
        try:  # the data is checked before anything compiles
            corpus = data.load_corpus(config, run.tokenizer)
        except (ValueError, FileNotFoundError) as e:
            sys.exit(f"train.py: config.data: {e}")
    new_workdir = not os.path.exists(config.workdir)
    os.makedirs(config.workdir, exist_ok=True)
    if from_weights:
        log(f"config.model from config.init_from={config.init_from}: {'; '.join(from_weights)}")
    context = finetune.trained_context(config)
    if context is not None and config.seq_len > context:
        log(f"Warning: config.seq_len={config.seq_len} is longer than init_from's "
            f"max_position_embeddings={context}: positions past it were never trained")  # fmt: skip
    log(f"{run.model.family} {run.model.num_params() / 1e6:.2f}M params, "
        f"precision={config.precision}, optimizer={config.optimizer.name}, "
        f"{jax.device_count()} devices ({jax.devices()[0].device_kind}; "
        f"{jax.process_count()} processes), "
        f"mesh {dict(run.placement.mesh.shape)}")  # fmt: skip
    if run.fused_update:
        log("Optimizer: fused FP8 AdamW kernel (pallas_kernels.adam_update)")
    if config.grad_dtype == "auto":
        log(f"Gradients: {run.grad_dtype} (config.grad_dtype=auto)")
    with jax.set_mesh(run.placement.mesh):
        if config.precision == "coat":
            kernels = ", ".join(flow.fused_kernels(configs.fp8_recipe(config))) or "none"
            log(f"Fused FP8 flow kernels: {kernels} (config.fp8.fused_*, grad_transpose; "
                "auto: where measured)")
        if _DRY_RUN.value:
            return dry_run(run)
        ckpt = Checkpointer(os.path.join(config.workdir, "checkpoints"), config.keep_checkpoints)
        start = resume_point(run, ckpt)  # before the planner: a refused resume stops at once
        if config.batch_size == -1:
            try:
                largest = planner.largest_batch(run)
            except ValueError as e:
                refuse(ckpt, f"train.py: config.batch_size=-1: {e}", new_workdir)
            if not largest.batch_size:
                refuse(ckpt, f"train.py: config.batch_size=-1: no batch fits; "
                             f"{largest.describe()}", new_workdir)  # fmt: skip
            log(largest.describe())
            config.batch_size = largest.batch_size
        train(run, ckpt, start, data.make_sampler(config, run.tokenizer, corpus), samples)


def refuse(ckpt, message: str, new_workdir: bool = False):
    """Exits with ``message`` before training, removing the checkpoint folder this run's
    Checkpointer made, and the workdir if this run made it, where they are still empty (a
    refused start leaves the disk as it found it)."""
    for folder in (ckpt.directory, os.path.dirname(ckpt.directory))[: 1 + new_workdir]:
        with contextlib.suppress(OSError):  # not empty (or not there): kept
            os.rmdir(folder)
    sys.exit(message)


def saved_config(ckpt, step: int, workdir: str) -> dict | None:
    """The config a checkpoint was written under: its meta's, else the workdir's config.json
    (checkpoints from before the meta held it); ``None`` if neither is readable."""
    try:
        saved = ckpt.read_meta(step).get("config")
    except Exception:  # noqa: BLE001 - a damaged newest checkpoint: the walk-back says why
        saved = None
    if saved is None and os.path.exists(os.path.join(workdir, "config.json")):
        with open(os.path.join(workdir, "config.json")) as f:
            saved = json.load(f)
    return saved


def resume_point(run, ckpt) -> int | None:
    """The step a run continues from: ``None`` for a fresh start (after refusing a workdir
    that holds an earlier run without ``resume=True``), else the newest checkpoint's, once
    its config has been compared with this run's (keys that change the state's shapes are
    refused; the others are listed). Exits with one line on a refusal."""
    config = run.config
    latest = ckpt.latest_step()
    metrics_path = metrics.MetricsWriter(config.workdir).path
    if not config.resume:
        if latest is not None:
            sys.exit(f"train.py: {ckpt.directory} already holds checkpoints (latest step "
                     f"{latest}); pass --config.resume=True to continue that run or choose "
                     "another --config.workdir")  # fmt: skip
        if os.path.exists(metrics_path):
            refuse(ckpt, f"train.py: {metrics_path} holds an earlier run's metrics (no "
                         "checkpoint to resume); pass --config.resume=True to start over in "
                         "this workdir (they are kept aside) or choose another "
                         "--config.workdir")  # fmt: skip
        return None
    if latest is None:
        return None
    if config.resume_step and min(ckpt.all_steps()) > config.resume_step:
        kept = ", ".join(map(str, ckpt.all_steps()))
        sys.exit(f"train.py: config.resume_step={config.resume_step}: no checkpoint at or "
                 f"before it in {ckpt.directory} (kept: {kept}); nothing was moved")  # fmt: skip
    saved = saved_config(ckpt, latest, config.workdir)
    if saved is not None:
        refused, changed = configs.resume_changes(saved, config)
        if refused:
            sys.exit(f"train.py: cannot resume {ckpt.directory}: these keys change the saved "
                     f"state's shapes: {'; '.join(refused)}")  # fmt: skip
        if saved.get("seed") != config.seed:
            sys.exit(f"train.py: config.seed={config.seed} differs from the checkpoint's "
                     f"({saved.get('seed')}): the data order would change")  # fmt: skip
        if changed:
            log(f"Resuming with changed config keys: {'; '.join(changed)}")
    return latest


def keep_aside(path: str) -> str:
    """Renames ``path`` to the first free ``<stem>.<n><ext>``; returns the new name."""
    stem, ext = os.path.splitext(path)
    n = 1
    while os.path.exists(f"{stem}.{n}{ext}"):
        n += 1
    os.replace(path, f"{stem}.{n}{ext}")
    return f"{stem}.{n}{ext}"


def restore(run, ckpt, latest, writer):
    """``(params, opt_state, start_step)``: fresh (``latest`` None) or the newest checkpoint
    that restores and is finite, walking back from ``latest``; ``writer``'s metrics file is
    cut to the restored step (fresh in a resumed workdir: the old one is kept aside)."""
    config = run.config
    restored = None
    if latest is not None:
        try:
            restored = ckpt.restore_newest(*run.abstract_state(), log=log,
                                           at_most=config.resume_step or None)  # fmt: skip
        except StateLayoutError as e:
            sys.exit(f"train.py: {e}")
        if restored is None and config.resume_step and ckpt.all_steps():
            sys.exit(f"train.py: no checkpoint at or before config.resume_step="
                     f"{config.resume_step} restores (each was moved to "
                     f"{ckpt.damaged_directory}); the newer ones are left in "
                     f"{ckpt.directory}")  # fmt: skip
        if restored is None:
            sys.exit(f"train.py: no checkpoint in {ckpt.directory} restores; each was moved to "
                     f"{ckpt.damaged_directory}. Run again to start this workdir anew")  # fmt: skip
    if restored is None:
        started = time.perf_counter()
        try:
            params, opt_state = run.create()
        except (ValueError, FileNotFoundError) as e:  # init_from's weights do not restore
            refuse(ckpt, f"train.py: config.init_from: {e}")  # its empty checkpoints/ too
        log(f"Initialized in {time.perf_counter() - started:.0f} s")
        if is_main() and os.path.exists(writer.path):  # resume=True with nothing to resume
            log(f"Earlier metrics kept as {keep_aside(writer.path)}")
        return params, opt_state, 0
    start = restored.meta["step"]
    if start > config.steps:
        sys.exit(f"train.py: checkpoint {start} is past config.steps={config.steps}: raise "
                 "--config.steps to train on, or roll back with --config.resume_step")  # fmt: skip
    if is_main():
        kept = [r for r in writer.read() if r["step"] <= start]
        with open(writer.path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
    log(f"Resumed from step {start} ({ckpt.directory})")
    return restored.params, restored.opt_state, start


@contextlib.contextmanager
def stops_cleanly(ckpt):
    """Ends the run with one line (after the checkpoints being written are complete) when the
    loop stops on non-finite steps, a non-finite state, or the device's memory running out."""
    try:
        yield
    except (NonFiniteStepsError, NonFiniteStateError) as e:
        ckpt.wait()
        ckpt.close()
        sys.exit(f"train.py: {e}")
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        ckpt.wait()
        ckpt.close()
        first = str(e).strip().splitlines()[0][:200]
        sys.exit(f"train.py: out of memory ({first}); --dry_run prints the memory plan and "
                 "the largest batch that fits, --config.batch_size=-1 trains at it")  # fmt: skip


def train(run, ckpt, latest, sampler, samples=None) -> None:
    """The training loop: from ``latest`` (a checkpoint step, or ``None``) to
    ``config.steps``, stopping early with a checkpoint on SIGTERM / SIGINT; at each eval it
    prints the texts ``samples(params, step)`` makes (``eval_sampler``), if given."""
    config, placement = run.config, run.placement
    writer = metrics.MetricsWriter(config.workdir)
    params, opt_state, start_step = restore(run, ckpt, latest, writer)
    # The loop carries the flat list of their arrays (run.loop_step): trees only where needed
    state = run.loop_step.flatten(params, opt_state)
    del params, opt_state  # donated at the first step
    if is_main():
        with open(os.path.join(config.workdir, "config.json"), "w") as f:
            f.write(config.to_json(indent=2))
    meta = {"seed": config.seed, "config": json.loads(config.to_json())}

    batch_shape = run.batch_shape()
    tokens_per_step = config.batch_size * config.seq_len
    bar = None
    if config.progress and is_main():
        from tqdm import tqdm

        bar = tqdm(total=config.steps, initial=start_step, unit="step", dynamic_ncols=True)
    window_start, window_steps = time.perf_counter(), 0
    nonfinite = NonFiniteSteps(config.skip_nonfinite, log)
    done = start_step
    with StopRequest(announce=log) as stop, stops_cleanly(ckpt), frozen_heap() as freeze_heap:
        for step in range(start_step, config.steps):
            batch = global_batch(sampler, step, "train", batch_shape, placement.batch)
            state, m = run.loop_step(state, batch)
            done = step + 1
            nonfinite.record(done, m)
            window_steps += 1
            if step == start_step:  # keep compilation out of the throughput numbers
                jax.block_until_ready(m)
                log(f"First step (with compilation): {time.perf_counter() - window_start:.0f} s")
                freeze_heap()  # no full collections walking what compilation left behind
                window_start, window_steps = time.perf_counter(), 0
            if done % config.log_interval == 0 or done == config.steps:
                nonfinite.flush()
                record = {"step": done, "train_loss": float(m["loss"]),
                          "grad_norm": float(m["grad_norm"])}  # fmt: skip
                record["lr"] = float(run.optimizer.schedule(step))
                if window_steps:  # a window that holds only the compiling step has no rate
                    seconds = (time.perf_counter() - window_start) / window_steps
                    record.update(tokens_per_s=tokens_per_step / seconds,
                                  step_ms=seconds * 1e3)  # fmt: skip
                    record["tokens_per_s_per_device"] = record["tokens_per_s"] / jax.device_count()
                    mfu = metrics.mfu(run.model, config.seq_len, record["tokens_per_s"],
                                      jax.device_count(), config.peak_tflops)  # fmt: skip
                    if mfu is not None:
                        record["mfu"] = mfu
                if nonfinite.total:
                    record["skipped_steps"] = nonfinite.total
                peak = measure.device_memory().peak  # the fullest local device's
                if peak is not None:
                    record["peak_mem_gb"] = peak / 1e9
                texts = []
                if done % config.eval_interval == 0 or done == config.steps:
                    params = run.loop_step.unflatten(state)[0]
                    record["eval_loss"] = evaluate(run, params, sampler)
                    texts = samples(params, done) if samples else []
                    freeze_heap()  # the eval step's and the sampler's compilations too
                if is_main():
                    writer.write(record)
                line = " ".join(
                    f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                    for k, v in record.items()
                )
                if bar:
                    bar.set_postfix(loss=f"{record['train_loss']:.3f}",
                                    tok_s=f"{record.get('tokens_per_s', 0):.0f}")  # fmt: skip
                    bar.write(line)
                else:
                    log(line)
                for i, text in enumerate(texts, 1):
                    (bar.write if bar else log)(f"sample {i}/{len(texts)}: {text!r}")
                window_start, window_steps = time.perf_counter(), 0
            if bar:
                bar.update(1)
            interval = config.checkpoint_interval
            stopping = stop.should_stop() and done < config.steps
            if stopping or (interval and (done % interval == 0 or done == config.steps)):
                nonfinite.flush()
                ckpt.save(done, *run.loop_step.unflatten(state), dict(meta, data_position=done))
            if stopping:
                break
        nonfinite.flush()
    if bar:
        bar.close()
    ckpt.wait()
    ckpt.close()
    if is_main():
        metrics.plot_metrics(writer.read(), os.path.join(config.workdir, "loss.png"))
    if done < config.steps:
        log(f"Stopped by {stop.reason} at step {done}: checkpoint {done} saved; continue "
            "with --config.resume=True")  # fmt: skip
    else:
        log(f"Done: {config.steps} steps; metrics, loss.png and checkpoints in {config.workdir}")


def config_path(argv: list[str]) -> str:
    """The ``--config`` file of a command line (the default where none is given)."""
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return DEFAULT_CONFIG


def check_command_line(argv: list[str]) -> None:
    """``--help``: this docstring and every config key with its default. Otherwise exits with
    one line on a missing config file or an unknown ``--config.<key>`` (ml_collections would
    raise a chain of tracebacks), naming the closest key."""
    path = config_path(argv)
    if not os.path.isfile(path):
        sys.exit(f"train.py: --config {path}: no such file")
    flat = configs.describe(configs.load_file(path))
    keys = [line.split("=", 1)[0].strip()[len("--config.") :] for line in flat.splitlines()]
    if any(arg in ("--help", "-h", "--helpshort", "--helpfull") for arg in argv):
        print(f"{__doc__}\nConfig keys, with their values in {path}:\n{flat}")
        sys.exit(0)
    for arg in argv:
        if arg.startswith("--config."):
            key = arg[len("--config.") :].split("=", 1)[0]
            if key not in keys and not any(k.startswith(key + ".") for k in keys):
                close = difflib.get_close_matches(key, keys, n=1)
                hint = f" (did you mean --config.{close[0]}?)" if close else ""
                sys.exit(f"train.py: --config.{key}: no such config key{hint}; --help lists them")


if __name__ == "__main__":
    _allocator_set = allocator.configure()  # before anything starts JAX's backend
    parallel.initialize_from_env()  # before the config file asks JAX which backend it has
    check_command_line(sys.argv[1:])
    app.run(lambda argv: main(argv, _allocator_set))
