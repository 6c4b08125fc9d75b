"""bench/fidelity.py: its arithmetic over seeds on synthetic metrics (spread, gaps, paired gaps,
the table, which pairs a time-budget stop leaves), its flag checks, and one real run of the
script on the tiny config (CPU, two seeds, two chunks), rerun to resume without retraining."""

import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from child_env import child_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import fidelity  # noqa: E402

# XLA's CPU backend compiles the tiny step in half the time without LLVM's optimizations.
FAST = {"XLA_FLAGS": "--xla_backend_optimization_level=0"}
ALLOCATOR = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION")


def records(final_train, final_eval, steps=10, failed_at=None):
    """A run's metrics: a train loss each step, ``final_train`` over the last 10% (step 10 of
    10), an eval at the last step; cut at ``failed_at``."""
    out = [{"step": s, "train_loss": 9.0 - s * 0.1, "tokens_per_s": 100.0 * s}
           for s in range(1, steps + 1)]  # fmt: skip
    out[-1].update(train_loss=final_train, eval_loss=final_eval)
    return out[:failed_at] if failed_at else out


def summaries(runs: dict, total=10):
    """run -> seed -> (train, eval[, failed_at]) -> (per_seed, per_run) as main() builds them."""
    per_seed = {}
    for name, seeds in runs.items():
        per_seed[name] = {}
        for seed, (train, evl, *cut) in seeds.items():
            failure = {"exit": 1, "error": "FloatingPointError: nan"} if cut else None
            per_seed[name][seed] = fidelity.summarize_run(records(train, evl, total, *cut), failure)
    return per_seed, {n: fidelity.summarize_seeds(s, total) for n, s in per_seed.items()}


def test_spread_is_mean_sample_std_and_range():
    assert fidelity.spread([]) is None
    assert fidelity.spread([2.0]) == {"n": 1, "mean": 2.0, "std": None, "min": 2.0, "max": 2.0}
    s = fidelity.spread([1.0, 2.0, 4.0])
    assert s["mean"] == pytest.approx(7 / 3) and s["std"] == pytest.approx(
        np.std([1, 2, 4], ddof=1)
    )
    assert (s["n"], s["min"], s["max"]) == (3, 1.0, 4.0)


def test_a_run_over_seeds_counts_only_the_seeds_at_the_last_step():
    per_seed = {0: fidelity.summarize_run(records(2.0, 3.0)),
                1: fidelity.summarize_run(records(2.2, 3.4)),
                2: fidelity.summarize_run(records(1.0, 1.0, steps=6)),  # stopped by a budget
                3: fidelity.summarize_run(records(5.0, 5.0), {"exit": 1, "error": "nan"}),
                }  # fmt: skip
    run = fidelity.summarize_seeds(per_seed, total=10)
    assert run["seeds"] == [0, 1, 2, 3] and run["complete_seeds"] == [0, 1]
    assert run["train_loss"]["mean"] == pytest.approx(2.1) == run["final_train_loss"]
    assert run["train_loss"]["std"] == pytest.approx(np.std([2.0, 2.2], ddof=1))
    assert (run["eval_loss"]["min"], run["eval_loss"]["max"]) == (3.0, 3.4)
    assert run["steps"] == 6 and run["failed"] == {"exit": 1, "error": "nan", "seed": 3}
    # Final train loss of one seed: the mean of the logs over the last 10% of steps (step 10).
    assert per_seed[2]["final_train_loss"] == pytest.approx(1.0)
    none = fidelity.summarize_seeds({0: per_seed[2]}, total=10)
    assert none["train_loss"] is None and none["final_train_loss"] is None


