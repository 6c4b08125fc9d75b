"""CPU smoke tests of the end-to-end bench (bench/e2e.py): tiny shapes, real subprocesses, the
JSON it writes. The planner's own search is tests/test_planner.py's; bench/fidelity.py's tests
are tests/test_bench_fidelity.py."""

import json
import math
import pathlib
import re
import subprocess
import sys

import pytest
from child_env import child_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import e2e  # noqa: E402

from coat_jax.training import planner  # noqa: E402

# The tiny preset at seq 32, bf16 (FP8 on one device and on two differ by rounding flips of
# 3-bit mantissas: measured 0.018 in loss; bf16 matches up to the reduction order).
TINY = ("--model", "tiny", "--seq_len", "32", "--steps", "2", "--warmup", "1",
        "--policies", "bf16+adamw", "--set", "optimizer.min_size=1", "--batch", "2")  # fmt: skip
ALLOCATOR = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION")
# A CPU has no memory limit: this one leaves the planner 8 MB beyond its margin (plans: 3 MB at
# batch 2), so the largest batch is a few times the fixed one.
ROOM = 8e6
LIMIT_GB = (planner.MARGIN + ROOM) / 1e9
# XLA's CPU backend compiles the tiny step in half the time without LLVM's optimizations.
FAST = {"XLA_FLAGS": "--xla_backend_optimization_level=0"}


