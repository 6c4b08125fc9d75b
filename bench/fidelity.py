"""Training fidelity: the same model, data and seed in bf16+adamw, coat+fp8_adamw and
coat+fp8_adamw without range expansion; loss curves and final-loss gaps to bf16 (target 0.3%).

COAT reports final train losses within 0.7% of BF16 (OLMo-1B, 300B tokens: 2.551 vs 2.568;
OLMo-7B: 2.366 vs 2.379). This runs ``train.py`` three times as subprocesses, each in its own
``--workdir/<run>``, on ``configs/llama_114m.py`` (113.7M parameters, the standard library's
source tree with the byte tokenizer, seed 0, batch 16 x 512, 2000 steps; ``--config`` / ``--set``
change it).

Reproducing the results (one H200; about 5-9 GPU minutes, printed before it starts):

  PYTHONPATH=. python3 bench/fidelity.py --time_budget_s 540 \\
      --json bench/results/fidelity_llama_114m_h200_$(date +%F).json
  # the same command again continues where a budget or a GPU call ended (runs resume)
  # --runs "bf16+adamw;coat+fp8_adamw;coat+fp8_adamw, bf16 gradients": other runs of RUNS
  # (the bf16-gradient one: train.py's grad_dtype=bfloat16)

GPU time, the arithmetic: 6 x 113.7M params + attention 12 x 16 layers x 512 x 768 = 0.756
GFLOP/token; a run is 2000 x 16 x 512 = 16.4M tokens = 1.24e16 FLOP, 63 s at MFU 0.2 of 989
TFLOP/s (262k tokens/s), 125 s at MFU 0.1. Three runs: 3.2-6.3 min, plus ~30-60 s per
``train.py`` invocation (start, corpus, compile, checkpoint; 2 chunks x 3 runs), so 5-9 minutes
in all. The script prints its estimate from ``--tokens_per_s`` (an assumption, 200k) before it
starts, and again from the tokens/s measured by each finished chunk.

How a run is split: ``train.py --config.steps=<chunk end> --config.optimizer.decay_steps=<steps>
--config.resume=True``: every chunk follows the one cosine schedule of the whole run, ends with a
checkpoint and an eval, and the next chunk resumes bit-identically (train.py's batches are a
function of seed and step). Chunks go round-robin over the three runs, so a stop leaves them at
comparable steps; before each chunk the estimated time is checked against ``--time_budget_s``.
Compiles go to a persistent cache (``JAX_COMPILATION_CACHE_DIR``), so later chunks skip them.

Reported per run: final train loss = mean of the logged train losses over the last 10% of steps
(each log is one step's loss, so one alone is noisy), final eval loss = the last eval, their
relative gaps to bf16 ((x - bf16) / bf16) and whether |gap| <= 0.3%; one PNG with the train and
eval curves of all runs; JSON and a Markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time

CHILD_ENV = dict(os.environ)  # train.py gets the caller's environment, GPUs included
os.environ["JAX_PLATFORMS"] = "cpu"  # this driver only reads configs: never holds the GPU

import jax  # noqa: E402
import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = {  # name -> train.py overrides
    "bf16+adamw": {"precision": "bf16", "optimizer.name": "adamw"},
    "coat+fp8_adamw": {"precision": "coat", "optimizer.name": "fp8_adamw"},
    "coat+fp8_adamw, no expansion": {
        "precision": "coat", "optimizer.name": "fp8_adamw", "optimizer.expansion": False,
    },
    "coat+fp8_adamw, bf16 gradients": {
        "precision": "coat", "optimizer.name": "fp8_adamw", "grad_dtype": "bfloat16",
    },
}  # fmt: skip
DEFAULT_RUNS = ("bf16+adamw", "coat+fp8_adamw", "coat+fp8_adamw, no expansion")
BASELINE = "bf16+adamw"
TARGET_GAP = 0.003


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "llama_114m.py"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="train.py config override for every run (repeatable)")  # fmt: skip
    parser.add_argument("--steps", type=int, help="steps per run (default: the config's)")
    parser.add_argument("--runs", default=";".join(DEFAULT_RUNS),
                        help=f"';'-separated names from {list(RUNS)}")  # fmt: skip
    parser.add_argument("--chunk_steps", type=int, default=1000, help="steps per invocation")
    parser.add_argument("--workdir", default=os.path.join("runs", "fidelity"))
    parser.add_argument("--time_budget_s", type=float, help="start no chunk that would pass it")
    parser.add_argument("--tokens_per_s", type=float, default=200_000,
                        help="assumed throughput for the first estimate")  # fmt: skip
    parser.add_argument("--overhead_s", type=float, default=45,
                        help="assumed start + compile + save time of one invocation")  # fmt: skip
    parser.add_argument("--cache_dir", default=os.path.join("runs", "xla_cache"))
    parser.add_argument("--json", help="results (and a .md table beside it)")
    parser.add_argument("--png", help="loss curves (default: <workdir>/loss_curves.png)")
    parser.add_argument("--report_only", action="store_true",
                        help="train nothing: report the runs in --workdir as they are")  # fmt: skip
    parser.add_argument("--device", help="device name for the report (default: nvidia-smi's)")
    return parser.parse_args(argv)


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


def gaps(summaries: dict) -> dict:
    base = summaries.get(BASELINE)
    out = {}
    for name, s in summaries.items():
        if name == BASELINE or not base or s["steps"] != base["steps"] or s["failed"]:
            continue
        row = {}
        for key in ("final_train_loss", "final_eval_loss"):
            if s[key] is not None and base[key]:
                gap = (s[key] - base[key]) / base[key]
                row[key.replace("final_", "gap_")] = gap
                row[key.replace("final_", "within_target_")] = abs(gap) <= TARGET_GAP
        out[name] = row
    return out


def plot(curves: dict, path: str) -> None:
    import matplotlib

    from coat_jax.training import metrics

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for (name, records), color in zip(curves.items(), ("C0", "C1", "C2"), strict=False):
        for ax, key, style in ((axes[0], "train_loss", "-"), (axes[1], "eval_loss", "o-")):
            if points := metrics.loss_points(records, key):
                ax.plot(*points, style, color=color, label=name, alpha=0.85)
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


def markdown(summaries: dict, run_gaps: dict) -> str:
    fmt = lambda v, spec: "-" if v is None else spec.format(v)
    lines = [
        "| run | steps | final train loss | gap to bf16 | final eval loss | gap to bf16 | tok/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in summaries.items():
        g = run_gaps.get(name, {})
        if s["failed"]:
            lines.append(f"| {name} | {s['steps']} (last log) | failed: {s['failed']['error']} "
                         "| - | - | - | - |")  # fmt: skip
            continue
        lines.append(
            f"| {name} | {s['steps']} | {fmt(s['final_train_loss'], '{:.4f}')} | "
            f"{fmt(g.get('gap_train_loss'), '{:+.2%}')} | {fmt(s['final_eval_loss'], '{:.4f}')} | "
            f"{fmt(g.get('gap_eval_loss'), '{:+.2%}')} | {fmt(s['tokens_per_s'], '{:.0f}')} |"
        )
    return "\n".join(lines)


def main():
    args = parse_args()
    names = [n.strip() for n in args.runs.split(";") if n.strip()]
    unknown = [n for n in names if n not in RUNS]
    if unknown or BASELINE not in names:
        raise SystemExit(f"fidelity.py: --runs {args.runs!r}: names from {list(RUNS)}, "
                         f"{BASELINE!r} among them")  # fmt: skip
    runs = {n: RUNS[n] for n in names}
    from coat_jax.training import configs, metrics

    overrides = configs.parse_overrides(args.set)
    config = configs.load_file(args.config, overrides)
    total = args.steps or config.steps
    for run in runs.values():  # fail here, not in the third subprocess
        configs.validate(configs.load_file(args.config, {**overrides, **run, "steps": total}))
    model = configs.llama_config(config)
    tokens_per_step = config.batch_size * config.seq_len
    flops_per_token = metrics.flops_per_token(model, config.seq_len)
    chunk = min(args.chunk_steps, total)
    ends = list(range(chunk, total, chunk)) + [total]
    workdirs = {name: os.path.join(args.workdir, name.replace("+", "_").replace(", ", "_")
                                   .replace(" ", "_")) for name in runs}  # fmt: skip
    rate = dict.fromkeys(runs, args.tokens_per_s)  # measured once a chunk has run
    overhead = args.overhead_s

    def estimate() -> float:
        left = 0.0
        for name, wd in workdirs.items():
            if read_failure(wd):
                continue
            done = done_steps(read_metrics(wd))
            todo = [e for e in ends if e > done]
            left += (total - done) * tokens_per_step / rate[name] + overhead * len(todo)
        return left

    print(
        f"{model.num_params() / 1e6:.1f}M params, batch {config.batch_size} x {config.seq_len}, "
        f"{total} steps x {len(runs)} runs ({total * tokens_per_step / 1e6:.1f}M tokens each, "
        f"{flops_per_token / 1e9:.3f} GFLOP/token), chunks ending at {ends}\n"
        f"estimated time left: {estimate() / 60:.1f} min (assuming {args.tokens_per_s:.0f} "
        f"tokens/s and {overhead:.0f} s per invocation)",
        flush=True,
    )
    started, stopped = time.perf_counter(), None
    env = dict(CHILD_ENV, JAX_COMPILATION_CACHE_DIR=os.path.abspath(args.cache_dir))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    for end in ends if not args.report_only else []:
        for name, run in runs.items():
            wd = workdirs[name]
            done = done_steps(read_metrics(wd))
            if done >= end or stopped or read_failure(wd):
                continue
            need = (end - done) * tokens_per_step / rate[name] + overhead
            elapsed = time.perf_counter() - started
            if args.time_budget_s and elapsed + need > args.time_budget_s:
                stopped = f"time budget: {name} to step {end} needs ~{need:.0f} s"
                break
            sets = {**overrides, **run, "workdir": wd, "steps": end, "resume": True,
                    "optimizer.decay_steps": total, "checkpoint_interval": chunk,
                    "progress": False}  # fmt: skip
            cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config", args.config]
            cmd += [f"--config.{k}={v}" for k, v in sets.items()]
            print(f"== {name}: steps {done} -> {end}", flush=True)
            start = time.perf_counter()
            out = subprocess.run(cmd, env=env, stderr=subprocess.PIPE, text=True)
            sys.stderr.write(out.stderr)
            seconds = time.perf_counter() - start
            if out.returncode:  # e.g. a loss that went NaN: recorded, reported, not retried
                lines = [line for line in out.stderr.splitlines() if line.strip()]
                failure = {"exit": out.returncode, "error": lines[-1] if lines else "",
                           "command": " ".join(cmd)}  # fmt: skip
                with open(os.path.join(wd, "failed.json"), "w") as f:
                    json.dump(failure, f, indent=2)
                print(f"== {name} FAILED (exit {out.returncode}): {failure['error']}", flush=True)
                continue
            summary = summarize_run(read_metrics(wd))
            if summary["tokens_per_s"]:
                rate[name] = summary["tokens_per_s"]
                overhead = max(0.0, seconds - (end - done) * tokens_per_step / rate[name])
            print(f"== {name}: {seconds:.0f} s, {rate[name]:.0f} tokens/s, "
                  f"estimated time left {estimate() / 60:.1f} min", flush=True)  # fmt: skip

    curves = {name: read_metrics(wd) for name, wd in workdirs.items()}
    summaries = {name: summarize_run(records, read_failure(workdirs[name]))
                 for name, records in curves.items()}  # fmt: skip
    run_gaps = gaps(summaries)
    png = args.png or os.path.join(args.workdir, "loss_curves.png")
    os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
    plot(curves, png)
    table = markdown(summaries, run_gaps)
    status = f"stopped ({stopped}); run the same command to resume" if stopped else "complete"
    if failed := [name for name, s in summaries.items() if s["failed"]]:
        status += f"; failed: {', '.join(failed)}"
    print(f"\n{status}; {time.perf_counter() - started:.0f} s\n{table}\nplot: {png}")
    if args.json:
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
                "params": model.num_params(),
                "data": f"{config.data.source}, {config.data.tokenizer} tokenizer",
                "runs": runs,
            },  # fmt: skip
            "status": status,
            "report_only": args.report_only,  # then wall_s is the report's, not the runs
            "wall_s": time.perf_counter() - started,
            "runs": summaries,
            "gaps_vs_bf16": run_gaps,
            "target_abs_gap": TARGET_GAP,
            "paper": "COAT (arXiv 2410.19313), OLMo train loss BF16 / COAT: 1B 2.551 / 2.568, "
            "7B 2.366 / 2.379",
            "plot": png,
            "curves": curves,
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        with open(os.path.splitext(args.json)[0] + ".md", "w") as f:
            f.write(table + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