def test_gaps_of_the_means_and_paired_per_seed():
    per_seed, runs = summaries({
        "fp32+adamw": {0: (2.0, 4.0), 1: (3.0, 5.0), 2: (2.5, 4.5, 5)},  # seed 2 failed
        "coat+fp8_adamw": {0: (2.01, 4.0), 1: (3.03, 4.9), 2: (2.4, 4.4)},
        "bf16+adamw": {0: (9.0, 9.0, 5), 1: (9.0, 9.0, 5), 2: (9.0, 9.0, 5)},  # all failed
    })  # fmt: skip
    gaps = fidelity.gaps(runs, per_seed, "fp32+adamw")
    assert list(gaps) == ["coat+fp8_adamw"]  # no gap for the baseline or a run with no seed done
    g = gaps["coat+fp8_adamw"]
    # Means over each run's complete seeds: coat 0, 1, 2 against fp32 0, 1.
    assert g["gap_train_loss"] == pytest.approx((7.44 / 3 - 2.5) / 2.5)
    assert g["within_target_train_loss"] is False  # -0.8%
    assert g["gap_eval_loss"] == pytest.approx((13.3 / 3 - 4.5) / 4.5)
    # Paired: only seeds both runs completed (0 and 1), each against its own seed.
    paired = g["paired_gap_train_loss"]
    assert paired["seeds"] == [0, 1] and paired["per_seed"] == pytest.approx(
        {"0": 0.005, "1": 0.01}
    )
    assert paired["mean"] == pytest.approx(0.0075) and paired["n"] == 2
    assert paired["std"] == pytest.approx(np.std([0.005, 0.01], ddof=1))
    assert (paired["min"], paired["max"]) == pytest.approx((0.005, 0.01))
    assert g["paired_gap_eval_loss"]["per_seed"] == pytest.approx({"0": 0.0, "1": -0.02})
    # Within the target: |gap| <= 0.25%.
    per_seed, runs = summaries({"fp32+adamw": {0: (2.0, 4.0)}, "x": {0: (2.0049, 3.9901)}})
    g = fidelity.gaps(runs, per_seed, "fp32+adamw")["x"]
    assert g["within_target_train_loss"] and g["within_target_eval_loss"]
    assert g["paired_gap_train_loss"]["std"] is None  # one seed: no spread


def test_markdown_names_the_baseline_and_target_and_shows_spreads_and_failures():
    per_seed, runs = summaries({
        "fp32+adamw": {0: (2.0, 4.0), 1: (3.0, 5.0)},
        "coat+fp8_adamw": {0: (2.001, 4.0), 1: (3.003, 5.5, 4)},
    })  # fmt: skip
    table = fidelity.markdown(runs, per_seed, fidelity.gaps(runs, per_seed, "fp32+adamw"),
                              "fp32+adamw", 10)  # fmt: skip
    assert "Baseline fp32+adamw" in table and "target |gap| <= 0.25%" in table
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert len(rows) == 2 + 4 + 2  # two headers, two runs, four seeds
    fp32 = next(r for r in rows if r.startswith("| fp32+adamw | 0,1 |"))
    assert f"2.5000 ± {np.std([2, 3], ddof=1):.4f} [2.0000..3.0000]" in fp32
    # COAT's mean is seed 0's alone (seed 1 failed): far from the mean of both fp32 seeds,
    # 0.05% from fp32's seed 0.
    coat = next(r for r in rows if r.startswith("| coat+fp8_adamw | 0; 1 failed at 4 |"))
    assert "| 2.0010 | -19.96% (out) | +0.05% | 4.0000 | -11.11% (out) | +0.00% |" in coat
    assert "| coat+fp8_adamw | 1 | 4 (last log) | failed: FloatingPointError: nan |" in table
    assert "| coat+fp8_adamw | 0 | 10 | 2.0010 | +0.05% | 4.0000 | +0.00% |" in table


def test_chunks_go_round_robin_and_a_budget_stop_leaves_comparable_steps():
    pairs = fidelity.chunk_pairs(["fp32+adamw", "coat+fp8_adamw"], [0, 1])
    assert pairs == [("fp32+adamw", 0), ("coat+fp8_adamw", 0), ("fp32+adamw", 1),
                     ("coat+fp8_adamw", 1)]  # fmt: skip
    steps = dict.fromkeys(pairs, 0)
    steps["coat+fp8_adamw", 1] = 2  # from an earlier call
    failed = {("fp32+adamw", 1)}
    now, ran = [0.0], []

    def run_chunk(pair, start, end):
        ran.append((pair, start, end))
        steps[pair] = end
        now[0] += 10.0

    done = lambda pair: None if pair in failed else steps[pair]
    need = lambda pair, start, end: 10.0
    stop = fidelity.run_chunks([2, 4, 6], pairs, done, need, run_chunk, budget_s=45,
                               started=0.0, clock=lambda: now[0])  # fmt: skip
    # Step 2: the two pairs not there (the failed one is skipped), then step 4 from the top
    # until the next chunk would pass 45 s.
    assert ran == [(pairs[0], 0, 2), (pairs[1], 0, 2), (pairs[0], 2, 4), (pairs[1], 2, 4)]
    assert stop == "time budget: coat+fp8_adamw, seed 1 to step 4 needs ~10 s"
    assert steps == {pairs[0]: 4, pairs[1]: 4, pairs[2]: 0, pairs[3]: 2}
    ran.clear()
    assert fidelity.run_chunks([2, 4, 6], pairs, done, need, run_chunk) is None  # no budget
    assert {p: steps[p] for p in pairs if p not in failed} == dict.fromkeys(
        pairs[:2] + pairs[3:], 6
    )
    assert ran[0] == (pairs[3], 2, 4) and len(ran) == 4


