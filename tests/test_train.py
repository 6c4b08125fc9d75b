"""train.py end to end (subprocesses): learning, resume, crash safety, config errors, the
allocator it sets, the dry run's largest batch and training at it."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from child_env import child_env

from coat_jax.training.checkpoint import Checkpointer

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ["--config", str(ROOT / "configs/llama_tiny.py")]


def train(workdir, *overrides, wait=True, cache=None):
    cmd = [sys.executable, str(ROOT / "train.py"), *TINY, f"--config.workdir={workdir}"]
    cmd += list(overrides)
    env = child_env(drop_prefix="XLA_PYTHON_CLIENT_")  # and train.py's own allocator settings
    if cache:  # runs of the same program share their compiles (JAX's persistent cache)
        cmd.append(f"--config.compile_cache_dir={cache}")
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    if not wait:
        return subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def metrics(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def saved_params(workdir, step):
    path = os.path.join(workdir, "checkpoints", str(step), "params")
    return jax.tree.leaves(ocp.PyTreeCheckpointer().restore(path))


@pytest.mark.slow
def test_short_run_learns_and_writes_its_outputs(tmp_path):
    out = train(tmp_path, "--config.steps=60", "--config.log_interval=20")
    assert out.returncode == 0, out.stdout + out.stderr
    records = metrics(tmp_path)
    assert [r["step"] for r in records] == [20, 40, 60]
    assert records[-1]["train_loss"] < records[0]["train_loss"] - 0.3
    assert "eval_loss" in records[-1] and records[-1]["tokens_per_s"] > 0
    for name in ("loss.png", "config.json", "checkpoints/60/params"):
        assert (tmp_path / name).exists(), name


@pytest.mark.slow
def test_resume_after_kill_is_bit_identical(tmp_path):
    args = ["--config.steps=100", "--config.checkpoint_interval=20", "--config.log_interval=20"]
    ref, run, cache = tmp_path / "ref", tmp_path / "run", tmp_path / "cache"
    assert train(ref, *args, cache=cache).returncode == 0
    proc = train(run, *args, wait=False, cache=cache)
    deadline = time.time() + 300
    while not (run / "checkpoints" / "40").exists() and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    out = train(run, *args, "--config.resume=True", cache=cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Resumed from step" in out.stdout
    for a, b in zip(saved_params(ref, 100), saved_params(run, 100), strict=True):
        np.testing.assert_array_equal(a, b)
    losses = lambda d: [(r["step"], r["train_loss"]) for r in metrics(d)]
    assert losses(ref) == losses(run)


@pytest.mark.slow
def test_kill_during_checkpoint_save_keeps_previous_loadable(tmp_path):
    proc = train(tmp_path, "--config.steps=400", "--config.checkpoint_interval=1", wait=False)
    ckpt_dir = tmp_path / "checkpoints"
    deadline, killed_mid_save = time.time() + 300, False
    while time.time() < deadline and proc.poll() is None:
        names = [p.name for p in ckpt_dir.iterdir()] if ckpt_dir.exists() else []
        if any(n.isdigit() for n in names) and any("tmp" in n for n in names):
            proc.send_signal(signal.SIGKILL)
            killed_mid_save = True
            break
        time.sleep(0.002)
    proc.wait()
    assert killed_mid_save, "never saw a checkpoint being written"
    latest = Checkpointer(str(ckpt_dir)).latest_step()
    assert latest is not None and (ckpt_dir / str(latest)).is_dir()
    leaves = saved_params(tmp_path, latest)
    assert leaves and all(np.isfinite(np.asarray(x, np.float32)).all() for x in leaves)


@pytest.mark.slow
def test_existing_checkpoints_are_never_overwritten_without_resume(tmp_path):
    assert train(tmp_path, "--config.steps=20").returncode == 0
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    out = train(tmp_path, "--config.steps=20")
    assert out.returncode != 0 and "--config.resume=True" in out.stdout + out.stderr
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("--config.optimizr.lr=1", "optimizr"),
        ("--config.precision=fp4", "config.precision='fp4'"),
        ("--config.batch_size=10", "config.batch_size=10 must be a multiple of config.grad_accum"),
        ("--config.grad_accum=0", "config.grad_accum must be a positive int"),
        ("--config.model.dim=72", "config.model"),
        ("--config.optimizer.mu_format=e3m4", "config.optimizer.mu_format"),
        ("--config.data.source=/nonexistent.txt", "config.data: data source not found"),
        ("--config.steps=abc", "steps"),
        ("--config.init_from=/nonexistent", "config.init_from='/nonexistent': no such folder"),
        ("--config.data.format=chat", "config.data.format='chat'"),
        ("--config.optimizer.decay_steps=3", "config.optimizer.decay_steps"),
        ("--config.grad_dtype=float16", "config.grad_dtype='float16'"),
    ],
)
def test_bad_config_fails_fast_naming_the_key(tmp_path, override, match):
    out = train(tmp_path, override, "--config.grad_accum=4" if "batch_size" in override else "")
    assert out.returncode != 0
    assert match in out.stdout + out.stderr


def test_allocator_is_set_unless_the_user_chose(tmp_path):
    """train.py preallocates 95% of each GPU unless told otherwise, and says so first (also
    before a config error, which stops these runs before anything is built)."""
    common = ("--config.steps=0",)
    out = train(tmp_path / "a", *common)
    assert out.returncode != 0 and "config.steps must be a positive int" in out.stderr
    first = out.stdout.splitlines()[0]
    assert first.startswith("Allocator: XLA_PYTHON_CLIENT_PREALLOCATE=true, "
                            "XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 (set by train.py")  # fmt: skip
    env = child_env(drop_prefix="XLA_PYTHON_CLIENT_", XLA_PYTHON_CLIENT_MEM_FRACTION="0.5")
    cmd = [sys.executable, str(ROOT / "train.py"), *TINY, f"--config.workdir={tmp_path / 'b'}"]
    out = subprocess.run([*cmd, *common], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.stdout.splitlines()[0] == ("Allocator: XLA_PYTHON_CLIENT_PREALLOCATE=true, "
                                          "XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 (set by train.py; "
                                          "export them to choose)")  # fmt: skip
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    out = subprocess.run([*cmd, *common], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.stdout.splitlines()[0] == ("Allocator: XLA_PYTHON_CLIENT_PREALLOCATE=false, "
                                          "XLA_PYTHON_CLIENT_MEM_FRACTION=0.5")  # fmt: skip


@pytest.mark.slow
def test_dry_run_prints_the_largest_batch_and_batch_minus_one_trains_at_it(tmp_path):
    """On a CPU with a made-up limit (config.memory_limit_gb): --dry_run prints the largest batch
    and the plan at it; --config.batch_size=-1 trains at it, reading the dry run's search from
    beside the compilation cache instead of compiling again."""
    same = ("--config.memory_limit_gb=0.2735", "--config.seq_len=32", "--config.batch_size=-1",
            "--config.steps=2", "--config.log_interval=1", "--config.checkpoint_interval=0",
            "--config.optimizer.warmup_steps=0")  # fmt: skip
    cache = tmp_path / "cache"  # the dry run's compiles serve the run after it, as on a GPU
    out = train(tmp_path / "plan", *same, "--dry_run", cache=cache)
    assert out.returncode == 0, out.stdout + out.stderr
    plan = json.loads((tmp_path / "plan" / "memory_plan.json").read_text())
    planned, search = plan["largest_batch"], plan["largest_batch_search"]
    assert planned > 1 and plan["batch_size"] == planned  # the plan at the largest batch
    room = 0.2735e9 - 256 * 2**20
    assert search["limit"] == 0.2735e9 and search["margin"] == 256 * 2**20
    totals = {int(b): t for b, t in search["compiled_totals"].items()}  # real compiles
    assert totals[planned] == plan["compiled_total"] <= room < totals[planned + 1]
    assert out.stdout.index("largest batch that fits: ") < out.stdout.index("total, compiled")
    out = train(tmp_path / "run", *same, cache=cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"largest batch that fits: {planned} " in out.stdout
    assert "as found by an earlier search" in out.stdout
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["batch_size"] == planned and len(metrics(tmp_path / "run")) == 2
