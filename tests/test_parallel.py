"""train.py on a device mesh: sharded runs match one device, checkpoints move between meshes,
and two processes joined by jax.distributed match one process (8 virtual CPU devices)."""

import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys

import numpy as np
import orbax.checkpoint as ocp
import pytest
from child_env import child_env

from coat_jax.training import configs, data, parallel

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS = ["--config.steps=10", "--config.log_interval=5", "--config.checkpoint_interval=5",
         "--config.eval_interval=5", "--config.optimizer.warmup_steps=2"]  # fmt: skip

# Stated tolerances for llama_tiny after 10 steps, one device vs a mesh. A mesh changes the
# order of fp32 reductions (gradient sums), which moves values by ulps; Adam turns sign flips
# of near-zero gradients into lr-sized steps, and FP8 moments round a few ulp-level differences
# to the next code (1/16 apart), so the runs drift apart slowly. Measured: bf16 + adamw, losses
# 1e-4 relative, params 7e-4 (relative norm of the difference over all params); coat +
# fp8_adamw, losses 2e-3, params 6e-3 (the embedding's rows move most); two processes vs
# one, 8e-8.
TOLERANCES = {"bf16": (1e-3, 5e-3), "coat": (5e-3, 3e-2)}  # (losses, params), relative


def launch(workdir, mesh, *extra, devices=8, env_extra=None):
    cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs/llama_tiny.py"),
           f"--config.workdir={workdir}", *STEPS, *extra]  # fmt: skip
    cmd += [f"--config.mesh.{k}={v}" for k, v in zip(("data", "fsdp", "tensor"), mesh, strict=True)]
    # Runs of the same program (a resumed run and the run it resumes) share their compiles.
    cache = pathlib.Path(workdir).parent / "xla_cache"
    cmd += [f"--config.compile_cache_dir={cache}"]
    env = child_env(JAX_PLATFORMS="cpu", **(env_extra or {}))
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip


def finish(proc):
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    return out


def run(workdir, mesh, *extra, devices=8):
    return finish(launch(workdir, mesh, *extra, devices=devices))


def losses(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return {r["step"]: (r["train_loss"], r["eval_loss"]) for r in records}


def params(workdir, step):
    """A checkpoint's params (flat fp64), saved on any mesh, restored onto one device."""
    import jax

    path = os.path.join(workdir, "checkpoints", str(step), "params")
    checkpointer = ocp.PyTreeCheckpointer()
    meta = checkpointer.metadata(path)
    tree = getattr(getattr(meta, "item_metadata", meta), "tree", meta)
    here = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    args = jax.tree.map(lambda _: ocp.ArrayRestoreArgs(sharding=here), tree)
    leaves = jax.tree.leaves(checkpointer.restore(path, restore_args=args))
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in leaves])


def assert_runs_close(workdir, ref, precision="coat", steps=(5, 10)):
    loss_rtol, param_rtol = TOLERANCES[precision]
    got, want = losses(workdir), losses(ref)
    assert got.keys() == want.keys()
    for step in got:
        np.testing.assert_allclose(got[step], want[step], rtol=loss_rtol, err_msg=f"step {step}")
    for step in steps:
        p, q = params(workdir, step), params(ref, step)
        error = np.linalg.norm(p - q) / np.linalg.norm(q)
        print(f"{workdir.name} vs {ref.name}, step {step}: params {error:.2e}")
        assert error <= param_rtol, (step, error)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_meshes_processes_and_checkpoints(tmp_path):
    """One device (coat + fp8_adamw, the XLA chain) vs meshes 2x4x1 (the fused optimizer kernel
    on each shard) and 2x2x2, bf16 + adamw with tight tolerances, a checkpoint saved on 2x4x1
    resumed on 2x2x2 and on one device, and 2 processes x 4 CPU devices joined by
    jax.distributed (gloo) vs 1 process x 8."""
    port = free_port()
    # the fused update's kernel on each shard; fp32 gradients as the one-device chain's
    fused = ("--config.optimizer.kernels=interpret", "--config.grad_dtype=float32")
    multi = [
        launch(
            tmp_path / "two_processes",
            (2, 4, 1),
            *fused,
            devices=4,
            env_extra={
                "JAX_COORDINATOR_ADDRESS": f"localhost:{port}",
                "JAX_NUM_PROCESSES": "2",
                "JAX_PROCESS_ID": str(i),
            },
        )  # fmt: skip
        for i in range(2)
    ]
    outs = [finish(p) for p in multi]
    assert "8 devices (cpu; 2 processes)" in outs[0]
    assert "step 10" not in outs[1]  # only process 0 logs

    ref = tmp_path / "one_device"
    run(ref, (1, 1, 1), devices=1)  # the XLA chain on one device
    # 2x4x1 with the fused optimizer kernel (interpreted) on each device's shard, vs the chain
    out = run(tmp_path / "2x4x1", (2, 4, 1), *fused)
    assert "Optimizer: fused FP8 AdamW kernel" in out
    assert_runs_close(tmp_path / "2x4x1", ref)
    run(tmp_path / "2x2x2", (2, 2, 2))
    assert_runs_close(tmp_path / "2x2x2", ref)
    # Same program on 8 devices in one process or in two: equal up to collective sum order.
    assert_runs_close(tmp_path / "two_processes", tmp_path / "2x4x1")

    bf16 = ("--config.precision=bf16", "--config.optimizer.name=adamw")
    run(tmp_path / "bf16_one_device", (1, 1, 1), *bf16, devices=1)
    run(tmp_path / "bf16_2x2x2", (2, 2, 2), *bf16)
    assert_runs_close(tmp_path / "bf16_2x2x2", tmp_path / "bf16_one_device", "bf16")

    saved = tmp_path / "2x4x1"
    for mesh, devices in [((2, 2, 2), 8), ((1, 1, 1), 1)]:
        resumed = tmp_path / f"resumed_on_{'x'.join(map(str, mesh))}"
        shutil.copytree(saved, resumed)
        shutil.rmtree(resumed / "checkpoints" / "10")
        out = run(resumed, mesh, "--config.resume=True", devices=devices)  # the XLA chain
        assert "Resumed from step 5" in out
        np.testing.assert_array_equal(params(resumed, 5), params(saved, 5))
        assert_runs_close(resumed, saved, steps=(10,))