def test_seed_workdirs_read_the_one_seed_layout_before_it(tmp_path):
    wd = lambda seed, default=0: fidelity.seed_workdir(
        str(tmp_path), "coat+fp8_adamw", seed, default
    )
    parent = tmp_path / "coat_fp8_adamw"
    assert wd(0) == str(parent / "seed0")  # nothing there yet
    parent.mkdir()
    (parent / "metrics.jsonl").write_text('{"step": 1}\n')
    assert wd(0) == str(parent) and wd(1) == str(parent / "seed1")  # no config.json: the default
    assert wd(1, default=1) == str(parent)
    (parent / "config.json").write_text(json.dumps({"seed": 1}))
    assert wd(1) == str(parent) and wd(0) == str(parent / "seed0")
    (parent / "seed1").mkdir()  # a seed<k> of the new layout wins
    assert wd(1) == str(parent / "seed1")


def test_flags_parse_or_name_what_is_wrong():
    assert fidelity.parse_seeds("0,1, 2") == [0, 1, 2]
    for bad in ("", "0,,1", "a", "-1", "1.5", "0,0"):
        with pytest.raises(ValueError, match="--seeds"):
            fidelity.parse_seeds(bad)
    assert fidelity.parse_runs("coat+fp8_adamw;fp32+adamw", "fp32+adamw") == [
        "fp32+adamw", "coat+fp8_adamw"]  # fmt: skip
    names = ["fp32+adamw", "bf16+adamw", "coat+fp8_adamw, bf16 forward GEMMs"]
    assert fidelity.parse_rates(fidelity.DEFAULT_TOKENS_PER_S, names) == {
        "fp32+adamw": 40000, "bf16+adamw": 200000, names[2]: 200000}  # fmt: skip
    assert fidelity.parse_rates(f"{names[2]}=3e5,bf16+adamw=5e5", names) == {
        "fp32+adamw": 40000, "bf16+adamw": 5e5, names[2]: 3e5}  # fmt: skip
    assert fidelity.parse_rates("1000", names) == dict.fromkeys(names, 1000)
    for bad in ("nope=1", "fast", "fp32+adamw=0", "fp32+adamw=-5,100"):
        with pytest.raises(ValueError, match="--tokens_per_s"):
            fidelity.parse_rates(bad, names)


@pytest.mark.parametrize("argv, message", [
    (["--runs", "fp32+adamw;nope"], "--runs: unknown ['nope']"),
    (["--runs", "bf16+adamw;coat+fp8_adamw"], "--baseline 'fp32+adamw' is not among --runs"),
    (["--baseline", "bf16+adamw", "--runs", "fp32+adamw"], "--baseline 'bf16+adamw' is not"),
    (["--seeds", "0,x"], "--seeds '0,x': expected"),
    (["--tokens_per_s", "fp32=1"], "--tokens_per_s: unknown run 'fp32'"),
    (["--set", "fp8.scaling=diagonal"], "run 'fp32+adamw': config.fp8: Fp8Recipe.scaling"),
])  # fmt: skip
def test_bad_flags_stop_with_one_line_before_anything_runs(argv, message, tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("a child started"))
    with pytest.raises(SystemExit) as e:
        fidelity.main([*argv, "--workdir", str(tmp_path / "runs")])
    assert str(e.value).startswith("fidelity.py: " + message) and "\n" not in str(e.value)
    assert not any(tmp_path.iterdir())


