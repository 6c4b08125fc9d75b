"""CPU smoke tests of the end-to-end benches (bench/e2e.py, bench/fidelity.py): tiny shapes,
real subprocesses, the JSON they write."""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import e2e  # noqa: E402

# 8 CPU "devices" for the FSDP runs.
EIGHT = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
TINY = ("--model", "tiny", "--seq_len", "32", "--steps", "2", "--warmup", "1",
        "--policies", "bf16+adamw,coat+fp8_adamw", "--set", "optimizer.min_size=1")  # fmt: skip


def run(script, *args, env=None, check=True):
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu") | (env or {}),
    )
    if not check:
        return out
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def finite(x):
    return isinstance(x, (int, float)) and math.isfinite(x)


@pytest.mark.slow
def test_e2e_measures_each_policy_and_finds_a_largest_batch(tmp_path):
    # A 20 MB "device" makes the largest-batch search run on a CPU (which has no memory limit).
    out = run("e2e.py", "--model", "tiny", "--seq_len", "32", "--batch", "2", "--steps", "2",
              "--warmup", "1", "--device_limit_gb", "0.02", "--max_compiles", "3",
              "--policies", "bf16+adamw,coat+fp8_adamw", "--set", "optimizer.min_size=1",
              "--cache_dir", str(tmp_path / "cache"),
              "--json", str(tmp_path / "e2e.json"))  # fmt: skip
    report = json.loads((tmp_path / "e2e.json").read_text())
    assert {
        "date",
        "device",
        "jax",
        "config",
        "results",
        "ratios_vs_bf16",
        "targets",
        "paper",
    } <= set(report)
    assert "| coat+fp8_adamw |" in out
    for r in report["results"]:
        assert r["returncode"] == 0 and r["compiles"] <= 3
        fixed, plan = r["fixed"], r["plans"]["2"]
        assert fixed["batch"] == 2 and not fixed["oom"]
        assert finite(fixed["tokens_per_s"]) and finite(fixed["loss"]) and fixed["tokens_per_s"] > 0
        assert fixed["peak_bytes"] is None and fixed["mfu"] is None  # a CPU has neither
        assert all(finite(plan[k]) and plan[k] > 0 for k in ("params", "grads", "compiled_total"))
        assert plan["optimizer_state"] > 0 and plan["activations_estimate"] > 0
        # The largest batch ran, and its compiled plan fits the limit.
        assert r["max_batch"] > 2 and r["max"]["batch"] == r["max_batch"]
        assert r["plans"][str(r["max_batch"])]["compiled_total"] <= 0.02e9
        assert finite(r["max"]["tokens_per_s"]) and set(r["phases_s"]) >= {"compile batch 2"}
        # Two processes: the fixed batch, then the search, whose first run is its largest.
        assert r["returncodes"] == {"fixed": 0, "search": 0}
        assert r["runs"] == [2, r["max_batch"]]
    bf16, coat = (r["plans"]["2"] for r in report["results"])
    assert coat["optimizer_state"] < 0.3 * bf16["optimizer_state"]  # FP8 vs fp32 moments
    ratios = report["ratios_vs_bf16"]["coat+fp8_adamw"]
    assert ratios["peak_memory_ratio_same_batch"] is None  # no peak on a CPU
    assert finite(ratios["planned_memory_ratio_same_batch"]) and finite(ratios["max_batch_ratio"])