def test_batch_rows_come_from_the_sampler():
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sampler = data.BatchSampler(np.arange(1000), seq_len=7, batch_size=6, seed=3)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "t"))
    asked = []

    def rows_of(rows):
        asked.append(list(rows))
        return sampler.batch(4, rows=rows)

    target = NamedSharding(mesh, P(None, ("data", "fsdp"), None))
    batch = parallel.sharded_batch(rows_of, (2, 3, 8), target)
    np.testing.assert_array_equal(np.asarray(batch).reshape(6, 8), sampler.batch(4))
    assert asked == [list(range(6))]
    np.testing.assert_array_equal(sampler.batch(4, rows=[5, 1]), sampler.batch(4)[[5, 1]])


def test_distributed_launch_needs_all_three_variables(monkeypatch):
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "localhost:1")
    monkeypatch.delenv("JAX_NUM_PROCESSES", raising=False)
    monkeypatch.setenv("JAX_PROCESS_ID", "0")
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES"):
        parallel.initialize_from_env()


@pytest.mark.parametrize(
    ("override", "match"),
    [({"data": 0}, "mesh.data"), ({"fsdp": -1}, "at most one"), ({"tensor": -2}, "mesh.tensor")],
)
def test_bad_mesh_config(override, match):
    c = configs.base_config()
    c.mesh.update(override)
    with pytest.raises(ValueError, match=match):
        configs.validate(c)


def test_batch_must_divide_over_the_mesh(tmp_path):
    proc = launch(tmp_path, (8, 1, 1), "--config.batch_size=4")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0 and "divide over mesh data x fsdp = 8" in out, out[-2000:]


def test_a_tensor_axis_must_divide_the_heads(tmp_path):
    """llama_tiny has 4 heads, 2 of them key/value: tensor=4 would split each key/value
    head's columns in two (it trained, silently resharding around attention)."""
    proc = launch(tmp_path / "run", (2, 1, 4), "--config.batch_size=8")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0, out[-2000:]
    assert out.strip().splitlines()[-1] == (
        "train.py: config.mesh.tensor=4 must divide config.model.n_heads=4 and its key/value "
        "heads (2): heads are split whole over the tensor axis"
    ), out[-2000:]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_sigterm_to_one_of_two_processes_stops_both_at_one_checkpoint(tmp_path):
    """A scheduler that signals only one process: both agree on the step (an any-reduction
    read one step later), write one checkpoint together and exit 0."""
    port = free_port()
    procs = [
        launch(tmp_path / "run", (2, 4, 1), "--config.steps=5000", "--config.log_interval=1000",
               "--config.checkpoint_interval=0", devices=4,
               env_extra={"JAX_COORDINATOR_ADDRESS": f"localhost:{port}",
                          "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(i)})  # fmt: skip
        for i in range(2)
    ]
    lines = []
    for line in procs[0].stdout:
        lines.append(line)
        if "First step" in line:
            break
    procs[1].send_signal(signal.SIGTERM)
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    stopped = [ln for ln in outs[0].splitlines() if ln.startswith("Stopped by")]
    assert stopped and "a signal to another process" in stopped[0], "".join(lines) + outs[0]
    step = int(stopped[0].split("at step ")[1].split(":")[0])
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [str(step)]
    assert len(params(tmp_path / "run", step)) > 0
