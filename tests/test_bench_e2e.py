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


def run(script, *args):
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu"),
    )
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
    bf16, coat = (r["plans"]["2"] for r in report["results"])
    assert coat["optimizer_state"] < 0.3 * bf16["optimizer_state"]  # FP8 vs fp32 moments
    ratios = report["ratios_vs_bf16"]["coat+fp8_adamw"]
    assert ratios["peak_memory_ratio_same_batch"] is None  # no peak on a CPU
    assert finite(ratios["planned_memory_ratio_same_batch"]) and finite(ratios["max_batch_ratio"])


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