def test_e2e_search_child_runs_its_largest_candidate_first(tmp_path):
    # Batch 8 over a 4 MB "device": the fixed child finds its plan over the limit (nothing
    # run); the search child compiles below it, then creates params and state once and runs
    # the largest candidate before anything else.
    run("e2e.py", *TINY[:-4], "--policies", "bf16+adamw", *TINY[-2:], "--batch", "8",
        "--device_limit_gb", "0.004", "--max_compiles", "3",
        "--cache_dir", str(tmp_path / "cache"), "--json", str(tmp_path / "e2e.json"))  # fmt: skip
    (r,) = json.loads((tmp_path / "e2e.json").read_text())["results"]
    assert r["returncodes"] == {"fixed": 0, "search": 0} and r["returncode"] == 0
    assert r["fixed"] == {"batch": 8, "oom": True, "reason": "compiled plan over the limit"}
    assert 0 < r["max_batch"] < 8 and r["max"]["batch"] == r["max_batch"]
    assert r["runs"] == [r["max_batch"]]  # the first (and here only) device step: the largest
    assert r["plans"][str(r["max_batch"])]["compiled_total"] <= 0.004e9
    phases = list(r["phases_s"])
    assert "init params + optimizer state" not in phases  # the fixed child ran nothing
    init = phases.index("init params + optimizer state (search)")
    assert phases[init + 1 :] == [f"run batch {r['max_batch']}"]
    assert all(p.startswith("compile batch") for p in phases[:init]) and init >= 2


@pytest.mark.slow
def test_e2e_on_two_devices_matches_one_device(tmp_path):
    cache = ("--cache_dir", str(tmp_path / "cache"))
    out = run("e2e.py", *TINY, *cache, "--fsdp", "2", "--batch", "2", "--device_limit_gb", "0.005",
              "--max_compiles", "3", "--json", str(tmp_path / "two.json"), env=EIGHT)  # fmt: skip
    # The unsharded reference: bf16 only (FP8 on both sides differs by rounding flips of 3-bit
    # mantissas, gradients ~10% apart here and both ~21% from bf16's: measured 0.018 in loss).
    one_device = (*TINY[:-4], "--policies", "bf16+adamw", *TINY[-2:])
    run("e2e.py", *one_device, *cache, "--batch", "2", "--json", str(tmp_path / "one.json"))
    two, one = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("two", "one"))
    assert "on 2 x cpu (mesh data 1, fsdp 2, tensor 1" in out and "paper, 2 GPU" in out
    assert two["devices"] == 2 and two["mesh"] == {"data": 1, "fsdp": 2, "tensor": 1}
    assert one["devices"] == 1 and two["config"]["fsdp"] == 2
    for r in two["results"]:
        assert r["returncode"] == 0 and r["devices"] == 2
        fixed = r["fixed"]
        assert fixed["tokens_per_s_per_device"] == pytest.approx(fixed["tokens_per_s"] / 2)
        # The search moves one sequence per device at a time; its plans are per device.
        assert r["max_batch"] > 2 and r["max_batch"] % 2 == 0
        assert r["plans"][str(r["max_batch"])]["compiled_total"] <= 0.005e9
        assert finite(r["max"]["tokens_per_s_per_device"])
    # Same seed, same tokens, three steps (the first at learning rate 0): the last step's loss
    # matches the unsharded step's up to the reduction order (measured 6e-4; one step of
    # training moves it by 0.02).
    loss, loss1 = two["results"][0]["fixed"]["loss"], one["results"][0]["fixed"]["loss"]
    assert abs(loss - loss1) < 3e-3


def test_e2e_refuses_a_batch_that_does_not_split_over_the_devices():
    out = run("e2e.py", *TINY, "--fsdp", "2", "--batch", "3", env=EIGHT, check=False)
    assert out.returncode != 0 and "==" not in out.stdout  # before any child
    assert (
        out.stderr.strip() == "e2e.py: --batch 3 (global) must be a positive multiple of --fsdp 2"
    )