def run(script, *args, env=None, check=True):
    base = {k: v for k, v in child_env(JAX_PLATFORMS="cpu").items() if k not in ALLOCATOR}
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=base | (env or {}),  # without ALLOCATOR: train.py's defaults
    )
    if not check:
        return out
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def finite(x):
    return isinstance(x, (int, float)) and math.isfinite(x)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One persistent compilation cache for every e2e run here (children share compiles)."""
    return ("--cache_dir", str(tmp_path_factory.mktemp("xla_cache")))


@pytest.fixture(scope="module")
def one_device(tmp_path_factory, cache):
    """bf16+adamw on one CPU device at batch 2, searched against LIMIT_GB: (stdout, JSON)."""
    path = tmp_path_factory.mktemp("e2e") / "one.json"
    out = run("e2e.py", *TINY, *cache, "--device_limit_gb", str(LIMIT_GB), "--max_compiles", "3",
              "--json", str(path), env=FAST)  # fmt: skip
    return out, json.loads(path.read_text())


@pytest.mark.slow
def test_e2e_measures_the_fixed_batch_and_runs_the_largest(one_device):
    out, report = one_device
    assert {"date", "device", "jax", "config", "results", "ratios_vs_bf16", "targets",
            "paper", "allocator"} <= set(report)  # fmt: skip
    # Each child ran under train.py's allocator (the environment set none), shown with the limit.
    assert report["allocator"] == {ALLOCATOR[0]: "true", ALLOCATOR[1]: "0.95"}
    assert "allocator PREALLOCATE=true, MEM_FRACTION=0.95" in out and "| bf16+adamw |" in out
    (r,) = report["results"]
    assert r["returncodes"] == {"fixed": 0, "search": 0}
    assert r["device_limit_bytes"] == int(LIMIT_GB * 1e9) == report["device_limit_bytes"]
    fixed, plan = r["fixed"], r["plans"]["2"]
    assert fixed["batch"] == 2 and not fixed["oom"] and fixed["tokens_per_s"] > 0
    assert finite(fixed["loss"]) and fixed["peak_bytes"] is None and fixed["mfu"] is None  # CPU
    assert all(plan[k] > 0 for k in ("params", "grads", "optimizer_state", "compiled_total"))
    # The planner's batch (compiles alone, within its margin), then run: the search child's
    # first device step, in a process of its own.
    totals = {int(b): t for b, t in r["compiled_totals"].items()}
    assert len(totals) <= 3 and r["max_batch"] == r["predicted_max_batch"] > 2
    over = [t for b, t in totals.items() if b > r["max_batch"]]
    assert totals[r["max_batch"]] <= ROOM < min(over, default=math.inf)
    assert r["runs"] == [2, r["max_batch"]] and r["max"]["batch"] == r["max_batch"]
    assert finite(r["max"]["tokens_per_s"]) and not r["max"]["oom"]
    phases = list(r["phases_s"])
    assert phases[:3] == ["compile batch 2", "init params + optimizer state", "run batch 2"]
    assert phases[3:] == ["largest batch by compiles", "init params + optimizer state (search)",
                          f"run batch {r['max_batch']}"]  # fmt: skip


@pytest.mark.slow
def test_e2e_on_two_devices_matches_one_device(one_device, cache, tmp_path):
    # No limit: the search child is skipped (the planner's FSDP steps are its own tests').
    flags = FAST["XLA_FLAGS"] + " --xla_force_host_platform_device_count=2"
    env = {"XLA_FLAGS": flags, ALLOCATOR[1]: "0.5"}
    out = run("e2e.py", *TINY, *cache, "--fsdp", "2", "--json", str(tmp_path / "two.json"),
              env=env)  # fmt: skip
    two = json.loads((tmp_path / "two.json").read_text())
    assert "on 2 x cpu (mesh data 1, fsdp 2, tensor 1" in out and "paper, 2 GPU" in out
    assert two["devices"] == 2 and two["mesh"] == {"data": 1, "fsdp": 2, "tensor": 1}
    assert two["allocator"] == {ALLOCATOR[0]: "true", ALLOCATOR[1]: "0.5"}  # the user's wins
    (r,) = two["results"]
    assert r["returncodes"] == {"fixed": 0} and r["search"].startswith("skipped: the device")
    fixed = r["fixed"]
    assert fixed["tokens_per_s_per_device"] == pytest.approx(fixed["tokens_per_s"] / 2)
    # Same seed, same tokens, three steps (the first at learning rate 0): the last step's loss
    # matches the unsharded one up to the reduction order (measured 6e-4; a step moves it 0.02).
    assert abs(fixed["loss"] - one_device[1]["results"][0]["fixed"]["loss"]) < 3e-3


def test_no_search_runs_the_fixed_batch_only(cache, tmp_path):
    path = tmp_path / "fixed.json"
    run("e2e.py", *TINY, *cache, "--device_limit_gb", str(LIMIT_GB), "--no_search", "--json",
        str(path), env=FAST)  # fmt: skip
    (r,) = json.loads(path.read_text())["results"]
    assert r["returncodes"] == {"fixed": 0} and r["search"] == "skipped: --no_search"
    assert r["runs"] == [2] and r["fixed"]["tokens_per_s"] > 0 and r["max_batch"] is None


def test_e2e_refuses_bad_runs_before_any_child(monkeypatch, capsys):
    monkeypatch.setattr(e2e, "run_child", lambda *a, **k: pytest.fail("a child started"))
    for argv, message in [
        (("--fsdp", "2", "--batch", "3"), "--batch 3 (global) must be a positive multiple of "
                                          "--fsdp 2"),
        (("--policies", "bf16+adamw,coat+sgd"), "config.optimizer.name='sgd'"),
        (("--set", "model.dim=63"), "config.model"),
    ]:  # fmt: skip
        with pytest.raises(SystemExit, match=re.escape("e2e.py: " + message)):
            e2e.main(["--model", "tiny", *argv])
    assert "==" not in capsys.readouterr().out


def test_the_search_steps_down_one_sequence_per_device_after_out_of_memory():
    tried = []

    def attempt(b):  # out of memory above 6
        tried.append(b)
        return {"batch": b, "oom": b > 6}

    assert e2e.first_that_runs(10, 2, attempt) == (6, {"batch": 6, "oom": False})
    assert tried == [10, 8, 6]
    assert e2e.first_that_runs(5, 2, lambda b: {"oom": True}) == (0, None)  # 5, 3, 1: none
    assert e2e.first_that_runs(0, 1, attempt) == (0, None)  # the planner found nothing
    assert e2e.first_that_runs(4, 1, lambda b: None) == (None, None)  # stopped: out of time


def test_e2e_merge_combines_separate_runs_and_refuses_different_ones(tmp_path, capsys):
    def write(name, policy, jax_version="0.11.2", allocator="0.95", **config):
        fixed = {"batch": 2, "oom": False, "tokens_per_s": 1000.0, "peak_bytes": 4e9,
                 "tokens_per_s_per_device": 500.0, "mfu": 0.4}  # fmt: skip
        result = {"policy": policy, "device": "H200", "devices": 2, "params": 7e9,
                  "mesh": {"data": 1, "fsdp": 2, "tensor": 1}, "device_limit_bytes": 1.3e11,
                  "plans": {"2": {"compiled_total": 3e9 if policy == "bf16+adamw" else 2e9}},
                  "fixed": fixed, "max": fixed,
                  "max_batch": 4 if policy == "bf16+adamw" else 8}  # fmt: skip
        config = {"model": "llama2_7b", "seq_len": 2048, "batch": 2, "fsdp": 2, "set": []} | config
        path = tmp_path / name
        path.write_text(json.dumps({"config": config, "wall_s": 5.0, "results": [result],
                                    "jax": jax_version, "date": "2026-11-30",
                                    "allocator": {ALLOCATOR[1]: allocator}}))  # fmt: skip
        return str(path)

    a, b = write("a.json", "bf16+adamw"), write("b.json", "coat+fp8_adamw")
    e2e.merge([a, b], str(tmp_path / "ab.json"))
    out = capsys.readouterr().out
    assert "| bf16+adamw |" in out and "| coat+fp8_adamw |" in out and "paper, 2 GPU" in out
    merged = json.loads((tmp_path / "ab.json").read_text())
    assert [r["policy"] for r in merged["results"]] == ["bf16+adamw", "coat+fp8_adamw"]
    ratios = merged["ratios_vs_bf16"]["coat+fp8_adamw"]
    assert ratios["max_batch_ratio"] == 2.0 and ratios["planned_memory_ratio_same_batch"] == 1.5
    assert ratios["peak_memory_ratio_same_batch"] == ratios["tokens_per_s_ratio_same_batch"] == 1
    assert merged["devices"] == 2 and merged["merged_from"] == [a, b]
    assert (merged["jax"], merged["date"]) == ("0.11.2", "2026-11-30")  # the runs', not ours
    with pytest.raises(ValueError, match="different jax versions"):
        e2e.merge([a, write("d.json", "coat+fp8_adamw", jax_version="0.10.2")], None)
    with pytest.raises(ValueError, match="differs from .*a.json in allocator"):
        e2e.merge([a, write("e.json", "coat+fp8_adamw", allocator="0.5")], None)
    for key, value in (("fsdp", 1), ("seq_len", 4096), ("model", "tinyllama_1b"), ("batch", 4)):
        other = write("c.json", "coat+fp8_adamw", **{key: value})
        with pytest.raises(ValueError, match=f"differs from .*a.json in {key}"):
            e2e.merge([a, other], None)
    with pytest.raises(ValueError, match="appears twice"):
        e2e.merge([a, a], None)


def test_policy_names_and_flags_make_the_config():
    args = e2e.parse_args(["--model", "llama_134m", "--fsdp", "4", "--device_limit_gb", "70"])
    config = e2e.bench_config(args, "coat+fp8_adamw")
    assert config.grad_dtype == "auto" and config.memory_limit_gb == 70
    assert config.mesh.to_dict() == {"data": 1, "fsdp": 4, "tensor": 1}
    config = e2e.bench_config(args, "coat+fp8_adamw+bf16_grads")
    assert (config.precision, config.optimizer.name, config.grad_dtype) == (
        "coat",
        "fp8_adamw",
        "bfloat16",
    )
    config = e2e.bench_config(args, "coat+fp8_adamw+bf16_grads+auto_gemm")
    assert (config.grad_dtype, config.fp8.gemm) == ("bfloat16", "auto")
    with pytest.raises(ValueError, match="'fp16' is not one of"):
        e2e.bench_config(args, "coat+fp8_adamw+fp16")
    with pytest.raises(ValueError, match="expected <precision>"):
        e2e.bench_config(args, "coat")