def test_error_report_records_the_tools_failure_or_why_it_did_not_run(tmp_path, monkeypatch):
    stem = str(tmp_path / "fid")
    report = fidelity.error_report(str(tmp_path / "none"), stem, dict(os.environ))
    assert report["exit"] is None and report["error"].startswith("skipped: no checkpoint")
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    tool = [sys.executable, "-c", "import sys; print(sys.argv[1:]); sys.exit('no FP8 here')"]
    monkeypatch.setattr(fidelity, "GEMM_ERROR", tool)
    report = fidelity.error_report(str(tmp_path / "run"), stem, dict(os.environ))
    assert report["command"][len(tool):] == ["--from", str(tmp_path / "run"), "--json",
                                             stem + "_gemm_error.json", "--plot",
                                             stem + "_gemm_error.png"]  # fmt: skip
    assert (report["exit"], report["error"]) == (1, "no FP8 here")
    assert fidelity.error_line(report) == "gemm error report: FAILED, exit 1: no FP8 here"


def test_mean_band_over_seeds():
    curves = {0: [{"step": 1, "train_loss": 3.0}, {"step": 2, "train_loss": 2.0}],
              1: [{"step": 1, "train_loss": 5.0}, {"step": 2, "train_loss": float("nan")}],
              2: []}  # fmt: skip
    assert fidelity.mean_band(curves, "train_loss") == ([1, 2], [4.0, 2.0], [3.0, 2.0], [5.0, 2.0])
    assert fidelity.mean_band(curves, "eval_loss") is None


def run(*args, env=None):
    base = {k: v for k, v in child_env(JAX_PLATFORMS="cpu").items() if k not in ALLOCATOR}
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "fidelity.py"), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=base | (env or {}),  # without ALLOCATOR: train.py's defaults
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def snapshot(work: pathlib.Path) -> dict:
    """Every metrics file's bytes and every checkpoint folder's listing under ``work``."""
    return {str(p.relative_to(work)): p.read_bytes() if p.is_file() else sorted(os.listdir(p))
            for p in [*work.rglob("metrics.jsonl"), *work.rglob("checkpoints")]}  # fmt: skip