def test_e2e_merge_combines_separate_runs_and_refuses_different_ones(tmp_path, capsys):
    def write(name, policy, jax_version="0.11.2", **config):
        fixed = {"batch": 2, "oom": False, "tokens_per_s": 1000.0, "peak_bytes": 4e9,
                 "tokens_per_s_per_device": 500.0, "mfu": 0.4}  # fmt: skip
        result = {"policy": policy, "device": "H200", "devices": 2, "params": 7e9,
                  "mesh": {"data": 1, "fsdp": 2, "tensor": 1}, "device_limit_bytes": 1.3e11,
                  "plans": {"2": {"compiled_total": 3e9}}, "fixed": fixed, "max": fixed,
                  "max_batch": 4 if policy == "bf16+adamw" else 8}  # fmt: skip
        config = {"model": "llama2_7b", "seq_len": 2048, "batch": 2, "fsdp": 2, "set": []} | config
        path = tmp_path / name
        path.write_text(json.dumps({"config": config, "wall_s": 5.0, "results": [result],
                                    "jax": jax_version, "date": "2026-11-30"}))  # fmt: skip
        return str(path)

    a, b = write("a.json", "bf16+adamw"), write("b.json", "coat+fp8_adamw")
    e2e.merge([a, b], str(tmp_path / "ab.json"))
    out = capsys.readouterr().out
    assert "| bf16+adamw |" in out and "| coat+fp8_adamw |" in out and "paper, 2 GPU" in out
    merged = json.loads((tmp_path / "ab.json").read_text())
    assert [r["policy"] for r in merged["results"]] == ["bf16+adamw", "coat+fp8_adamw"]
    assert merged["ratios_vs_bf16"]["coat+fp8_adamw"]["max_batch_ratio"] == 2.0
    assert merged["devices"] == 2 and merged["merged_from"] == [a, b]
    assert (merged["jax"], merged["date"]) == ("0.11.2", "2026-11-30")  # the runs', not ours
    with pytest.raises(ValueError, match="different jax versions"):
        e2e.merge([a, write("d.json", "coat+fp8_adamw", jax_version="0.10.2")], None)
    for key, value in (("fsdp", 1), ("seq_len", 4096), ("model", "tinyllama_1b"), ("batch", 4)):
        other = write("c.json", "coat+fp8_adamw", **{key: value})
        with pytest.raises(ValueError, match=f"differs from .*a.json in {key}"):
            e2e.merge([a, other], None)
    with pytest.raises(ValueError, match="appears twice"):
        e2e.merge([a, a], None)


@pytest.mark.slow
def test_fidelity_runs_three_resumable_runs_and_reports_gaps(tmp_path):
    work = tmp_path / "runs"
    args = ["--config", str(ROOT / "configs" / "llama_tiny.py"), "--steps", "4",
            "--chunk_steps", "4", "--set", "optimizer.warmup_steps=1", "--set", "log_interval=2",
            "--workdir", str(work), "--cache_dir", str(tmp_path / "cache"),
            "--json", str(tmp_path / "fidelity.json")]  # fmt: skip
    out = run("fidelity.py", *args)
    assert "estimated time left" in out
    report = json.loads((tmp_path / "fidelity.json").read_text())
    assert report["status"] == "complete" and report["config"]["steps"] == 4
    assert set(report["runs"]) == {"bf16+adamw", "coat+fp8_adamw", "coat+fp8_adamw, no expansion"}
    for run_summary in report["runs"].values():
        assert run_summary["steps"] == 4
        assert finite(run_summary["final_train_loss"]) and finite(run_summary["final_eval_loss"])
    for gap in report["gaps_vs_bf16"].values():
        assert finite(gap["gap_train_loss"]) and abs(gap["gap_eval_loss"]) < 0.05
    assert (work / "loss_curves.png").stat().st_size > 10_000
    assert (tmp_path / "fidelity.md").read_text().count("\n") == 5
    # Runs already at their last step are not run again.
    again = run("fidelity.py", *args)
    assert (
        "==" not in again
        and json.loads((tmp_path / "fidelity.json").read_text())["runs"] == report["runs"]
    )
    # A run that failed (train.py stops on a NaN loss) is reported as failed, left out of the
    # gaps and not retried; --report_only trains nothing.
    error = "FloatingPointError: loss is nan at step 4; stopping"
    (work / "coat_fp8_adamw_no_expansion" / "failed.json").write_text(
        json.dumps({"exit": 1, "error": error, "command": "train.py ..."})
    )
    out = run("fidelity.py", *args, "--report_only", "--device", "test device")
    report = json.loads((tmp_path / "fidelity.json").read_text())
    assert "==" not in out and report["device"] == "test device"
    assert report["status"] == "complete; failed: coat+fp8_adamw, no expansion"
    assert report["runs"]["coat+fp8_adamw, no expansion"]["failed"]["error"] == error
    assert set(report["gaps_vs_bf16"]) == {"coat+fp8_adamw"}
    assert f"failed: {error}" in (tmp_path / "fidelity.md").read_text()


