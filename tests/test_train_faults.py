"""What train.py does when a run meets trouble: non-finite steps, SIGTERM / SIGINT, damaged and
non-finite checkpoints, bad data, misspelt keys, resumes with a changed config, earlier runs'
files. Each test drives a real train.py subprocess (or the library piece it relies on) and
checks the behaviour, not only that no exception escaped."""

import importlib.util
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from child_env import child_env
from tiny import tiny_run

from coat_jax.training import data
from coat_jax.training.checkpoint import Checkpointer, NonFiniteStateError, StateLayoutError

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ["--config", str(ROOT / "configs/llama_tiny.py")]
QUIET = ["--config.progress=False"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One compilation cache for the module's runs (most compile the same program)."""
    return tmp_path_factory.mktemp("xla_cache")


def command(workdir, *overrides, cache=None):
    cmd = [sys.executable, str(ROOT / "train.py"), *TINY, *QUIET, f"--config.workdir={workdir}"]
    if cache:
        cmd.append(f"--config.compile_cache_dir={cache}")
    return cmd + list(overrides)


def environment():
    return child_env(
        drop_prefix="XLA_PYTHON_CLIENT_", JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0"
    )


def train(workdir, *overrides, cache=None, cwd=ROOT, cmd=None):
    cmd = cmd or command(workdir, *overrides, cache=cache)
    return subprocess.run(cmd, cwd=cwd, env=environment(), capture_output=True, text=True,
                          timeout=600)  # fmt: skip


def metrics(workdir, name="metrics.jsonl"):
    with open(os.path.join(workdir, name)) as f:
        return [json.loads(line) for line in f]


def checkpoint_leaves(workdir, step, item="params"):
    path = os.path.join(workdir, "checkpoints", str(step), item)
    return [np.asarray(x) for x in jax.tree.leaves(ocp.PyTreeCheckpointer().restore(path))]


def finite(leaves):
    return all(np.isfinite(x.astype(np.float32)).all() for x in leaves if x.dtype.kind in "fV")


# --- non-finite steps ---


def small_run(**overrides):
    return tiny_run(batch_size=4, seq_len=32, **overrides)


@pytest.mark.parametrize("in_backward, master", [(False, "fp32"), (True, "fp32"),
                                                 (True, "bf16+8")],
                         ids=["after_backward", "in_backward", "in_backward_bf16+8"])  # fmt: skip
@pytest.mark.parametrize(
    "kernels", ["reference", "interpret", pytest.param("pallas", marks=pytest.mark.gpu)]
)
def test_a_nonfinite_step_leaves_params_and_state_unchanged(kernels, in_backward, master):
    """The train step with one NaN weight: loss NaN, skipped, params and optimizer state (FP8
    codes, scales, count; BF16 master weights' remainders) returned bit-identical; the next
    finite step updates as usual. With the fused update's kernel compiled (GPU), interpreted,
    and the XLA chain; with the update after the backward pass (under ``lax.cond``) and in it
    (the kernel's skip flag; the XLA chain: a select per array)."""
    run = small_run(**{"optimizer.kernels": kernels, "optimizer.min_size": 1024,  # FP8 moments
                      "optimizer.update_in_backward": in_backward,
                      "optimizer.master_weights": master})  # fmt: skip
    assert run.fused_update == (kernels != "reference")
    params, opt_state = run.create()
    tokens = jax.random.randint(jax.random.key(1), run.batch_shape(), 0, 256)
    poison = lambda path, x: x.at[0, 0].set(jnp.nan) if "wq" in jax.tree_util.keystr(path) else x
    poisoned = jax.tree_util.tree_map_with_path(poison, params)  # every token reads wq
    raw = lambda tree: [np.atleast_1d(np.asarray(x)).view(np.uint8) for x in jax.tree.leaves(tree)]
    before = raw((poisoned, opt_state))
    new_params, new_state, m = run.train_step(poisoned, opt_state, tokens)
    assert bool(m["skipped"]) and not np.isfinite(float(m["loss"]))
    for a, b in zip(before, raw((new_params, new_state)), strict=True):
        np.testing.assert_array_equal(a, b)
    params, opt_state = run.create()
    new_params, _, m = run.train_step(params, opt_state, tokens)
    assert not bool(m["skipped"]) and np.isfinite(float(m["loss"]))
    assert finite([np.asarray(x) for x in jax.tree.leaves(new_params)])


@pytest.mark.slow
def test_divergence_is_skipped_then_stops_and_no_checkpoint_holds_nan(tmp_path, cache):
    """lr=1e3 with checkpoints between log steps (the issue's trial): the non-finite steps are
    skipped, named one a line, the run stops after config.skip_nonfinite in a row with one
    line, every checkpoint is finite, and a resume with a sane lr trains on."""
    args = ["--config.steps=60", "--config.log_interval=20", "--config.checkpoint_interval=5"]
    out = train(tmp_path, *args, "--config.optimizer.lr=1e3", "--config.skip_nonfinite=3",
                cache=cache)  # fmt: skip
    assert out.returncode == 1, out.stdout + out.stderr
    skipped = [line for line in out.stdout.splitlines() if "not finite; skipped" in line]
    assert len(skipped) == 4
    assert out.stderr.strip().splitlines()[-1].startswith("train.py: 4 steps in a row up to step")
    assert "Traceback" not in out.stderr
    steps = Checkpointer(str(tmp_path / "checkpoints")).all_steps()
    assert steps
    for step in steps:
        saved = checkpoint_leaves(tmp_path, step) + checkpoint_leaves(tmp_path, step, "opt_state")
        assert finite(saved)
    # The newest checkpoint is finite but diverges again; roll back to the first one.
    out = train(tmp_path, *args, "--config.resume=True", "--config.resume_step=5", cache=cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "optimizer.lr: 1000.0 -> 0.003" in out.stdout and "Resumed from step 5" in out.stdout
    for step in steps[1:]:
        assert f"Checkpoint {step} set aside (newer than config.resume_step=5)" in out.stdout
        assert (tmp_path / "checkpoints_superseded" / str(step)).is_dir()
    assert "not finite; skipped" not in out.stdout
    assert all(np.isfinite(r["train_loss"]) for r in metrics(tmp_path) if r["step"] > 5)


def test_checkpointer_refuses_nan_and_resume_walks_past_it(tmp_path):
    """save() raises on a non-finite state and writes nothing; a NaN checkpoint written by an
    older version is skipped on restore, moved aside, and the one before it restored."""
    ckpt = Checkpointer(str(tmp_path / "checkpoints"), keep=5, async_save=False)
    params = {"w": jnp.arange(8.0)}
    state = {"m": jnp.ones(8, jnp.float8_e4m3fn)}
    ckpt.save(1, params, state, {"seed": 0})
    with pytest.raises(NonFiniteStateError, match="step 2: .* NaN or Inf; not saved"):
        ckpt.save(2, params, {"m": jnp.full(8, jnp.nan, jnp.float8_e4m3fn)}, {"seed": 0})
    assert ckpt.all_steps() == [1]
    args = ocp.args.Composite(params=ocp.args.StandardSave({"w": jnp.full(8, jnp.inf)}),
                              opt_state=ocp.args.StandardSave(state),
                              meta=ocp.args.JsonSave({"step": 3, "seed": 0}))  # fmt: skip
    ckpt._manager.save(3, args=args)  # as a version without the check wrote it
    ckpt._manager.wait_until_finished()
    lines = []
    restored = ckpt.restore_newest(params, state, log=lines.append)
    assert restored.step == 1 and [s for s, *_ in restored.skipped] == [3]
    assert lines == [f"Checkpoint 3 skipped (holds NaN or Inf); moved to {tmp_path}/"
                     "checkpoints_damaged/3"]  # fmt: skip
    assert (tmp_path / "checkpoints_damaged" / "3" / "params").is_dir()
    assert ckpt.all_steps() == [1]
    np.testing.assert_array_equal(restored.params["w"], params["w"])


def test_an_older_fp8_state_layout_is_refused_in_one_line_and_left_in_place(tmp_path):
    """A checkpoint written before layout 2 (no ``opt_state_layout`` in its meta) is not
    passed over as damaged: restore_newest raises naming both layouts and moves nothing."""
    import coat_jax

    ckpt = Checkpointer(str(tmp_path / "checkpoints"), keep=5, async_save=False)
    params = {"w": jnp.ones((4, 256))}
    state = coat_jax.fp8_adamw(1e-3, min_size=0).init(params)
    ckpt.save(1, params, state, {"seed": 0})
    assert ckpt.restore_newest(params, state).step == 1  # this layout reads back
    args = ocp.args.Composite(params=ocp.args.StandardSave(params),
                              opt_state=ocp.args.StandardSave(state),
                              meta=ocp.args.JsonSave({"step": 2, "seed": 0}))  # fmt: skip
    ckpt._manager.save(2, args=args)  # as coat-jax before layout 2 wrote its meta
    ckpt._manager.wait_until_finished()
    with pytest.raises(StateLayoutError, match=r"checkpoints/2 holds fp8_adamw state layout 1 "
                       r"\(coat-jax before 2026-12-01.*reads layout 2") as e:  # fmt: skip
        ckpt.restore_newest(params, state)
    assert "\n" not in str(e.value)
    assert ckpt.all_steps() == [1, 2] and not (tmp_path / "checkpoints_damaged").exists()


# --- damaged checkpoints ---


def largest_file(folder):
    files = [p for p in pathlib.Path(folder).rglob("*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)


def saved_steps(tmp_path, steps, size=4096):
    """A Checkpointer holding ``steps``, each params ``w = step`` (large enough for orbax to
    write a data file that truncation damages)."""
    ckpt = Checkpointer(str(tmp_path / "checkpoints"), keep=10, async_save=False)
    for step in steps:
        ckpt.save(step, {"w": jnp.full(size, float(step))}, {"m": jnp.ones(8)}, {"seed": 0})
    return ckpt, {"w": jnp.zeros(size)}, {"m": jnp.zeros(8)}


def damage(ckpt, step):
    with open(largest_file(os.path.join(ckpt.directory, str(step), "params")), "r+b") as f:
        f.truncate(10)


def test_a_rollback_with_nothing_to_restore_leaves_the_newer_checkpoints(tmp_path):
    """restore_newest(at_most=...) moves the newer checkpoints aside only once an older one
    restored: when none at or before the step does, the newer ones stay in place."""
    ckpt, params, state = saved_steps(tmp_path, (1, 2, 3))
    damage(ckpt, 1)
    lines = []
    assert ckpt.restore_newest(params, state, log=lines.append, at_most=1) is None
    assert ckpt.all_steps() == [2, 3] and not (tmp_path / "checkpoints_superseded").exists()
    assert len(lines) == 1 and lines[0].startswith("Checkpoint 1 skipped (")
    restored = ckpt.restore_newest(params, state, log=lines.append, at_most=2)
    assert restored.step == 2 and float(restored.params["w"][0]) == 2.0
    assert lines[1:] == [f"Checkpoint 3 set aside (newer than config.resume_step=2); moved to "
                         f"{tmp_path}/checkpoints_superseded/3"]  # fmt: skip


def test_reading_params_walks_back_past_damage_and_moves_nothing(tmp_path):
    """restore_params_newest (export, generation, init_from): the newest params that
    restore, one line for each newer one that does not, nothing moved; an explicit step that
    does not restore, or none restoring, is one ValueError line."""
    ckpt, params, _ = saved_steps(tmp_path, (1, 2, 3))
    damage(ckpt, 3)
    lines = []
    step, restored = ckpt.restore_params_newest(params, log=lines.append)
    assert step == 2 and float(restored["w"][0]) == 2.0
    assert len(lines) == 1 and lines[0].startswith(f"Checkpoint {ckpt.directory}/3 does not "
                                                   "restore (")  # fmt: skip
    assert "\n" not in lines[0] and ckpt.all_steps() == [1, 2, 3]
    assert ckpt.restore_params_newest(params, step=1)[0] == 1
    with pytest.raises(ValueError, match=r"checkpoints/3 does not restore \(") as e:
        ckpt.restore_params_newest(params, step=3)
    assert "\n" not in str(e.value)
    with pytest.raises(FileNotFoundError, match=r"no checkpoint 7 \(kept: 1, 2, 3\)"):
        ckpt.restore_params_newest(params, step=7)
    damage(ckpt, 2)
    damage(ckpt, 1)
    with pytest.raises(ValueError, match=r"no checkpoint restores \(tried 3, 2, 1; the oldest"):
        ckpt.restore_params_newest(params, log=lines.append)
    assert ckpt.all_steps() == [1, 2, 3] and not (tmp_path / "checkpoints_damaged").exists()


_SAVE_ON_8 = """
import sys, jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from coat_jax.training.checkpoint import Checkpointer
mesh = jax.make_mesh((4, 2), ("data", "fsdp"))
w = jax.device_put(jnp.arange(64 * 16.0).reshape(64, 16), NamedSharding(mesh, P("fsdp", "data")))
ckpt = Checkpointer(sys.argv[1], async_save=False)
ckpt.save(3, {"w": w}, {"m": jnp.ones(8)}, {"seed": 0})
ckpt.close()
"""

_READ_PARAMS = """
import sys, jax, jax.numpy as jnp, numpy as np
from coat_jax.training.checkpoint import Checkpointer
ckpt = Checkpointer(sys.argv[1])
step, params = ckpt.restore_params_newest({"w": jax.ShapeDtypeStruct((64, 16), jnp.float32)})
np.testing.assert_array_equal(params["w"], np.arange(64 * 16.0).reshape(64, 16))
print(step, jax.device_count(), params["w"].sharding.device_set == {jax.local_devices()[0]})
"""


@pytest.mark.parametrize("devices", [1, 4])
def test_params_saved_on_8_devices_read_on_fewer(tmp_path, devices):
    """export_hf, generate and gemm_error read a run's params into abstract (unsharded)
    trees: a checkpoint written on 8 devices reads on 1 or 4 (it failed with "The available
    devices are different from the devices used to save the checkpoint")."""
    flags = "--xla_force_host_platform_device_count="
    folder = str(tmp_path / "checkpoints")
    for script, count in ((_SAVE_ON_8, 8), (_READ_PARAMS, devices)):
        env = child_env(XLA_FLAGS=f"{flags}{count}", JAX_PLATFORMS="cpu")
        proc = subprocess.run([sys.executable, "-c", script, folder], capture_output=True,
                              text=True, timeout=120, env=env)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["3", str(devices), "True"]


class _FailsOnAClosedLoop:
    """Like a read a failing restore abandoned: its callback fails on asyncio's closed loop
    when it completes (at collection here), which Python reports through sys.unraisablehook."""

    def __init__(self, message):
        self.message = message

    def __del__(self):
        raise RuntimeError(self.message)


@pytest.mark.parametrize("read", ["restore", "restore_params"])
def test_a_failing_restore_prints_no_echoes_of_its_abandoned_reads(tmp_path, monkeypatch, capfd,
                                                                   read):  # fmt: skip
    """The echoes can come before the restore raises (seen with export_hf past a garbage
    manifest: 20 "Event loop is closed" tracebacks, then the one-line walk-back), so the
    filter is in place when a restore starts; other unraisable errors still print."""
    from coat_jax.training import checkpoint

    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)
    monkeypatch.setattr(checkpoint, "_echo_filters_installed", False)
    ckpt, params, state = saved_steps(tmp_path, (1,))

    def restore_with_echoes(step, args):
        _FailsOnAClosedLoop("Event loop is closed")  # dropped at once, as in a TensorStore thread
        raise ValueError("DATA_LOSS: Error reading the manifest")

    monkeypatch.setattr(ckpt._manager, "restore", restore_with_echoes)
    with pytest.raises(ValueError, match="DATA_LOSS"):
        ckpt.restore(1, params, state) if read == "restore" else ckpt.restore_params(1, params)
    _FailsOnAClosedLoop("something else")
    err = capfd.readouterr().err
    assert "Event loop is closed" not in err and "something else" in err


@pytest.mark.slow
def test_resume_walks_back_past_damaged_checkpoints_and_stays_bit_identical(tmp_path, cache):
    """Checkpoints damaged four ways (a stray empty step folder, a truncated data file,
    a garbage-filled one, a missing item): resume says one line for each, moves each aside,
    restores the newest intact one, and ends bit-identical to an uninterrupted run."""
    args = ["--config.steps=30", "--config.log_interval=5", "--config.checkpoint_interval=5",
            "--config.keep_checkpoints=10"]  # fmt: skip
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert train(ref, *args, cache=cache).returncode == 0
    shutil.copytree(ref, run)
    checkpoints = run / "checkpoints"
    for step in (25, 30):  # the run was interrupted after checkpoint 20
        shutil.rmtree(checkpoints / str(step))
    (checkpoints / "22").mkdir()  # a stray empty step folder
    with open(largest_file(checkpoints / "20" / "params"), "r+b") as f:
        f.truncate(100)
    target = largest_file(checkpoints / "15" / "opt_state")
    target.write_bytes(np.random.default_rng(0).bytes(target.stat().st_size))
    shutil.rmtree(checkpoints / "10" / "opt_state")
    out = train(run, *args, "--config.resume=True", cache=cache)
    assert out.returncode == 0, out.stdout + out.stderr
    skips = [line for line in out.stdout.splitlines() if line.startswith("Checkpoint ")]
    assert [line.split()[1] for line in skips] == ["22", "20", "15", "10"], skips
    assert "Resumed from step 5" in out.stdout
    assert "Traceback" not in out.stdout + out.stderr and len(out.stderr.splitlines()) < 5
    assert sorted(p.name for p in (run / "checkpoints_damaged").iterdir()) == [
        "10", "15", "20", "22"]  # fmt: skip
    for a, b in zip(checkpoint_leaves(ref, 30), checkpoint_leaves(run, 30), strict=True):
        np.testing.assert_array_equal(a, b)
    losses = lambda d: [(r["step"], r["train_loss"]) for r in metrics(d)]
    assert losses(ref) == losses(run)


# --- signals ---


def start(workdir, *overrides, cache=None, env_extra=None):
    env = dict(environment(), **(env_extra or {}))
    cmd = command(workdir, *overrides, cache=cache)
    pipe = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.Popen(cmd, cwd=ROOT, env=env, **pipe)


def wait_for(proc, text):
    """Lines of ``proc``'s output up to and including the first one containing ``text``."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if text in line:
            return lines
    raise AssertionError(f"{text!r} never printed:\n{''.join(lines)}")


@pytest.mark.slow
def test_sigterm_checkpoints_the_step_and_exits_zero_and_resume_is_bit_identical(tmp_path, cache):
    args = ["--config.steps=400", "--config.log_interval=100", "--config.checkpoint_interval=400"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert train(ref, *args, cache=cache).returncode == 0
    proc = start(run, *args, cache=cache)
    wait_for(proc, "First step")
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out
    assert "SIGTERM received: stopping after this step" in out
    stopped = [line for line in out.splitlines() if line.startswith("Stopped by SIGTERM")]
    assert stopped, out
    step = int(stopped[0].split("at step ")[1].split(":")[0])
    assert 0 < step < 400 and Checkpointer(str(run / "checkpoints")).all_steps() == [step]
    out = train(run, *args, "--config.resume=True", cache=cache)
    assert out.returncode == 0 and f"Resumed from step {step}" in out.stdout, out.stderr
    for a, b in zip(checkpoint_leaves(ref, 400), checkpoint_leaves(run, 400), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_ctrl_c_stops_with_a_checkpoint_too(tmp_path, cache):
    proc = start(tmp_path, "--config.steps=2000", "--config.checkpoint_interval=0", cache=cache)
    wait_for(proc, "First step")
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0 and "Stopped by SIGINT at step" in out, out
    assert len(Checkpointer(str(tmp_path / "checkpoints")).all_steps()) == 1


def test_a_second_signal_exits_at_once():
    script = (
        "import os, signal, time\n"
        "from coat_jax.training.preemption import StopRequest\n"
        "with StopRequest() as stop:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    assert stop.should_stop() and stop.signal_name == 'SIGTERM'\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(30)\n"
        "print('not reached')\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=environment(),
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == -signal.SIGTERM, out.stdout + out.stderr
    assert "SIGTERM received" in out.stdout and "not reached" not in out.stdout


# --- input errors, named in one line before compiling ---


def assert_one_line_error(out, text):
    assert out.returncode != 0
    assert "Traceback" not in out.stderr, out.stderr
    assert text in out.stderr, out.stdout + out.stderr
    assert "First step" not in out.stdout  # nothing compiled or trained


def test_data_too_short_for_seq_len_is_named_before_anything_is_made(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("hi")
    out = train(tmp_path / "run", f"--config.data.source={path}")
    assert_one_line_error(out, f"{path}: data too short: the train split has 1 tokens, "
                               "seq_len 64 needs at least 66")  # fmt: skip
    assert "Initialized" not in out.stdout and not (tmp_path / "run").exists()
    path.write_text("x" * 1000)  # the train split is long enough, the eval split (50) not
    out = train(tmp_path / "run", f"--config.data.source={path}")
    assert_one_line_error(out, "data too short: the eval split has 50 tokens")


def test_a_workdir_that_is_not_a_folder_is_named(tmp_path):
    (tmp_path / "file").write_text("")
    out = train(tmp_path / "file")
    assert_one_line_error(out, f"config.workdir={str(tmp_path / 'file')!r} exists and is not "
                               "a folder")  # fmt: skip
    out = train(tmp_path, cmd=command("") + ["--config.steps=2"])
    assert_one_line_error(out, "config.workdir must name a folder, got ''")


def test_token_ids_outside_the_vocabulary_are_named_when_loaded(tmp_path):
    tokens = np.arange(1000, dtype=np.uint16) % 256
    tokens[700] = 300
    path = tmp_path / "tokens.bin"
    tokens.tofile(path)
    out = train(tmp_path / "run", f"--config.data.source={path}")
    assert_one_line_error(out, f"{path}: token id 300 at position 700 is outside the model's "
                               "vocabulary [0, 256)")  # fmt: skip


def test_malformed_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "a"}\n\n{"text": "b"\n')
    out = train(tmp_path / "run", f"--config.data.source={path}")
    assert_one_line_error(out, f"{path}:3: not valid JSON")
    with pytest.raises(ValueError, match=r"data.jsonl:1: expected a JSON object, got list"):
        path.write_text("[1, 2]\n")
        data.load_tokens(str(path))


def test_command_line_mistakes_are_one_line(tmp_path):
    out = train(tmp_path, "--config.num_steps=5")
    assert_one_line_error(out, "--config.num_steps: no such config key (did you mean "
                               "--config.steps?)")  # fmt: skip
    assert len(out.stderr.strip().splitlines()) == 1
    out = train(tmp_path, "--config.optimizer.lrr=1")
    assert_one_line_error(out, "--config.optimizer.lrr: no such config key (did you mean "
                               "--config.optimizer.lr?)")  # fmt: skip
    out = train(tmp_path, cmd=[sys.executable, str(ROOT / "train.py"), "--config", "nope.py"])
    assert_one_line_error(out, "--config nope.py: no such file")
    # From another folder without --config: the default config is found beside train.py.
    out = train(tmp_path, cwd=tmp_path, cmd=[sys.executable, str(ROOT / "train.py"),
                                             "--config.steps=0"])  # fmt: skip
    assert_one_line_error(out, "config.steps must be a positive int")
    out = train(tmp_path, cmd=[sys.executable, str(ROOT / "train.py"), "--help"])
    assert out.returncode == 0
    for key in ("--config.optimizer.lr=0.003", "--config.skip_nonfinite=10",
                "--config.data.source='stdlib'", "--config.batch_size=16"):  # fmt: skip
        assert key in out.stdout, out.stdout


@pytest.mark.slow
def test_resume_lists_changed_keys_and_refuses_shape_changes(tmp_path, cache):
    """A checkpointed run resumed with another model shape is refused in one line; with a
    changed batch size and precision it resumes, listing them; a window holding only the
    compiling step reports no throughput."""
    base = ["--config.steps=4", "--config.log_interval=1", "--config.checkpoint_interval=2",
            "--config.optimizer.warmup_steps=1"]  # fmt: skip
    out = train(tmp_path, *base, cache=cache)
    assert out.returncode == 0, out.stderr
    records = metrics(tmp_path)
    assert "tokens_per_s" not in records[0] and records[1]["tokens_per_s"] > 0
    out = train(tmp_path, *base, "--config.resume=True", "--config.model.dim=32")
    assert_one_line_error(out, "cannot resume")
    assert "model.dim: 64 -> 32" in out.stderr
    assert Checkpointer(str(tmp_path / "checkpoints")).all_steps() == [2, 4]  # nothing moved
    # Rolling back below the oldest kept checkpoint is refused before anything moves.
    out = train(tmp_path, *base, "--config.resume=True", "--config.resume_step=1")
    assert_one_line_error(out, "config.resume_step=1: no checkpoint at or before it in")
    assert "(kept: 2, 4); nothing was moved" in out.stderr
    assert Checkpointer(str(tmp_path / "checkpoints")).all_steps() == [2, 4]
    assert not (tmp_path / "checkpoints_superseded").exists()
    # A checkpoint past config.steps: refused, config.json and the metrics left as they are.
    saved = {name: (tmp_path / name).read_text() for name in ("config.json", "metrics.jsonl")}
    out = train(tmp_path, *base[1:], "--config.steps=3", "--config.resume=True")
    assert_one_line_error(out, "checkpoint 4 is past config.steps=3: raise --config.steps")
    assert saved == {name: (tmp_path / name).read_text() for name in saved}
    out = train(tmp_path, *base[1:], "--config.steps=6", "--config.resume=True",
                "--config.batch_size=4", "--config.precision=bf16", cache=cache)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert ("Resuming with changed config keys: batch_size: 8 -> 4; precision: 'coat' -> "
            "'bf16'; steps: 4 -> 6") in out.stdout  # fmt: skip
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2, 3, 4, 5, 6]


def test_an_earlier_runs_metrics_are_not_overwritten(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 10, "train_loss": 1.0}\n')
    out = train(tmp_path, "--config.steps=2", "--config.optimizer.warmup_steps=1")
    assert_one_line_error(out, "holds an earlier run's metrics")
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 10, "train_loss": 1.0}\n'
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]  # no empty checkpoints/ left


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU reports no memory limit")
def test_a_refused_batch_search_leaves_no_folders(tmp_path):
    """batch_size=-1 with no memory limit to plan against: one line, and neither the
    checkpoint folder nor a workdir this run made is left behind (a folder that was there
    stays)."""
    for workdir, existed in ((tmp_path / "new", False), (tmp_path / "mine", True)):
        if existed:
            workdir.mkdir()
        out = train(workdir, "--config.batch_size=-1")
        assert_one_line_error(out, "config.batch_size=-1: the largest batch needs a device "
                                   "memory limit")  # fmt: skip
        assert workdir.exists() is existed and (not existed or not os.listdir(workdir))


def test_out_of_memory_in_the_loop_is_one_line_after_the_checkpoints_are_written():
    """train.py's loop guard: RESOURCE_EXHAUSTED ends the run with one line (what to try next)
    once the checkpoints being written are complete; any other runtime error propagates."""
    spec = importlib.util.spec_from_file_location("train_script", ROOT / "train.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    calls = []
    ckpt = type("Ckpt", (), {"wait": lambda self: calls.append("wait"),
                             "close": lambda self: calls.append("close")})()  # fmt: skip
    with pytest.raises(SystemExit) as e, script.stops_cleanly(ckpt):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 4208 "
                                         "bytes.\nthe allocator's report")  # fmt: skip
    assert str(e.value) == (
        "train.py: out of memory (RESOURCE_EXHAUSTED: Out of memory allocating 4208 bytes.); "
        "--dry_run prints the memory plan and the largest batch that fits, "
        "--config.batch_size=-1 trains at it"
    )
    assert calls == ["wait", "close"]
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"), script.stops_cleanly(ckpt):
        raise jax.errors.JaxRuntimeError("INTERNAL: something else")


@pytest.mark.slow
def test_resume_true_without_checkpoints_keeps_the_old_metrics_aside(tmp_path, cache):
    (tmp_path / "metrics.jsonl").write_text('{"step": 10, "train_loss": 1.0}\n')
    out = train(tmp_path, "--config.steps=2", "--config.log_interval=1", "--config.resume=True",
                "--config.optimizer.warmup_steps=1", cache=cache)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "Earlier metrics kept as" in out.stdout
    assert metrics(tmp_path, "metrics.1.jsonl") == [{"step": 10, "train_loss": 1.0}]
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2]