@pytest.mark.slow
def test_fidelity_end_to_end_two_seeds_resumes_and_reports(tmp_path, monkeypatch):
    work = tmp_path / "runs"
    args = ["--config", str(ROOT / "configs" / "llama_tiny.py"), "--steps", "4",
            "--chunk_steps", "2", "--seeds", "0,1", "--runs", "fp32+adamw;coat+fp8_adamw",
            "--set", "optimizer.warmup_steps=1", "--set", "log_interval=1", "--set", "seq_len=32",
            "--set", "batch_size=4", "--set", "eval_batches=1", "--workdir", str(work),
            "--cache_dir", str(tmp_path / "cache"),
            "--json", str(tmp_path / "fid.json")]  # fmt: skip
    # COAT seed 0: done by an earlier invocation in the one-seed layout (no seed<k> folder, the
    # config's seed); fp32 seed 1: failed at step 1 (train.py stops on a NaN loss). Neither is
    # run again: two pairs train, two chunks each.
    (work / "coat_fp8_adamw").mkdir(parents=True)
    coat0 = [{"step": s, "train_loss": 5.9 - 0.1 * s} for s in range(1, 5)]
    coat0[-1].update(eval_loss=5.7, tokens_per_s=1e3)
    (work / "coat_fp8_adamw" / "metrics.jsonl").write_text("\n".join(map(json.dumps, coat0)))
    (work / "fp32_adamw" / "seed1").mkdir(parents=True)
    (work / "fp32_adamw" / "seed1" / "metrics.jsonl").write_text('{"step": 1, "train_loss": 6}')
    error = "FloatingPointError: loss is nan at step 2; stopping"
    (work / "fp32_adamw" / "seed1" / "failed.json").write_text(
        json.dumps({"exit": 1, "error": error, "command": "train.py ..."})
    )
    out = run(*args, "--device", "test device", env=FAST)
    chunks = lambda out: [
        line for line in out.splitlines() if line.startswith("== ") and " -> " in line
    ]
    # Round-robin: both pairs to step 2, then both to 4.
    assert chunks(out) == [f"== {pair}: steps {a} -> {b}" for a, b in ((0, 2), (2, 4))
                      for pair in ("fp32+adamw, seed 0", "coat+fp8_adamw, seed 1")]  # fmt: skip
    assert "estimated time left" in out and "fp32+adamw 40000, coat+fp8_adamw 200000" in out
    report = json.loads((tmp_path / "fid.json").read_text())
    assert report["status"] == "complete; failed: fp32+adamw, seed 1"
    assert report["seeds"] == report["config"]["seeds"] == [0, 1]
    assert report["baseline"] == "fp32+adamw" and report["target_abs_gap"] == 0.0025
    assert report["device"] == "test device" and report["error_report"] is None
    fp32, coat = report["runs"]["fp32+adamw"], report["runs"]["coat+fp8_adamw"]
    assert fp32["complete_seeds"] == [0] and fp32["failed"]["seed"] == 1
    assert fp32["train_loss"]["n"] == 1 and fp32["train_loss"]["std"] is None
    assert coat["complete_seeds"] == [0, 1] and coat["steps"] == 4 and not coat["failed"]
    seeds = report["per_seed"]["coat+fp8_adamw"]
    assert seeds["0"]["workdir"] == str(work / "coat_fp8_adamw")  # the earlier layout, read
    assert seeds["1"]["workdir"] == str(work / "coat_fp8_adamw" / "seed1")
    assert seeds["0"]["final_eval_loss"] == 5.7
    losses = [seeds[s]["final_eval_loss"] for s in ("0", "1")]
    assert coat["eval_loss"]["mean"] == pytest.approx(np.mean(losses)) == coat["final_eval_loss"]
    assert coat["eval_loss"]["std"] == pytest.approx(np.std(losses, ddof=1))
    fp32_0 = report["per_seed"]["fp32+adamw"]["0"]
    assert all(math.isfinite(fp32_0[k]) for k in ("final_train_loss", "final_eval_loss"))
    gap = report["gaps_vs_baseline"]["coat+fp8_adamw"]
    base = fp32_0["final_eval_loss"]
    assert gap["gap_eval_loss"] == pytest.approx(np.mean(losses) / base - 1)
    assert gap["within_target_eval_loss"] == (abs(np.mean(losses) / base - 1) <= 0.0025)
    assert gap["paired_gap_eval_loss"]["per_seed"] == pytest.approx({"0": 5.7 / base - 1})
    assert "gaps_vs_bf16" not in report and len(report["curves"]["coat+fp8_adamw"]["1"]) == 4
    table = (tmp_path / "fid.md").read_text()
    assert "| coat+fp8_adamw | 0,1 |" in table and "| fp32+adamw | 0; 1 failed at 1 |" in table
    assert f"failed: {error}" in table and table in out + "\n"
    assert (work / "loss_curves.png").stat().st_size > 10_000

    # The same command again trains nothing (every pair at its last step or failed); with
    # --error_report the GEMM error tool then reads the baseline's first seed.
    before = snapshot(work)
    out = run(*args, "--device", "test device", "--error_report", env=FAST)
    assert chunks(out) == [] and "Resum" not in out and snapshot(work) == before
    report = json.loads((tmp_path / "fid.json").read_text())
    er = report["error_report"]
    assert er["from"] == str(work / "fp32_adamw" / "seed0") and er["exit"] == 0, er
    assert er["json"] == str(tmp_path / "fid_gemm_error.json") and os.path.exists(er["json"])
    assert os.path.exists(er["plot"]) and f"gemm error report: {er['json']}" in out
    assert report["runs"]["coat+fp8_adamw"] == coat  # the training results as before

    # A tool that fails loses none of them: they are written first, its failure beside them.
    monkeypatch.setattr(fidelity, "GEMM_ERROR", [sys.executable, "-c", "raise SystemExit(3)"])
    fidelity.main([*args, "--report_only", "--error_report", "--device", "test device"])
    report = json.loads((tmp_path / "fid.json").read_text())
    assert report["error_report"]["exit"] == 3 and report["report_only"]
    assert report["runs"]["coat+fp8_adamw"] == coat and snapshot(work) == before
    assert "gemm error report: FAILED, exit 3" in (tmp_path / "fid.md").read_text()