def test_only_the_search_child_preallocates(monkeypatch):
    """The search child gets one allocator region (XLA_PYTHON_CLIENT_PREALLOCATE=true, see the
    module's Method); the fixed-batch child keeps the caller's setting."""
    seen = {}

    def fake_run(cmd, env, timeout):
        seen[cmd[cmd.index("--phase") + 1]] = env.get("XLA_PYTHON_CLIENT_PREALLOCATE")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(e2e.subprocess, "run", fake_run)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    args = e2e.parse_args(["--model", "llama_134m"])
    e2e.run_child(args, "bf16+adamw", None, "fixed")
    e2e.run_child(args, "bf16+adamw", None, "search", {"policy": "bf16+adamw"})
    assert seen == {"fixed": "false", "search": "true"}


@pytest.mark.parametrize("runs", ["bf16+adamw;nope", "coat+fp8_adamw, bf16 gradients"])
def test_fidelity_runs_are_checked_before_anything_trains(runs, tmp_path):
    """--runs: names from fidelity.RUNS, the bf16 baseline among them; else a one-line error."""
    out = run("fidelity.py", "--runs", runs, "--workdir", str(tmp_path), check=False)
    assert out.returncode != 0 and "fidelity.py: --runs" in out.stderr
    assert not any(tmp_path.iterdir())


def test_policy_names_may_ask_for_bf16_gradients():
    args = e2e.parse_args(["--model", "llama_134m"])
    assert e2e.bench_config(args, "coat+fp8_adamw").grad_dtype == "float32"
    config = e2e.bench_config(args, "coat+fp8_adamw+bf16_grads")
    assert (config.precision, config.optimizer.name, config.grad_dtype) == (
        "coat",
        "fp8_adamw",
        "bfloat16",
    )
    with pytest.raises(ValueError, match="third part"):
        e2e.bench_config(args, "coat+fp8_adamw+fp16")


def test_batch_below_follows_the_local_slope_of_the_compiled_totals():
    # TinyLlama's COAT search on an H200 (GB): the line from batch 1 said 53, over the limit;
    # one sequence at a time ran out of compiles. The local slope (53 -> 58) jumps to 48.
    totals = {1: 11.15e9, 53: 148.33e9, 58: 154.97e9}
    room = 142.6e9
    b = e2e.batch_below(53, totals, room, 1)
    slope = (totals[58] - totals[53]) / 5
    assert totals[53] - slope * (53 - b) <= room < totals[53] - slope * (53 - b - 1)
    assert b == 48
    # Steps of n (one sequence per device), at least one step, and straight down without a slope.
    assert e2e.batch_below(26, {2: 36.8e9, 26: 140.9e9, 28: 146.1e9}, 140.0e9, 2) == 24
    assert e2e.batch_below(26, {2: 36.8e9, 26: 140.9e9}, 140.8e9, 2) == 24
    assert e2e.batch_below(8, {8: 9.0e9}, 1.0e9, 2) == 6
    assert e2e.batch_below(8, {8: 9.0e9, 4: 9.5e9}, 1.0e9, 2) == 6
