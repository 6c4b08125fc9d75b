"""Training fidelity: the same model, data and seeds in fp32, bf16 and COAT's FP8 variants; loss
curves, final losses over seeds and their gaps to the fp32 reference (target 0.25%).

COAT reports final train losses within 0.7% of BF16 (OLMo-1B, 300B tokens: 2.551 vs 2.568;
OLMo-7B: 2.366 vs 2.379). This runs ``train.py`` as subprocesses, one per run (``RUNS``) and
seed, each in its own ``--workdir/<run>/seed<k>``, on ``configs/llama_114m.py`` (113.7M
parameters, the standard library's source tree with the byte tokenizer, batch 16 x 512, 2000
steps; ``--config`` / ``--set`` change it). The baseline is ``fp32+adamw`` (``--baseline``):
everything in fp32, dots at ``HIGHEST`` precision (no TF32), the reference every other run is
measured against; ``fp32 (3xBF16 dots)+adamw`` is nearly that (~16 bits of mantissa per
product) at 1.9x its speed on a GPU (three BF16 passes per dot,
``model.matmul_precision=BF16_BF16_F32_X3``). The default runs: fp32+adamw,
bf16+adamw, coat+fp8_adamw and the recipe closest to fp32 (README, "Fidelity"): COAT with BF16
forward GEMMs and FP8 backward GEMMs with row scales and E4M3 gradients.

Reproducing the results (one H200; the estimate is printed before it starts):

  PYTHONPATH=. python3 bench/fidelity.py --seeds 0,1,2 --time_budget_s 540 --error_report \\
      --json bench/results/fidelity_llama_114m_h200_$(date +%F).json
  # what docs/results.md reports (2026-12-01; three calls of the same command):
  PYTHONPATH=. python3 bench/fidelity.py --baseline "fp32 (3xBF16 dots)+adamw" \\
      --runs "fp32 (3xBF16 dots)+adamw;coat+fp8_adamw, bf16 forward GEMMs, row e4m3" \\
      --seeds 0,1,2 --chunk_steps 2000 --time_budget_s 560 --json fidelity.json
  # the same command again continues where a budget or a GPU call ended (runs resume)
  # --runs "fp32+adamw;coat+fp8_adamw;coat+fp8_adamw, block e4m3": other runs of RUNS
  # --baseline bf16+adamw: gaps to bf16 instead (the report always holds gaps_vs_bf16 too)
  # --tokens_per_s fp32+adamw=40000,200000: assumed throughput, per run (NAME=RATE) or all

GPU time, the arithmetic: 6 x 113.7M params + attention 12 x 16 layers x 512 x 768 = 0.756
GFLOP/token; a run of one seed is 2000 x 16 x 512 = 16.4M tokens = 1.24e16 FLOP. The BF16 and
FP8 runs use the tensor cores: 63 s at MFU 0.2 of 989 TFLOP/s (262k tokens/s; measured on an
H200: bf16 464k, COAT 367k tokens/s), 82 s at the assumed 200k tokens/s. fp32 at ``HIGHEST``
precision does not: its GEMMs run on the CUDA cores, 67 TFLOP/s of fp32 on an H200, 15x below
dense BF16: measured 50k tokens/s, 325 s a run (``bench/recipe_step.py``, 2026-12-01; three
BF16 passes per dot: 95k, 171 s). The default four runs, one seed: 5.4 + 3 x 1.4 = 10 min,
plus ~30-60 s per ``train.py`` invocation (start, corpus, compile, checkpoint; 2 chunks x 4
runs), so 14-18 minutes; three seeds 42-54 minutes, i.e.
several calls of the same command under a per-call time limit. The script prints its estimate
from ``--tokens_per_s`` (an assumption: 200k, fp32+adamw 40k; ``NAME=RATE`` items set one run's)
before it starts, and again from the tokens/s measured by each finished chunk.

How a run is split: ``train.py --config.steps=<chunk end> --config.optimizer.decay_steps=<steps>
--config.resume=True --config.seed=<k>``: every chunk follows the one cosine schedule of the
whole run, ends with a checkpoint and an eval, and the next chunk resumes bit-identically
(train.py's init and batches are a function of seed and step, so runs of one seed see the same
data in the same order). Chunks go round-robin over the (run, seed) pairs, seed by seed with the
baseline first, so a stop leaves them at comparable steps and completes the pairs of the first
seeds first; before each chunk the estimated time is checked against ``--time_budget_s``.
Compiles go to a persistent cache (``JAX_COMPILATION_CACHE_DIR``), so later chunks skip them.
A workdir of the earlier layout, ``<workdir>/<run>`` without ``seed<k>``, is read (and resumed)
as the seed its ``config.json`` names (else the config's seed).

Reported per run and seed: final train loss = mean of the logged train losses over the last
10% of steps (each log is one step's loss, so one alone is noisy), final eval loss = the last
eval. Per run, over the seeds that reached the full step count: mean, std (ddof=1, from two
seeds on) and min..max; the relative gap of the run's mean to the baseline's mean ((x - base) /
base) and whether |gap| <= 0.25%; and the paired gap, per seed (same seed, same data: the seed's
own noise cancels), its mean, std and min..max. One PNG with the train and eval curves of all
runs (the mean over seeds, a band from min to max); a Markdown table (per run, then per seed)
and JSON: ``runs`` (per run over its seeds; ``final_*_loss`` the means), ``per_seed``,
``gaps_vs_baseline`` (``gap_*``, ``within_target_*``, ``paired_gap_*``), ``gaps_vs_bf16`` (the
same against bf16+adamw, when it ran), ``curves`` (run -> seed -> metrics). With
``--error_report``, ``python -m coat_jax.tools.gemm_error`` then measures the per-GEMM FP8 error
on the baseline's first seed (``<json stem>_gemm_error.json`` / ``.png``); its exit status is
reported, and its failure loses none of the training results (written before it starts).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import subprocess
import sys
import time

CHILD_ENV = dict(os.environ)  # train.py gets the caller's environment, GPUs included
if __name__ == "__main__":  # not on import (tests): the importer's children keep their devices
    os.environ["JAX_PLATFORMS"] = "cpu"  # this driver only reads configs: never holds the GPU

import jax  # noqa: E402
import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# fp32 gradients as in the runs before grad_dtype=auto (bf16 where the fused update runs)
COAT = {"precision": "coat", "optimizer.name": "fp8_adamw", "grad_dtype": "float32"}
BLOCK_E4M3 = {"fp8.scaling": "block", "fp8.grad_format": "e4m3"}
RUNS = {  # name -> train.py overrides
    "fp32+adamw": {"precision": "fp32", "optimizer.name": "adamw"},
    "bf16+adamw": {"precision": "bf16", "optimizer.name": "adamw"},
    "coat+fp8_adamw": COAT,
    "coat+fp8_adamw, no expansion": {**COAT, "optimizer.expansion": False},
    "coat+fp8_adamw, bf16 gradients": {**COAT, "grad_dtype": "bfloat16"},
    # issue 18: BF16 master weights with an 8-bit residual (lossy) against fp32 master
    "coat+fp8_adamw, bf16 gradients, bf16+8 master": {
        **COAT, "grad_dtype": "bfloat16", "optimizer.master_weights": "bf16+8",
    },
    "coat+fp8_adamw, bf16 forward GEMMs": {**COAT, "fp8.forward_gemm": "bf16"},
    "coat+fp8_adamw, block e4m3": {**COAT, **BLOCK_E4M3},
    "coat+fp8_adamw, bf16 forward GEMMs, block e4m3": {
        **COAT, "fp8.forward_gemm": "bf16", **BLOCK_E4M3,
    },
    "coat+fp8_adamw, bf16 forward GEMMs, row e4m3": {
        **COAT, "fp8.forward_gemm": "bf16", "fp8.scaling": "row", "fp8.grad_format": "e4m3",
    },
    # the fp32 reference at a third of BF16's GEMM speed on a GPU: three BF16 passes per dot
    "fp32 (3xBF16 dots)+adamw": {
        "precision": "fp32", "optimizer.name": "adamw",
        "model.matmul_precision": "BF16_BF16_F32_X3",
    },
}  # fmt: skip
DEFAULT_RUNS = ("fp32+adamw", "bf16+adamw", "coat+fp8_adamw",
                "coat+fp8_adamw, bf16 forward GEMMs, row e4m3")  # fmt: skip
BASELINE = "fp32+adamw"
BF16 = "bf16+adamw"  # the report's gaps_vs_bf16 (the earlier baseline), when it ran
TARGET_GAP = 0.0025
DEFAULT_TOKENS_PER_S = "fp32+adamw=40000,200000"  # fp32 on CUDA cores: see the arithmetic
LOSSES = ("train_loss", "eval_loss")
GEMM_ERROR = [sys.executable, "-m", "coat_jax.tools.gemm_error"]  # --error_report's tool


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "llama_114m.py"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="train.py config override for every run (repeatable)")  # fmt: skip
    parser.add_argument("--steps", type=int, help="steps per run (default: the config's)")
    parser.add_argument("--runs", default=";".join(DEFAULT_RUNS),
                        help=f"';'-separated names from {list(RUNS)}")  # fmt: skip
    parser.add_argument("--baseline", default=BASELINE,
                        help="the run the gaps are measured to (one of --runs)")  # fmt: skip
    parser.add_argument("--seeds", help="','-separated seeds, each run once per seed "
                        "(default: the config's seed)")  # fmt: skip
    parser.add_argument("--chunk_steps", type=int, default=1000, help="steps per invocation")
    parser.add_argument("--workdir", default=os.path.join("runs", "fidelity"))
    parser.add_argument("--time_budget_s", type=float, help="start no chunk that would pass it")
    parser.add_argument("--tokens_per_s", default=DEFAULT_TOKENS_PER_S,
                        help="assumed throughput for the first estimate: RATE for every run, "
                        "NAME=RATE for one, ','-separated")  # fmt: skip
    parser.add_argument("--overhead_s", type=float, default=45,
                        help="assumed start + compile + save time of one invocation")  # fmt: skip
    parser.add_argument("--cache_dir", default=os.path.join("runs", "xla_cache"))
    parser.add_argument("--json", help="results (and a .md table beside it)")
    parser.add_argument("--png", help="loss curves (default: <workdir>/loss_curves.png)")
    parser.add_argument("--report_only", action="store_true",
                        help="train nothing: report the runs in --workdir as they are")  # fmt: skip
    parser.add_argument(
        "--error_report",
        action="store_true",
        help="then run coat_jax.tools.gemm_error on the baseline's first seed",
    )
    parser.add_argument("--device", help="device name for the report (default: nvidia-smi's)")
    return parser.parse_args(argv)


def parse_runs(text: str, baseline: str) -> list[str]:
    """The ``--runs`` names, the baseline first; ValueError names what is wrong."""
    names = list(dict.fromkeys(n.strip() for n in text.split(";") if n.strip()))
    if unknown := [n for n in names if n not in RUNS]:
        raise ValueError(f"--runs: unknown {unknown}; names from {list(RUNS)}")
    if baseline not in names:
        raise ValueError(f"--baseline {baseline!r} is not among --runs {names}")
    return [baseline] + [n for n in names if n != baseline]


def parse_seeds(text: str) -> list[int]:
    """``"0,1,2"`` -> ``[0, 1, 2]``: distinct integers >= 0; ValueError otherwise."""
    items = [s.strip() for s in text.split(",")]
    if not all(s.isdigit() for s in items):  # also refuses "", "-1", "1.5"
        raise ValueError(f"--seeds {text!r}: expected ','-separated integers >= 0, e.g. 0,1,2")
    seeds = [int(s) for s in items]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds {text!r}: a seed appears twice")
    return seeds


def parse_rates(text: str, names: list[str]) -> dict[str, float]:
    """``--tokens_per_s``: ``"fp32+adamw=40000,200000"`` -> the rate of each of ``names``. A bare
    RATE is every unnamed run's; without one, unnamed runs keep DEFAULT_TOKENS_PER_S's. Run names
    may hold ", ": a piece that is neither a number nor ``NAME=RATE`` joins the next."""
    items = []
    for piece in text.replace(";", ",").split(","):
        if items and "=" not in items[-1] and not _is_number(items[-1]):
            items[-1] += "," + piece
        else:
            items.append(piece)
    own = {}
    for item in (i.strip() for i in items):
        name, sep, value = item.rpartition("=")
        if not _is_number(value) or float(value) <= 0:
            raise ValueError(f"--tokens_per_s {text!r}: {item!r} is not RATE or NAME=RATE "
                             "with RATE > 0")  # fmt: skip
        if sep and name.strip() not in RUNS:
            raise ValueError(f"--tokens_per_s: unknown run {name.strip()!r}; names from "
                             f"{list(RUNS)}")  # fmt: skip
        own[name.strip() if sep else None] = float(value)
    if None not in own:
        own = {**dict(_builtin_rates()), **own}
    return {n: own.get(n, own[None]) for n in names}


def _builtin_rates() -> dict:
    rates = {}
    for item in DEFAULT_TOKENS_PER_S.split(","):
        name, _, value = item.rpartition("=")
        rates[name or None] = float(value)
    return rates


def _is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def run_dir(workdir: str, name: str) -> str:
    return os.path.join(workdir, name.replace("+", "_").replace(", ", "_").replace(" ", "_"))


def seed_workdir(workdir: str, name: str, seed: int, default_seed: int) -> str:
    """``<workdir>/<run>/seed<k>``; or ``<workdir>/<run>`` itself where it holds a run of the
    earlier one-seed layout of seed ``seed`` (its ``config.json``'s, else ``default_seed``) and
    ``seed<k>`` does not exist."""
    parent = run_dir(workdir, name)
    path = os.path.join(parent, f"seed{seed}")
    if os.path.exists(path) or not os.path.exists(os.path.join(parent, "metrics.jsonl")):
        return path
    legacy_seed = default_seed
    try:
        with open(os.path.join(parent, "config.json")) as f:
            legacy_seed = json.load(f).get("seed", default_seed)
    except (OSError, ValueError):
        pass
    return parent if legacy_seed == seed else path


def read_metrics(workdir: str) -> list[dict]:
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_failure(workdir: str) -> dict | None:
    """The failure a run recorded (``failed.json``: exit code and train.py's last error line),
    or None. A failed run is reported as such and not retried."""
    path = os.path.join(workdir, "failed.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def done_steps(records: list[dict]) -> int:
    return max((r["step"] for r in records), default=0)


def summarize_run(records: list[dict], failure: dict | None = None) -> dict:
    """One (run, seed) pair: its steps, final train / eval loss, tokens/s, peak memory."""
    done = done_steps(records)
    tail = [r["train_loss"] for r in records if r["step"] > 0.9 * done and "train_loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    return {
        "steps": done,
        "final_train_loss": float(np.mean(tail)) if tail else None,
        "final_eval_loss": evals[-1]["eval_loss"] if evals else None,
        "eval_step": evals[-1]["step"] if evals else None,
        "tokens_per_s": float(np.median(rates)) if rates else None,
        "peak_mem_gb": max((r["peak_mem_gb"] for r in records if "peak_mem_gb" in r), default=None),
        "failed": failure,
    }


def spread(values: list[float]) -> dict | None:
    """``{"n", "mean", "std", "min", "max"}`` of ``values`` (std with ddof=1, ``None`` below two
    values), or ``None`` if there are none."""
    if not values:
        return None
    return {
        "n": len(values),
        "mean": float(np.mean(values)),
        "std": float(np.std(values, ddof=1)) if len(values) >= 2 else None,
        "min": float(min(values)),
        "max": float(max(values)),
    }


def complete(s: dict, total: int) -> bool:
    return not s["failed"] and s["steps"] >= total


def summarize_seeds(per_seed: dict[int, dict], total: int) -> dict:
    """A run over its seeds (``per_seed``: :func:`summarize_run` of each): the spread of each
    final loss over the seeds that reached ``total`` steps (``final_*``: its mean, ``None`` with
    no such seed), the fewest steps, the median tokens/s, the first failure (with its seed)."""
    done = sorted(seed for seed, s in per_seed.items() if complete(s, total))
    out = {"seeds": sorted(per_seed), "complete_seeds": done}
    for key in LOSSES:
        values = [per_seed[seed][f"final_{key}"] for seed in done]
        out[key] = spread([v for v in values if v is not None])
        out[f"final_{key}"] = out[key]["mean"] if out[key] else None
    rates = [s["tokens_per_s"] for s in per_seed.values() if s["tokens_per_s"]]
    failures = [dict(s["failed"], seed=seed) for seed, s in sorted(per_seed.items()) if s["failed"]]
    evals = [s["eval_step"] for s in per_seed.values() if s["eval_step"] is not None]
    out.update(
        steps=min((s["steps"] for s in per_seed.values()), default=0),
        eval_step=min(evals, default=None),
        tokens_per_s=float(np.median(rates)) if rates else None,
        peak_mem_gb=max(
            (s["peak_mem_gb"] for s in per_seed.values() if s["peak_mem_gb"]), default=None
        ),
        failed=failures[0] if failures else None,
    )
    return out


def gaps(runs: dict, per_seed: dict, baseline: str) -> dict:
    """Each run's gaps to ``baseline`` (``runs``: :func:`summarize_seeds` of each, ``per_seed``:
    run -> seed -> :func:`summarize_run`), per loss: ``gap_*`` of the means, relative,
    ``within_target_*`` (|gap| <= TARGET_GAP), and ``paired_gap_*``: the spread of the per-seed
    gaps over the seeds both completed, with ``seeds`` and ``per_seed``. Runs with none left out."""
    base = runs.get(baseline)
    out = {}
    for name, s in runs.items():
        if name == baseline or not base:
            continue
        row = {}
        for key in LOSSES:
            if s[key] and base[key] and base[key]["mean"]:
                gap = (s[key]["mean"] - base[key]["mean"]) / base[key]["mean"]
                row[f"gap_{key}"] = gap
                row[f"within_target_{key}"] = abs(gap) <= TARGET_GAP
            paired = {}
            for seed in s["complete_seeds"]:
                if seed not in base["complete_seeds"]:
                    continue
                x = per_seed[name][seed][f"final_{key}"]
                b = per_seed[baseline][seed][f"final_{key}"]
                if x is not None and b:
                    paired[seed] = (x - b) / b
            if paired:
                row[f"paired_gap_{key}"] = dict(
                    spread(list(paired.values())),
                    seeds=sorted(paired),
                    per_seed={str(k): v for k, v in paired.items()},
                )
        if row:
            out[name] = row
    return out


def chunk_pairs(runs: list[str], seeds: list[int]) -> list[tuple[str, int]]:
    """The (run, seed) pairs in the order chunks visit them: seed by seed, runs as given."""
    return [(name, seed) for seed in seeds for name in runs]


def run_chunks(ends, pairs, done, need, run_chunk, budget_s=None, started=None,
               clock=time.perf_counter) -> str | None:  # fmt: skip
    """For each chunk end in turn, each pair not yet there: ``run_chunk(pair, from_step, end)``
    unless ``done(pair)`` (its steps; ``None`` for a failed pair) is there already, or the
    estimate ``need(pair, from_step, end)`` seconds would pass ``budget_s`` counted from
    ``started``: then nothing more runs and the reason is returned (``None``: all ran)."""
    started = clock() if started is None else started
    for end in ends:
        for pair in pairs:
            steps = done(pair)
            if steps is None or steps >= end:
                continue
            seconds = need(pair, steps, end)
            if budget_s and clock() - started + seconds > budget_s:
                return f"time budget: {label(pair)} to step {end} needs ~{seconds:.0f} s"
            run_chunk(pair, steps, end)
    return None


def label(pair: tuple[str, int]) -> str:
    return f"{pair[0]}, seed {pair[1]}"


def mean_band(curves: dict, key: str) -> tuple | None:
    """``(steps, mean, min, max)`` of the finite ``key`` values over the seeds' metrics at each
    logged step (``curves``: seed -> records), or ``None`` if there are none."""
    by_step: dict[int, list[float]] = {}
    for records in curves.values():
        for r in records:
            if isinstance(r.get(key), (int, float)) and math.isfinite(r[key]):
                by_step.setdefault(r["step"], []).append(r[key])
    if not by_step:
        return None
    steps = sorted(by_step)
    values = [by_step[s] for s in steps]
    return (
        steps,
        [float(np.mean(v)) for v in values],
        list(map(min, values)),
        list(map(max, values)),
    )


def plot(curves: dict, path: str) -> None:
    """Train and eval loss of each run (``curves``: run -> seed -> records): the mean over
    seeds, shaded from their min to max."""
    import matplotlib

    from coat_jax.training import metrics

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (name, seeds) in enumerate(curves.items()):
        seeded = sum(1 for records in seeds.values() if records)
        tag = f"{name} (mean of {seeded} seeds)" if seeded > 1 else name
        for ax, key, style in ((axes[0], "train_loss", "-"), (axes[1], "eval_loss", "o-")):
            if band := mean_band(seeds, key):
                steps, mean, low, high = band
                ax.plot(steps, mean, style, color=f"C{i}", label=tag, alpha=0.85)
                if seeded > 1:
                    ax.fill_between(steps, low, high, color=f"C{i}", alpha=0.2, linewidth=0)
    for ax, title in zip(axes, ("train loss", "eval loss"), strict=True):
        ax.set_title(title)
    metrics.save_loss_figure(fig, axes, path, "loss (nats/byte)")


def device_name() -> str:
    if shutil.which("nvidia-smi"):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    return "cpu"


def _fmt(value, spec: str) -> str:
    return "-" if value is None else spec.format(value)


def _spread_cell(s: dict | None, spec: str, std_spec: str) -> str:
    if not s:
        return "-"
    if s["n"] < 2:
        return spec.format(s["mean"])
    return (f"{spec.format(s['mean'])} ± {std_spec.format(s['std'])} "
            f"[{spec.format(s['min'])}..{spec.format(s['max'])}]")  # fmt: skip


def _seeds_cell(run: dict, per_seed: dict, total: int) -> str:
    cell = ",".join(map(str, run["complete_seeds"])) or "none"
    for seed, s in sorted(per_seed.items()):
        if s["failed"]:
            cell += f"; {seed} failed at {s['steps']}"
        elif s["steps"] < total:
            cell += f"; {seed} at {s['steps']}"
    return cell


def markdown(runs: dict, per_seed: dict, run_gaps: dict, baseline: str, total: int) -> str:
    """Two tables: each run over its seeds (mean ± std [min..max], gaps to ``baseline``), then
    each seed (its losses, paired gaps); failures with their error."""
    lines = [
        f"Baseline {baseline}; gap = (run mean - baseline mean) / baseline mean over the seeds "
        f"that reached step {total}, target |gap| <= {TARGET_GAP:.2%} (in / out); paired = the "
        "same seed's gap, mean ± std [min..max] over seeds.",
        "",
        "| run | seeds | final train loss | gap | paired gap | final eval loss | gap | "
        "paired gap | tok/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in runs.items():
        g, cells = run_gaps.get(name, {}), []
        for key in LOSSES:
            gap = g.get(f"gap_{key}")
            mark = "" if gap is None else (" (in)" if g[f"within_target_{key}"] else " (out)")
            cells += [_spread_cell(s[key], "{:.4f}", "{:.4f}"), _fmt(gap, "{:+.2%}") + mark,
                      _spread_cell(g.get(f"paired_gap_{key}"), "{:+.2%}", "{:.2%}")]  # fmt: skip
        seeds = _seeds_cell(s, per_seed[name], total)
        lines.append(f"| {name} | {seeds} | {' | '.join(cells)} | "
                     f"{_fmt(s['tokens_per_s'], '{:.0f}')} |")  # fmt: skip
    lines += [
        "",
        "| run | seed | steps | final train loss | paired gap | final eval loss | paired gap | "
        "tok/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, seeds in per_seed.items():
        for seed, s in sorted(seeds.items()):
            if s["failed"]:
                lines.append(f"| {name} | {seed} | {s['steps']} (last log) | failed: "
                             f"{s['failed']['error']} | - | - | - | - |")  # fmt: skip
                continue
            cells = []
            for key in LOSSES:
                paired = run_gaps.get(name, {}).get(f"paired_gap_{key}", {})
                cells += [_fmt(s[f"final_{key}"], "{:.4f}"),
                          _fmt(paired.get("per_seed", {}).get(str(seed)), "{:+.2%}")]  # fmt: skip
            lines.append(f"| {name} | {seed} | {s['steps']} | {' | '.join(cells)} | "
                         f"{_fmt(s['tokens_per_s'], '{:.0f}')} |")  # fmt: skip
    return "\n".join(lines)


def error_report(workdir: str, stem: str, env: dict) -> dict:
    """``python -m coat_jax.tools.gemm_error --from workdir`` into ``<stem>_gemm_error.json`` /
    ``.png``: the command, paths, exit status and last error line; never raises for the tool."""
    out = {"from": workdir, "json": f"{stem}_gemm_error.json", "plot": f"{stem}_gemm_error.png"}
    out["command"] = GEMM_ERROR + ["--from", workdir, "--json", out["json"], "--plot", out["plot"]]
    if not os.path.isdir(os.path.join(workdir, "checkpoints")):
        return dict(out, exit=None, error=f"skipped: no checkpoint in {workdir}")
    print(f"== gemm error report: {' '.join(out['command'])}", flush=True)
    start = time.perf_counter()
    try:
        proc = subprocess.run(out["command"], env=env, stderr=subprocess.PIPE, text=True)
    except OSError as e:
        return dict(out, exit=None, error=f"{type(e).__name__}: {e}")
    sys.stderr.write(proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    error = (lines[-1] if lines else "") if proc.returncode else None
    return dict(out, exit=proc.returncode, error=error, seconds=time.perf_counter() - start)


def error_line(report: dict) -> str:
    if report["exit"] == 0:
        return f"gemm error report: {report['json']}, {report['plot']} (exit 0)"
    status = "not run" if report["exit"] is None else f"FAILED, exit {report['exit']}"
    return f"gemm error report: {status}: {report['error']}"


def main(argv=None):
    args = parse_args(argv)
    try:  # every flag is checked before anything runs
        names = parse_runs(args.runs, args.baseline)
        seeds = parse_seeds(args.seeds) if args.seeds is not None else None
        rates = parse_rates(args.tokens_per_s, names)
    except ValueError as e:
        raise SystemExit(f"fidelity.py: {e}") from None
    runs = {n: RUNS[n] for n in names}
    from coat_jax.training import configs, metrics

    try:
        overrides = configs.parse_overrides(args.set)
        config = configs.load_file(args.config, overrides)
        total = args.steps or config.steps
        for name, run in runs.items():  # fail here, not in the third subprocess
            try:
                configs.validate(
                    configs.load_file(args.config, {**overrides, **run, "steps": total})
                )
            except (ValueError, KeyError, AttributeError) as e:
                raise ValueError(f"run {name!r}: {e}") from None
    except (ValueError, KeyError, AttributeError) as e:
        raise SystemExit(f"fidelity.py: {e}") from None
    seeds = seeds if seeds is not None else [config.seed]
    model = configs.llama_config(config)
    tokens_per_step = config.batch_size * config.seq_len
    flops_per_token = metrics.flops_per_token(model, config.seq_len)
    chunk = min(args.chunk_steps, total)
    ends = list(range(chunk, total, chunk)) + [total]
    pairs = chunk_pairs(names, seeds)
    workdirs = {(n, k): seed_workdir(args.workdir, n, k, config.seed) for n, k in pairs}
    rate = dict(rates)  # per run: measured once a chunk of it has run
    overhead = args.overhead_s

    def done(pair) -> int | None:
        wd = workdirs[pair]
        return None if read_failure(wd) else done_steps(read_metrics(wd))

    def need(pair, steps: int, end: int) -> float:
        return (end - steps) * tokens_per_step / rate[pair[0]] + overhead

    def estimate() -> float:
        left = 0.0
        for pair in pairs:
            if (steps := done(pair)) is not None:
                todo = [e for e in ends if e > steps]
                left += (total - steps) * tokens_per_step / rate[pair[0]] + overhead * len(todo)
        return left

    assumed = ", ".join(f"{n} {r:.0f}" for n, r in rates.items())
    print(
        f"{model.num_params() / 1e6:.1f}M params, batch {config.batch_size} x {config.seq_len}, "
        f"{total} steps x {len(runs)} runs x {len(seeds)} seeds {seeds} "
        f"({total * tokens_per_step / 1e6:.1f}M tokens each, {flops_per_token / 1e9:.3f} "
        f"GFLOP/token), chunks ending at {ends}\n"
        f"estimated time left: {estimate() / 60:.1f} min (assuming tokens/s: {assumed}; "
        f"{overhead:.0f} s per invocation)",
        flush=True,
    )
    started = time.perf_counter()
    env = dict(CHILD_ENV, JAX_COMPILATION_CACHE_DIR=os.path.abspath(args.cache_dir))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)

    def run_chunk(pair, steps: int, end: int) -> None:
        nonlocal overhead
        (name, seed), wd = pair, workdirs[pair]
        sets = {**overrides, **runs[name], "seed": seed, "workdir": wd, "steps": end,
                "resume": True, "optimizer.decay_steps": total, "checkpoint_interval": chunk,
                "progress": False}  # fmt: skip
        cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config", args.config]
        cmd += [f"--config.{k}={v}" for k, v in sets.items()]
        print(f"== {label(pair)}: steps {steps} -> {end}", flush=True)
        start = time.perf_counter()
        out = subprocess.run(cmd, env=env, stderr=subprocess.PIPE, text=True)
        sys.stderr.write(out.stderr)
        seconds = time.perf_counter() - start
        if out.returncode:  # e.g. a loss that went NaN: recorded, reported, not retried
            lines = [line for line in out.stderr.splitlines() if line.strip()]
            failure = {"exit": out.returncode, "error": lines[-1] if lines else "",
                       "command": " ".join(cmd)}  # fmt: skip
            os.makedirs(wd, exist_ok=True)
            with open(os.path.join(wd, "failed.json"), "w") as f:
                json.dump(failure, f, indent=2)
            print(f"== {label(pair)} FAILED (exit {out.returncode}): {failure['error']}",
                  flush=True)  # fmt: skip
            return
        summary = summarize_run(read_metrics(wd))
        if summary["tokens_per_s"]:
            rate[name] = summary["tokens_per_s"]
            overhead = max(0.0, seconds - (end - steps) * tokens_per_step / rate[name])
        print(f"== {label(pair)}: {seconds:.0f} s, {rate[name]:.0f} tokens/s, "
              f"estimated time left {estimate() / 60:.1f} min", flush=True)  # fmt: skip

    stopped = None
    if not args.report_only:
        stopped = run_chunks(ends, pairs, done, need, run_chunk, args.time_budget_s, started)

    curves = {n: {k: read_metrics(workdirs[n, k]) for k in seeds} for n in names}
    per_seed = {n: {k: dict(summarize_run(curves[n][k], read_failure(workdirs[n, k])),
                            workdir=workdirs[n, k]) for k in seeds} for n in names}  # fmt: skip
    summaries = {n: summarize_seeds(per_seed[n], total) for n in names}
    run_gaps = gaps(summaries, per_seed, args.baseline)
    png = args.png or os.path.join(args.workdir, "loss_curves.png")
    os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
    plot(curves, png)
    table = markdown(summaries, per_seed, run_gaps, args.baseline, total)
    status = f"stopped ({stopped}); run the same command to resume" if stopped else "complete"
    if failed := [label(p) for p in pairs if per_seed[p[0]][p[1]]["failed"]]:
        status += f"; failed: {'; '.join(failed)}"
    print(f"\n{status}; {time.perf_counter() - started:.0f} s\n{table}\nplot: {png}", flush=True)
    report = {
        "date": datetime.date.today().isoformat(),
        "device": args.device or device_name(),
        "jax": jax.__version__,
        "config": {
            "file": os.path.relpath(args.config, ROOT),
            "overrides": overrides,
            "steps": total,
            "chunk_steps": chunk,
            "batch_size": config.batch_size,
            "seq_len": config.seq_len,
            "seed": config.seed,
            "seeds": seeds,
            "params": model.num_params(),
            "data": f"{config.data.source}, {config.data.tokenizer} tokenizer",
            "runs": runs,
            "assumed_tokens_per_s": rates,
        },
        "status": status,
        "report_only": args.report_only,  # then wall_s is the report's, not the runs
        "wall_s": time.perf_counter() - started,
        "baseline": args.baseline,
        "seeds": seeds,
        "runs": summaries,  # final_*_loss: the mean over the seeds that reached the last step
        "per_seed": {n: {str(k): s for k, s in v.items()} for n, v in per_seed.items()},
        "gaps_vs_baseline": run_gaps,
        "target_abs_gap": TARGET_GAP,
        "paper": "COAT (arXiv 2410.19313), OLMo train loss BF16 / COAT: 1B 2.551 / 2.568, "
        "7B 2.366 / 2.379",
        "plot": png,
        "error_report": None,
        "curves": {n: {str(k): v for k, v in c.items()} for n, c in curves.items()},
    }
    if BF16 in summaries:  # the earlier baseline's key, for readers of earlier reports
        report["gaps_vs_bf16"] = gaps(summaries, per_seed, BF16)
    stem = os.path.splitext(args.json)[0] if args.json else os.path.join(args.workdir, "fidelity")

    def write() -> None:
        if not args.json:
            return
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        with open(stem + ".md", "w") as f:
            f.write(table + "\n" + (f"\n{error_line(report['error_report'])}\n"
                                    if report["error_report"] else ""))  # fmt: skip
        print(f"wrote {args.json}", flush=True)

    write()  # the training results first: the error report cannot lose them
    if args.error_report:
        report["error_report"] = error_report(workdirs[args.baseline, seeds[0]], stem, env)
        print(error_line(report["error_report"]), flush=True)
        write()


if __name__ == "__main__":
    main()
