"""End-to-end train step per policy: peak memory, largest batch, tokens/s and MFU (COAT Table 3).

COAT (arXiv 2410.19313) reports for Llama-2-7B at context 2048 on H100s 80 GB: 1.54x less peak
memory than BF16 at the same batch (4 GPUs, batch 2), twice the largest batch, 1.45x-1.85x the
tokens/s (``PAPER``). This script measures the same three things on one device (or on N with
``--fsdp N``) for ``bf16+adamw`` (baseline), ``fp8_linear+adamw`` (TransformerEngine-like FP8
GEMMs) and ``coat+fp8_adamw`` (FP8 activations and optimizer states; a policy may end in
``+bf16_grads``, ``+auto_gemm``: :data:`SUFFIXES`), and the ratios against our targets
(``TARGETS``).

  PYTHONPATH=. python3 bench/e2e.py --time_budget_s 900 \\
      --json bench/results/e2e_llama2_7b_h200_$(date +%F).json
  PYTHONPATH=. python3 bench/e2e.py --model tinyllama_1b --time_budget_s 300 \\
      --json bench/results/e2e_tinyllama_1b_h200_$(date +%F).json
  # any shape: --model llama2_7b --set model.n_layers=8 (keys of configs.base_config)
  # bf16 gradients: --policies bf16+adamw,coat+fp8_adamw,coat+fp8_adamw+bf16_grads
  # FSDP over the first N devices, --batch global (bench/multi_gpu.sh):
  PYTHONPATH=. python3 bench/e2e.py --fsdp 8 --batch 8 --policies bf16+adamw,coat+fp8_adamw \\
      --time_budget_s 540 --json bench/results/e2e_llama2_7b_8xh200_$(date +%F).json
  # policies run on separate GPUs, joined into one table (same run settings, else refused):
  CUDA_VISIBLE_DEVICES=0 ... --policies bf16+adamw --json a.json &
  CUDA_VISIBLE_DEVICES=1 ... --policies coat+fp8_adamw --json b.json; wait
  PYTHONPATH=. python3 bench/e2e.py --merge a.json b.json --json e2e.json

How: each policy's run comes from ``coat_jax.training.run.assemble`` (train.py's step, on a
``(data 1, fsdp N, tensor 1)`` mesh; synthetic tokens) and runs in two child processes, each
under train.py's allocator (``coat_jax.training.allocator``; variables you set win). The first
compiles the fixed ``--batch`` (``planner.memory_plan``) and runs it: the median of ``--steps``
timed steps (``coat_jax.core.measure``) gives tokens/s and MFU, the device's peak memory after
them the policy's peak. The second finds the largest batch by compiles alone
(``planner.largest_batch``, at most ``--max_compiles``) and runs it, one step (N sequences)
lower after each out-of-memory. Memory figures are per device (the fullest), beside the
allocator's settings; a CPU has neither limit nor peak, and searches only against
``--device_limit_gb``. ``--time_budget_s`` splits the time over the policies; compiles go to a
persistent cache (``--cache_dir``). Method and its history: docs/bench-methods.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import jax

POLICIES = ("bf16+adamw", "fp8_linear+adamw", "coat+fp8_adamw")
BASELINE = "bf16+adamw"
TARGETS = {"peak_memory_ratio_same_batch": 1.7, "max_batch_ratio": 4.0, "tokens_per_s_ratio": 1.5}
# Shapes beyond coat_jax.models.llama.PRESETS (which --model also accepts).
MODELS = {
    "tinyllama_1b": dict(dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, ffn_dim=5632),
    "llama_134m": dict(dim=768, n_layers=12, n_heads=12, n_kv_heads=12, ffn_dim=2048),
}
# COAT's Table 3 (Llama-2-7B, context 2048, H100 80 GB; tokens/s per GPU). TE = TransformerEngine.
PAPER = {
    "source": "Xi et al., COAT, arXiv 2410.19313, Llama-2-7B, context 2048, H100 80 GB",
    "1 GPU": {"peak_mem_gb": {"bf16": "OOM", "te": "OOM", "coat": 79.3},
              "max_batch": {"bf16": 0, "coat": 1}, "tokens_per_s": {"coat": 5906}},
    "2 GPU": {"peak_mem_gb": {"bf16": "OOM", "te": "OOM", "coat": 52.8},
              "max_batch": {"bf16": 1, "coat": 4},
              "tokens_per_s": {"bf16": 6130, "te": 6842, "coat": 11351}, "speedup": 1.85},
    "4 GPU, batch 2": {"peak_mem_gb": {"bf16": 55.1, "te": 51.1, "coat": 35.6},
                       "memory_ratio": 1.54, "max_batch": {"bf16": 2, "coat": 4},
                       "tokens_per_s": {"bf16": 7730, "te": 9577, "coat": 11257}, "speedup": 1.45},
    "8 GPU": {"peak_mem_gb": {"bf16": 41.2, "te": 37.2, "coat": 27.0}, "memory_ratio": 1.52,
              "max_batch": {"bf16": 4, "coat": 8},
              "tokens_per_s": {"bf16": 8238, "te": 11704, "coat": 11241}, "speedup": 1.36},
}  # fmt: skip
PLAN_KEYS = ("params", "grads", "optimizer_state", "activations_estimate", "logits_estimate",
             "workspace_estimate", "analytic_total", "compiled_temp", "compiled_total")  # fmt: skip
# Flags a child inherits from the parent (besides --set).
FORWARD = ("model", "seq_len", "batch", "fsdp", "steps", "warmup", "max_compiles",
           "device_limit_gb", "cache_dir", "seed")  # fmt: skip
# Run settings that must agree between the JSONs that --merge combines.
SAME = ("model", "seq_len", "batch", "fsdp", "set")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="llama2_7b", help="a PRESETS name or " + str(list(MODELS))
    )
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override, e.g. model.n_layers=8 (repeatable)")  # fmt: skip
    parser.add_argument("--policies", default=",".join(POLICIES), help="precision+optimizer, ...")
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1,
                        help="fixed global batch, a multiple of --fsdp")  # fmt: skip
    parser.add_argument(
        "--fsdp", type=int, default=1, help="devices: a mesh (1, N, 1) of the first N"
    )
    parser.add_argument("--steps", type=int, default=6, help="timed steps per batch size")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--max_compiles", type=int, default=4, help="of the largest-batch search")
    parser.add_argument("--device_limit_gb", type=float,
                        help="the limit per device (config.memory_limit_gb)")  # fmt: skip
    parser.add_argument("--cache_dir", default=os.path.join("runs", "xla_cache"),
                        help="persistent compilation cache")  # fmt: skip
    parser.add_argument("--time_budget_s", type=float, help="stop searching after this long")
    parser.add_argument("--no_search", action="store_true",
                        help="the fixed --batch only, no largest-batch search")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write results here")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="one table from these runs' JSONs")  # fmt: skip
    parser.add_argument("--one", metavar="POLICY", help=argparse.SUPPRESS)  # child mode
    parser.add_argument("--out", help=argparse.SUPPRESS)  # child: where its JSON goes
    parser.add_argument("--phase", choices=("fixed", "search"), default="fixed",
                        help=argparse.SUPPRESS)  # child: which of the two  # fmt: skip
    parser.add_argument("--fixed_json", help=argparse.SUPPRESS)  # search child: phase 1's JSON
    return parser.parse_args(argv)


SUFFIXES = {
    "bf16_grads": {"grad_dtype": "bfloat16"},
    "fp32_grads": {"grad_dtype": "float32"},
    "auto_gemm": {"fp8.gemm": "auto"},
    "pallas_gemm": {"fp8.gemm": "pallas"},
    "requantize": {"fp8.saved_weights": "requantize"},
    "bf16_product": {"fp8.gemm_product": "bf16"},
}
"""Policy suffixes (``coat+fp8_adamw+bf16_grads+auto_gemm``) and the config keys they set."""


def bench_config(args, policy: str):
    """The train config of ``policy`` for ``args``: ``"<precision>+<optimizer>"``, then any
    :data:`SUFFIXES`: ``+bf16_grads`` / ``+fp32_grads`` (``grad_dtype``; without them the
    config's ``auto``: bf16 where the fused update runs), ``+auto_gemm`` / ``+pallas_gemm``
    (``fp8.gemm``: the Pallas per-tensor FP8 GEMM where measured faster, or everywhere),
    ``+requantize`` (``fp8.saved_weights``), ``+bf16_product`` (``fp8.gemm_product``)."""
    from coat_jax.models.llama import PRESETS
    from coat_jax.training import configs

    if "+" not in policy:
        raise ValueError(f"policy {policy!r}: expected <precision>+<optimizer>[+suffix...]")
    precision, optimizer, *suffixes = policy.split("+")
    for suffix in suffixes:
        if suffix not in SUFFIXES:
            raise ValueError(f"policy {policy!r}: {suffix!r} is not one of {sorted(SUFFIXES)}")
    if args.model in PRESETS:
        config = configs.pretraining_config(args.model)
    elif args.model in MODELS:
        config = configs.pretraining_config("llama2_7b")
        config.model.update(MODELS[args.model])
    else:
        raise ValueError(f"--model {args.model!r}: expected one of {list(PRESETS) + list(MODELS)}")
    config.precision, config.optimizer.name = precision, optimizer
    config.seq_len, config.batch_size, config.seed = args.seq_len, args.batch, args.seed
    config.mesh.update(data=1, fsdp=args.fsdp, tensor=1)
    if args.device_limit_gb:
        config.memory_limit_gb = args.device_limit_gb
    for suffix in suffixes:
        configs.apply_overrides(config, SUFFIXES[suffix])
    configs.apply_overrides(config, configs.parse_overrides(args.set))
    configs.validate(config)
    return config


def check_args(args) -> None:
    """Raises ValueError (one line) on a mesh or batch that cannot run, before any child."""
    if args.fsdp < 1:
        raise ValueError(f"--fsdp {args.fsdp}: expected a positive number of devices")
    if args.batch < 1 or args.batch % args.fsdp:
        raise ValueError(
            f"--batch {args.batch} (global) must be a positive multiple of --fsdp {args.fsdp}"
        )
    if args.steps < 1 or args.warmup < 0 or args.max_compiles < 1:
        raise ValueError("--steps and --max_compiles must be >= 1, --warmup >= 0")


def is_oom(error: Exception) -> bool:
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def first_that_runs(b: int, n: int, attempt):
    """Tries ``b``, ``b - n``, ... down to ``n``: ``attempt(batch)`` returns its row (``"oom"``
    true if it ran out of memory) or ``None`` to stop. Returns ``(batch, row)`` of the first
    that ran, ``(0, None)`` if none did, ``(None, None)`` if stopped."""
    while b >= n:
        row = attempt(b)
        if row is None:
            return None, None
        if not row["oom"]:
            return b, row
        b -= n
    return 0, None


def measure_policy(args, policy: str, fixed: dict | None = None) -> dict:
    """Child: the fixed batch of ``policy`` (``fixed`` None) or, continuing ``fixed`` (the
    first child's result), the largest batch; the result is rewritten to ``args.out`` after
    each phase, so a parent that has to kill the child still gets what was measured."""
    from coat_jax.core import measure
    from coat_jax.training import metrics, planner
    from coat_jax.training.run import assemble

    n, b0, seq = args.fsdp, args.batch, args.seq_len
    deadline = time.perf_counter() + args.time_budget_s if args.time_budget_s else math.inf
    jax.config.update("jax_compilation_cache_dir", args.cache_dir)
    if n > jax.device_count():
        raise ValueError(f"--fsdp {n}: only {jax.device_count()} devices here")
    devices = jax.devices()[:n]
    run = assemble(bench_config(args, policy), devices=devices)
    mesh = run.placement.mesh
    limit = planner.device_limit(run)
    room = limit - planner.MARGIN if limit else None
    if fixed is not None:
        result = dict(fixed, runs=list(fixed["runs"]))
        result.pop("returncode", None)
    else:
        result = {
            "policy": policy, "fused_optimizer": run.fused_update, "grad_dtype": run.grad_dtype,
            "device": devices[0].device_kind, "devices": n, "mesh": dict(mesh.shape),
            "jax": jax.__version__, "allocator": measure.allocator_settings(),
            "device_limit_bytes": limit, "margin_bytes": planner.MARGIN,
            "params": run.model.num_params(), "plans": {}, "fixed": None, "max": None,
            "max_batch": None, "search": None, "phases_s": {}, "runs": [],
        }  # fmt: skip
    label = "" if fixed is None else " (search)"

    def save():
        if args.out:
            with open(args.out + ".tmp", "w") as f:
                json.dump(result, f, indent=2)
            os.replace(args.out + ".tmp", args.out)

    @contextlib.contextmanager
    def phase(name):
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            result["phases_s"][name] = round(seconds, 2)
            print(f"[{policy}] {name}: {seconds:.1f} s", flush=True)
            save()

    def create():
        with phase("init params + optimizer state" + label):
            return jax.block_until_ready(run.create())

    def run_at(b, state):
        """``(row, state)``: timed steps at batch ``b`` (``state`` donated; re-created after an
        out-of-memory in the search child)."""
        result["runs"].append(b)
        tokens = jax.random.randint(jax.random.key(b), run.batch_shape(b), 0, run.model.vocab_size)
        tokens = jax.device_put(tokens, run.placement.batch)
        step = lambda carry: run.loop_step(carry[0], tokens)  # train.py's call
        try:
            with phase(f"run batch {b}"), jax.set_mesh(mesh):
                carry = (run.loop_step.flatten(*state), None)
                timing, carry = measure.time_loop(step, carry, warmup=args.warmup,
                                                  iters=args.steps)  # fmt: skip
        except Exception as e:  # noqa: BLE001 - only an out-of-memory is expected
            if not is_oom(e):
                raise
            print(f"[{policy}] batch {b}: out of memory", flush=True)
            if fixed is not None and any(x.is_deleted() for x in jax.tree.leaves(state)):
                state = create()
            return {"batch": b, "oom": True}, state
        tokens_per_s = b * seq / (timing.median_ms / 1e3)
        row = {"batch": b, "oom": False, "step_s": timing.median_ms / 1e3,
               "step_s_min": timing.min_ms / 1e3, "tokens_per_s": tokens_per_s,
               "tokens_per_s_per_device": tokens_per_s / n, "loss": float(carry[1]["loss"]),
               "peak_bytes": measure.device_memory(devices).peak,
               "mfu": metrics.mfu(run.model, seq, tokens_per_s, n, run.config.peak_tflops),
               }  # fmt: skip
        return row, run.loop_step.unflatten(carry[0])

    if fixed is None:  # the fixed batch, then exit (the search runs in a new process)
        with phase(f"compile batch {b0}"):
            plan = planner.memory_plan(run, b0)
        result["plans"][str(b0)] = {k: plan[k] for k in PLAN_KEYS}
        if room is not None and plan["compiled_total"] > room:
            result["fixed"] = {"batch": b0, "oom": True, "reason": "compiled plan over the limit"}
        else:
            result["fixed"], _ = run_at(b0, create())
            if result["fixed"].get("peak_bytes"):
                result["fixed"]["peak_over_plan_bytes"] = (
                    result["fixed"]["peak_bytes"] - plan["compiled_total"]
                )
        if not limit:
            result["search"] = "skipped: the device reports no memory limit (see --device_limit_gb)"
        elif result["fixed"]["oom"] and b0 == n:
            result.update(max_batch=0, search=f"done: batch {b0} does not fit")
        save()
        return result

    # The search: compiles only, then the largest batch runs first (docs/bench-methods.md).
    if time.perf_counter() > deadline:
        result["search"] = "stopped: time budget (before the search)"
        save()
        return result
    with phase("largest batch by compiles"):
        largest = planner.largest_batch(run, max_compiles=args.max_compiles)
    print(f"[{policy}] {largest.describe()}", flush=True)
    result["compiled_totals"] = {str(b): t for b, t in sorted(largest.compiled_totals.items())}
    result["predicted_max_batch"] = largest.batch_size
    fixed_row, result["search"] = result["fixed"], "done"
    state = None

    def attempt(b):
        nonlocal state
        if b == b0 and not fixed_row["oom"]:
            return fixed_row  # ran in the first child
        if time.perf_counter() > deadline:
            result["search"] = f"stopped: time budget (before trying batch {b})"
            return None
        row, state = run_at(b, state or create())
        return row

    start = min(largest.batch_size, b0 - n) if fixed_row["oom"] else largest.batch_size
    result["max_batch"], result["max"] = first_that_runs(start, n, attempt)
    save()
    return result


def ratio(num, den):
    return num / den if num is not None and den else None


def summarize(results: list[dict]) -> dict:
    """Ratios of each policy against the baseline, beside the targets."""
    base = next((r for r in results if r["policy"] == BASELINE), None)
    out = {}
    for r in results:
        if base is None or r is base or "fixed" not in r or "fixed" not in base:
            continue
        rf, bf = r.get("fixed") or {}, base.get("fixed") or {}
        rplan = r["plans"].get(str(rf.get("batch")), {})
        bplan = base["plans"].get(str(bf.get("batch")), {})
        out[r["policy"]] = {
            "peak_memory_ratio_same_batch": ratio(bf.get("peak_bytes"), rf.get("peak_bytes")),
            "planned_memory_ratio_same_batch": ratio(
                bplan.get("compiled_total"), rplan.get("compiled_total")
            ),
            "max_batch_ratio": ratio(r.get("max_batch"), base.get("max_batch")),
            "tokens_per_s_ratio_at_max_batch": ratio(
                (r.get("max") or {}).get("tokens_per_s"),
                (base.get("max") or {}).get("tokens_per_s"),
            ),
            "tokens_per_s_ratio_same_batch": ratio(rf.get("tokens_per_s"), bf.get("tokens_per_s")),
        }
    return out


def fmt(value, spec="{:.2f}", none="-"):
    return none if value is None else spec.format(value)


def table(results: list[dict], ratios: dict, batch: int, devices: int = 1) -> str:
    """Markdown rows, one per policy; with ``devices`` > 1 memory is per device (the largest)
    and tokens/s at the largest batch also per device."""
    gb = lambda b: fmt(b and b / 1e9, "{:.3g}")
    per = devices > 1
    lines = [
        f"| policy | peak GB{'/GPU' if per else ''} @ batch {batch} | vs bf16 | planned GB | "
        f"vs bf16 | max batch | vs bf16 | tok/s @ {batch} | MFU | tok/s @ max | "
        + ("tok/s/GPU | " if per else "")
        + "MFU | vs bf16 |",
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if per else "") + "---|---|",
    ]
    for r in results:
        f, m, q = r.get("fixed") or {}, r.get("max") or {}, ratios.get(r["policy"], {})
        plan = r.get("plans", {}).get(str(f.get("batch")), {})
        peak = "OOM" if f.get("oom") else gb(f.get("peak_bytes"))
        per_device = f"{fmt(m.get('tokens_per_s_per_device'), '{:.0f}')} | " if per else ""
        lines.append(
            f"| {r['policy']} | {peak} | {fmt(q.get('peak_memory_ratio_same_batch'), '{:.2f}x')} | "
            f"{gb(plan.get('compiled_total'))} | "
            f"{fmt(q.get('planned_memory_ratio_same_batch'), '{:.2f}x')} | "
            f"{fmt(r.get('max_batch'), '{}')} | {fmt(q.get('max_batch_ratio'), '{:.2f}x')} | "
            f"{fmt(f.get('tokens_per_s'), '{:.0f}')} | {fmt(f.get('mfu'))} | "
            f"{fmt(m.get('tokens_per_s'), '{:.0f}')} | {per_device}{fmt(m.get('mfu'))} | "
            f"{fmt(q.get('tokens_per_s_ratio_at_max_batch'), '{:.2f}x')} |"
        )
    return "\n".join(lines)


def paper_row(devices: int) -> str | None:
    """COAT's Table 3 row with the same GPU count, as one line (None if it has none)."""
    key = next((k for k in PAPER if k.split(",")[0] == f"{devices} GPU"), None)
    if key is None:
        return None
    show = lambda v: ", ".join(f"{k} {x}" for k, x in v.items()) if isinstance(v, dict) else v
    row = "; ".join(f"{k} {show(v)}" for k, v in PAPER[key].items())
    return f"paper, {key} (H100 80 GB; tokens/s per GPU): {row}"


def run_child(args, policy: str, budget: float | None, fixed: dict | None = None) -> dict:
    """One child process of ``policy`` (killed 300 s past ``budget``): the fixed batch, or the
    search continuing the first child's result ``fixed``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--one", policy, "--out", out,
               "--phase", "fixed" if fixed is None else "search"]  # fmt: skip
        if fixed is not None:
            with open(os.path.join(tmp, "fixed.json"), "w") as f:
                json.dump(fixed, f)
            cmd += ["--fixed_json", os.path.join(tmp, "fixed.json")]
        for name in FORWARD:
            if getattr(args, name) is not None:
                cmd += [f"--{name}", str(getattr(args, name))]
        for item in args.set:
            cmd += ["--set", item]
        if budget is not None:
            cmd += ["--time_budget_s", f"{budget:.0f}"]
        timeout = None if budget is None else budget + 300  # a compile may run past the budget
        try:
            returncode = subprocess.run(cmd, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            returncode = "timeout"
        result = dict(fixed) if fixed is not None else {"policy": policy}
        if os.path.exists(out):
            with open(out) as f:
                result = json.load(f)
        result["returncode"] = returncode
        return result


def run_policy(args, policy: str, budget: float | None) -> dict:
    """Both children of ``policy``: the fixed batch, then (with a limit to search against and
    time left) the search. One result, the search child's extending the first's; its
    ``returncodes`` holds both."""
    started = time.perf_counter()
    result = run_child(args, policy, budget)
    returncodes = {"fixed": result["returncode"]}
    if args.no_search and result.get("search") is None:
        result["search"] = "skipped: --no_search"
    if result["returncode"] == 0 and result.get("search") is None:
        left = None if budget is None else budget - (time.perf_counter() - started)
        if left is not None and left <= 0:
            result["search"] = "stopped: time budget (before the search child)"
        else:
            result = run_child(args, policy, left, result)
            returncodes["search"] = result["returncode"]
    result["returncodes"] = returncodes
    result["returncode"] = next((rc for rc in returncodes.values() if rc != 0), 0)
    return result


def report(config: dict, results: list[dict], wall_s: float, path: str | None, measured_with=None,
           **extra):  # fmt: skip
    """Prints the table and ratios of ``results``; writes them with ``config`` to ``path``.
    ``measured_with``: ``{"date", "jax"}`` of the runs (default: today and this process's)."""
    when = measured_with or {"date": datetime.date.today().isoformat(), "jax": jax.__version__}
    ratios = summarize(results)
    measured = [r for r in results if "device" in r]
    first = measured[0] if measured else {}
    devices = config.get("fsdp", 1)
    limit, allocator = first.get("device_limit_bytes"), first.get("allocator") or {}
    mesh = ", ".join(f"{k} {v}" for k, v in first.get("mesh", {}).items())
    settings = ", ".join(f"{k.removeprefix('XLA_PYTHON_CLIENT_')}={v}"
                         for k, v in allocator.items())  # fmt: skip
    print(
        f"\n{config['model']} ({fmt(first.get('params') and first['params'] / 1e6, '{:.4g}M')} "
        f"params), seq {config['seq_len']}, synthetic tokens, on {devices} x "
        f"{first.get('device')} (mesh {mesh or '-'}; limit "
        f"{fmt(limit and limit / 1e9, '{:.3g} GB')} per device; allocator {settings or '-'}), "
        f"jax {when['jax']}, {wall_s:.0f} s"
    )
    print(table(results, ratios, config["batch"], devices))
    paper = paper_row(devices) if devices > 1 else None
    if paper:
        print(paper)
    print(f"targets vs bf16: {TARGETS}")
    if path:
        out = {
            "date": when["date"],
            "device": first.get("device"),
            "devices": devices,
            "mesh": first.get("mesh"),
            "device_limit_bytes": limit,
            "allocator": allocator,
            "jax": when["jax"],
            "config": config,
            "data": "synthetic: uniform random token ids, a new batch per batch size",
            "wall_s": wall_s,
            "results": results,
            "ratios_vs_bf16": ratios,
            "targets": TARGETS,
            "paper": PAPER,
        } | extra
        with open(path, "w") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {path}")


def merge(paths: list[str], path: str | None) -> None:
    """One report from the JSONs of separate runs (e.g. one policy per GPU, in parallel)."""
    reports = []
    for p in paths:
        with open(p) as f:
            reports.append(json.load(f))
    defaults = {"fsdp": 1, "set": []}
    same = lambda r: (
        {k: r["config"].get(k, defaults.get(k)) for k in SAME} | {"allocator": r.get("allocator")}
    )
    for p, r in zip(paths[1:], reports[1:], strict=True):
        differ = [k for k in same(r) if same(r)[k] != same(reports[0])[k]]
        if differ:
            raise ValueError(
                f"--merge: {p} differs from {paths[0]} in "
                + ", ".join(f"{k} ({same(r)[k]!r} vs {same(reports[0])[k]!r})" for k in differ)
            )
    runs = {k: sorted({str(r.get(k)) for r in reports}) for k in ("jax", "date")}
    if len(runs["jax"]) > 1:
        raise ValueError(f"--merge: the runs used different jax versions: {runs['jax']}")
    results = [x for r in reports for x in r["results"]]
    policies = [x["policy"] for x in results]
    if len(set(policies)) < len(policies):
        raise ValueError(f"--merge: a policy appears twice in {policies}")
    wall_s = max(r.get("wall_s", 0) for r in reports)  # separate runs: in parallel, say
    measured_with = {"jax": runs["jax"][0], "date": " and ".join(runs["date"])}
    report(reports[0]["config"], results, wall_s, path, measured_with, merged_from=paths)


def child_main(args) -> None:
    """``--one POLICY``: one child, under train.py's allocator (set before any device use)."""
    from coat_jax.training import allocator

    allocator.configure()
    fixed = None
    if args.phase == "search":
        with open(args.fixed_json) as f:
            fixed = json.load(f)
    try:
        result = measure_policy(args, args.one, fixed)
    except ValueError as e:  # the parent reports it
        if not args.out:
            raise
        with open(args.out, "w") as f:
            json.dump({"policy": args.one, "error": str(e)}, f)
        sys.exit(2)
    print(json.dumps({k: result[k] for k in ("policy", "max_batch", "search")}))


def main(argv=None):
    args = parse_args(argv)
    if args.one:
        return child_main(args)
    try:
        run(args)
    except ValueError as e:
        sys.exit(f"e2e.py: {e}")


def run(args) -> None:
    if args.merge:
        merge(args.merge, args.json)
        return
    check_args(args)
    policies = args.policies.split(",")
    for policy in policies:
        bench_config(args, policy)  # fail fast on a bad policy, model or override
    skip = ("json", "one", "out", "merge", "phase", "fixed_json")
    config = {k: v for k, v in vars(args).items() if k not in skip}
    config["model_fields"] = bench_config(args, policies[0]).model.to_dict()
    started = time.perf_counter()
    results = []
    for i, policy in enumerate(policies):
        budget = None
        if args.time_budget_s:
            left = args.time_budget_s - (time.perf_counter() - started)
            if left <= 0:
                results.append({"policy": policy, "skipped": "time budget"})
                continue
            budget = left / (len(policies) - i)
        print(f"== {policy} (budget {fmt(budget, '{:.0f} s', 'none')})", flush=True)
        results.append(run_policy(args, policy, budget))
        if "error" in results[-1]:
            raise ValueError(results[-1]["error"])
        if i + 1 < len(policies):  # a run stopped from outside keeps the policies it finished
            report(config, results, time.perf_counter() - started, args.json, complete=False)
    report(config, results, time.perf_counter() - started, args.json, complete=True)


if __name__ == "__main__":
    main()
