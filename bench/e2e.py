"""End-to-end train step per policy: peak memory, largest batch, tokens/s and MFU (COAT Table 3).

COAT (arXiv 2410.19313) reports for Llama-2-7B at context 2048 on H100s 80 GB: 1.54x less peak
memory than BF16 at the same batch (4 GPUs, batch 2), twice the largest batch, 1.45x-1.85x the
tokens/s (``PAPER`` below). This script measures the same three things on one device (or on N
with ``--fsdp N``) for ``bf16+adamw`` (baseline), ``fp8_linear+adamw`` (TransformerEngine-like
FP8 GEMMs) and ``coat+fp8_adamw`` (FP8 activations and FP8 optimizer states), and the ratios
against our targets (``TARGETS``: >= 1.7x less memory, >= 4x the batch, >= 1.5x the tokens/s).

Reproducing the results (one H200; about 12-15 GPU minutes for the 7B, 3-5 for the 1.1B):

  XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python3 bench/e2e.py --time_budget_s 900 \\
      --json bench/results/e2e_llama2_7b_h200_$(date +%F).json
  XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python3 bench/e2e.py --model tinyllama_1b \\
      --time_budget_s 300 --json bench/results/e2e_tinyllama_1b_h200_$(date +%F).json
  # any shape: --model llama2_7b --set model.n_layers=8 (keys of configs.base_config)
  # bf16 gradients (train.py's grad_dtype=bfloat16) as a policy of its own:
  #   --policies bf16+adamw,coat+fp8_adamw,coat+fp8_adamw+bf16_grads

On N GPUs of one host (issue 10; ``bench/multi_gpu.sh`` runs this with N = the GPU count), FSDP
over a ``(data 1, fsdp N, tensor 1)`` mesh, ``--batch`` the global batch (a multiple of N); 8 H200s:

  XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python3 bench/e2e.py --model llama2_7b \\
      --fsdp 8 --batch 8 --policies bf16+adamw,coat+fp8_adamw --time_budget_s 540 \\
      --json bench/results/e2e_llama2_7b_8xh200_$(date +%F).json

Memory figures are then per GPU (the peak of the fullest device; the plans are XLA's per-device
analysis), MFU per GPU, tokens/s both in total and per GPU (``tokens_per_s_per_device``, what
the paper reports), and the largest-batch search moves N sequences (one per GPU) at a time.
Policies run on separate GPUs in parallel can be joined into one table (same model, seq_len,
batch, fsdp and --set, else refused):

  CUDA_VISIBLE_DEVICES=0 ... bench/e2e.py --policies bf16+adamw --json a.json &
  CUDA_VISIBLE_DEVICES=1 ... bench/e2e.py --policies coat+fp8_adamw --json b.json; wait
  PYTHONPATH=. python3 bench/e2e.py --merge a.json b.json --json e2e.json

Method. Each policy runs in two child processes (``--one POLICY --phase fixed``, then
``--phase search``), so that the device's ``peak_bytes_in_use``, which cannot be reset, is that
policy's own, and so that the search's first device step is its largest: XLA's BFC allocator
keeps the regions it has carved (batch 1's temp buffer, ~23 GB for the 7B) cached as free, and
a larger step's temp buffer (one contiguous chunk) then cannot get a new region under the limit
(cached free + live params/state + new temp > limit): on an H200, batch 5, 4 and 3 of the 7B
all ran out of memory after batch 1 had run in the same process, though their plans fit.
Largest-first in a fresh process was not enough either (H200, same day: batch 5 of the 7B,
plan 139.4 GB of 142.6, still failed to get its 58.5 GB temp buffer with allocator growth on:
regions carved while the parameters were created do not coalesce with one another), so the
search child runs with ``XLA_PYTHON_CLIENT_PREALLOCATE=true``: one region, whose freed chunks
coalesce (its peak, ``peak_bytes_in_use``, counts buffers in use, not the region).
Children get ``XLA_PYTHON_CLIENT_MEM_FRACTION=--mem_fraction`` (0.95: the allocator may use 95%
of the GPU, not JAX's default 75%). The model comes from ``coat_jax.models.llama.init_params``
and the step from ``coat_jax.train_loop.make_train_step`` (fp32 master weights and gradients,
grad_accum 1, params and state donated); data are uniform random tokens (synthetic: the step's
cost does not depend on them). Per policy, at most ``--max_compiles`` (4) compiles of the step:

1. (fixed child) the fixed ``--batch``: compiled (with ``coat_jax.planner.memory_plan``: params,
   gradients, optimizer state, saved activations, XLA's compiled total), run: ``--warmup``
   steps, then the median of ``--steps`` timed steps (``jax.block_until_ready``) gives tokens/s
   and MFU, and the device's peak memory after it is the policy's peak at that batch. ``slack``
   = measured peak - compiled total (XLA's autotuning scratch, allocator rounding; 6% of the
   plan if not measured). The child writes its JSON and exits;
2. (search child, given that JSON; only with a memory limit and time left) a probe batch: the
   planner's analytic model (``params + state + max(activations + 2 logits, gradients) +
   workspace``, scaled from step 1) predicts the largest batch; the step is compiled there
   (memory analysis only: compiles allocate nothing on the device);
3. a line through the two compiled totals predicts the largest batch ``b`` with
   ``total(b) + slack <= device limit``; ``b`` is compiled, then params and optimizer state are
   created (once) and ``b`` is run (timed as in 1): the child's first device step;
4. if that does not fit: with its compiled plan over the limit, the batch the line through
   ``b`` and the nearest other compiled batch predicts (``batch_below``; XLA's totals grow
   faster than linearly at large batches); after RESOURCE_EXHAUSTED, ``b - N`` (after an OOM
   nothing new is cached, so going down works where going up does not). If the fixed batch
   did not fit, the search starts below it. ``runs`` lists the batches run, in order.

Compiles go to a persistent cache (``--cache_dir``), so a second invocation on the same machine
skips them. ``--time_budget_s`` bounds the whole run: each policy gets an equal share of what is
left (its search child what its fixed child left of it), a child is killed 300 s past its share,
and the search skips its remaining phases once past it; the JSON keeps what was measured.
Per-phase wall times are printed and stored. On a CPU there is no memory limit or peak:
those fields are None unless ``--device_limit_gb`` sets a limit to search against.
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
           "device_limit_gb", "slack_fraction", "cache_dir", "seed")  # fmt: skip
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
    parser.add_argument("--max_compiles", type=int, default=4, help="per policy")
    parser.add_argument("--mem_fraction", type=float, default=0.95,
                        help="XLA_PYTHON_CLIENT_MEM_FRACTION of each child")  # fmt: skip
    parser.add_argument("--device_limit_gb", type=float, help="search against this limit instead")
    parser.add_argument("--slack_fraction", type=float, default=0.06,
                        help="peak over compiled plan, when no peak is measured")  # fmt: skip
    parser.add_argument("--cache_dir", default=os.path.join("runs", "xla_cache"),
                        help="persistent compilation cache")  # fmt: skip
    parser.add_argument("--time_budget_s", type=float, help="stop searching after this long")
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


def bench_config(args, policy: str):
    """The train config of ``policy`` for ``args``: ``"<precision>+<optimizer>"``, optionally
    ``"+bf16_grads"`` (``grad_dtype=bfloat16``, e.g. ``coat+fp8_adamw+bf16_grads``)."""
    from coat_jax import configs
    from coat_jax.models.llama import PRESETS

    precision, _, optimizer = policy.partition("+")
    optimizer, _, grads = optimizer.partition("+")
    if grads not in ("", "bf16_grads"):
        raise ValueError(f"policy {policy!r}: the third part may only be 'bf16_grads'")
    if args.model in PRESETS:
        config = configs.pretraining_config(args.model)
    elif args.model in MODELS:
        config = configs.pretraining_config("llama2_7b")
        config.model.update(MODELS[args.model])
    else:
        raise ValueError(f"--model {args.model!r}: expected one of {list(PRESETS) + list(MODELS)}")
    config.precision, config.optimizer.name = precision, optimizer
    config.seq_len, config.batch_size, config.seed = args.seq_len, args.batch, args.seed
    if grads:
        config.grad_dtype = "bfloat16"
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


def check_devices(n: int) -> None:
    if n > jax.device_count():
        raise ValueError(f"--fsdp {n}: only {jax.device_count()} devices here")


def is_oom(error: Exception) -> bool:
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def measure(args, policy: str, phase_name: str = "fixed", fixed: dict | None = None) -> dict:
    """Child: one phase of one policy, in this process; the result is rewritten to ``args.out``
    after each step, so a parent that has to kill it still gets what was measured.

    ``phase_name`` "fixed": compile and run the fixed batch (the result's ``fixed``, ``plans``,
    ``slack_bytes``). "search": continue ``fixed`` (phase 1's result) with the largest-batch
    search, whose first device step is its largest candidate (see the module's Method)."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from coat_jax import configs, parallel, planner, sharding, train_loop
    from coat_jax.models.llama import Llama, init_params

    n = args.fsdp  # main() checked it against the devices (check_devices)
    started = time.perf_counter()
    deadline = started + args.time_budget_s if args.time_budget_s else math.inf
    jax.config.update("jax_compilation_cache_dir", args.cache_dir)
    config = bench_config(args, policy)
    model_config = configs.llama_config(config)
    optimizer, schedule = train_loop.make_optimizer(config.optimizer, config.steps)
    graph, abstract = nnx.split(nnx.eval_shape(lambda: Llama(model_config, rngs=nnx.Rngs(0))))
    abstract_state = jax.eval_shape(optimizer.init, abstract)
    # One device: no mesh, no placement (the unsharded step); N: FSDP over the first N.
    mesh = sharding.make_mesh(data=1, fsdp=n, tensor=1, devices=jax.devices()[:n])
    placement = parallel.make_placement(mesh, abstract, optimizer) if n > 1 else None
    on_mesh = (lambda: jax.set_mesh(mesh)) if placement else contextlib.nullcontext
    train_step, fused = train_loop.config_train_step(config, graph, optimizer, schedule, placement)
    devices = list(mesh.devices.flat)
    device = devices[0]
    limits = [(d.memory_stats() or {}).get("bytes_limit") for d in devices]
    limit = (
        args.device_limit_gb * 1e9
        if args.device_limit_gb
        else (None if None in limits else min(limits))
    )
    seq, b0 = args.seq_len, args.batch
    if fixed is not None:  # the search phase continues phase 1's result
        result = dict(fixed, runs=list(fixed.get("runs", [])))
        result.pop("returncode", None)
    else:
        result = {
            "policy": policy, "fused_optimizer": fused, "device": device.device_kind,
            "devices": n, "mesh": dict(mesh.shape), "jax": jax.__version__,
            "device_limit_bytes": limit, "params": model_config.num_params(), "compiles": 0,
            "plans": {}, "fixed": None, "max": None, "max_batch": None, "search": None,
            "phases_s": {}, "runs": [],
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

    def fresh_state():
        params = init_params(model_config, args.seed, placement and placement.params)[1]
        if placement:
            return params, jax.block_until_ready(placement.init_opt_state(optimizer, params))
        return params, jax.block_until_ready(jax.jit(optimizer.init)(params))

    def peak_bytes():  # per device: the largest over the mesh's devices
        peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in devices]
        return None if None in peaks else max(peaks)

    compiled = {}
    plans = {int(b): plan for b, plan in result["plans"].items()}  # phase 1's, in the search

    def compile_at(b):
        batch = jax.ShapeDtypeStruct((1, b, seq + 1), jnp.int32)
        with phase(f"compile batch {b}"), on_mesh():
            plans[b] = planner.memory_plan(
                train_step, graph, abstract, abstract_state, batch, model_config, placement,
                config.grad_dtype,
            )  # fmt: skip
            compiled[b] = train_step.lower(abstract, abstract_state, batch).compile()  # cached
        result["compiles"] += 1
        result["plans"][str(b)] = {k: plans[b][k] for k in PLAN_KEYS}
        return compiled[b]

    def run_at(b, params, opt_state, reinit=True):
        """Timed steps at batch ``b``: (row, params, opt_state); re-created after an OOM if
        they were donated and ``reinit``."""
        result["runs"].append(b)
        tokens = jax.random.randint(jax.random.key(b), (1, b, seq + 1), 0, model_config.vocab_size)
        if placement:
            tokens = jax.device_put(tokens, placement.batch)
        times, step = [], compiled[b]
        try:
            with phase(f"run batch {b}"):
                for i in range(args.warmup + args.steps):
                    start = time.perf_counter()
                    params, opt_state, metrics = step(params, opt_state, tokens)
                    jax.block_until_ready(metrics)
                    if i >= args.warmup:
                        times.append(time.perf_counter() - start)
        except Exception as e:  # noqa: BLE001 - only an OOM is expected; others re-raise
            if not is_oom(e):
                raise
            print(f"[{policy}] batch {b}: out of memory", flush=True)
            if reinit and any(x.is_deleted() for x in jax.tree.leaves((params, opt_state))):
                with phase(f"re-init after OOM at batch {b}"):
                    params, opt_state = fresh_state()
            return {"batch": b, "oom": True}, params, opt_state
        seconds = float(np.median(times))
        row = {"batch": b, "oom": False, "step_s": seconds, "step_s_min": float(min(times)),
               "tokens_per_s": b * seq / seconds, "tokens_per_s_per_device": b * seq / seconds / n,
               "loss": float(metrics["loss"]), "peak_bytes": peak_bytes()}  # fmt: skip
        row["mfu"] = train_loop.mfu(model_config, seq, row["tokens_per_s"], n)  # per device
        return row, params, opt_state

    if fixed is None:  # phase 1: the fixed batch, then exit (the search runs in a new process)
        compile_at(b0)
        plan0 = plans[b0]
        if limit and plan0["compiled_total"] > limit:
            result["fixed"] = {"batch": b0, "oom": True, "reason": "compiled plan over the limit"}
        else:
            with phase("init params + optimizer state"):
                params, opt_state = fresh_state()
            result["fixed"], params, opt_state = run_at(b0, params, opt_state, reinit=False)
            del params, opt_state
        fixed_peak = result["fixed"].get("peak_bytes")
        slack = fixed_peak - plan0["compiled_total"] if fixed_peak else None
        if slack is None or slack < 0:
            slack = args.slack_fraction * plan0["compiled_total"]
        result["slack_bytes"] = slack
        if not limit:
            result["search"] = "skipped: the device reports no memory limit (see --device_limit_gb)"
        elif result["fixed"]["oom"] and b0 == n:
            result.update(max_batch=0, search=f"done: batch {b0} does not fit")
        save()
        return result

    # Phase 2, the search: compiles only (no device memory beyond what XLA keeps for the
    # executables) until the largest candidate; then runs from the largest down.
    plan0, slack = plans[b0], result["slack_bytes"]
    fits = lambda b: plans[b]["compiled_total"] + slack <= limit

    # The plans are per device; batches are global, in steps of n (one sequence more per device).
    def analytic(b):  # the planner's analytic total at global batch b, scaled from the fixed one
        per = lambda key: plan0[key] / b0  # per device, per global sequence
        activations = (per("activations_estimate") + 2 * per("logits_estimate")) * b
        return (plan0["params"] + plan0["optimizer_state"] + max(activations, plan0["grads"])
                + per("workspace_estimate") * b)  # fmt: skip

    b_analytic = 0
    while b_analytic < 4096 * n and analytic(b_analytic + n) + slack <= limit:
        b_analytic += n
    result["predicted_max_batch_analytic"] = b_analytic
    fixed_oom = result["fixed"]["oom"]
    probe = max(n, min(b_analytic, b0 - n)) if fixed_oom else max(b_analytic, b0 + n)
    if time.perf_counter() > deadline:
        result["search"] = "stopped: time budget (before the probe compile)"
        save()
        return result
    compile_at(probe)
    totals = lambda: {x: plan["compiled_total"] for x, plan in plans.items()}
    b, slope = batch_on_line(probe, b0, totals(), limit - slack, n)
    b = min(max(probe if b is None else b, n), 4 * max(probe, b0))
    if fixed_oom:  # batch b0 did not fit: below it
        b = min(b, b0 - n)
    result["predicted_max_batch"] = b
    result["compiled_bytes_per_sequence"] = slope
    result["search"] = "done"
    params = opt_state = None  # created once, just before the first (largest) run
    while True:
        if b < n:
            result["max_batch"] = 0
            break
        if b == b0 and not fixed_oom:
            result["max_batch"], result["max"] = b0, result["fixed"]
            break
        if time.perf_counter() > deadline:
            result["search"] = f"stopped: time budget (before trying batch {b})"
            break
        if b not in compiled:
            if result["compiles"] >= args.max_compiles:
                result["search"] = f"stopped: {args.max_compiles} compiles (before batch {b})"
                break
            compile_at(b)
        if not fits(b):
            b_next = batch_below(b, totals(), limit - slack, n)
            print(f"[{policy}] batch {b}: plan + slack over the limit, next {b_next}", flush=True)
            b = b_next
            continue
        if params is None:
            with phase("init params + optimizer state" + label):
                params, opt_state = fresh_state()
        row, params, opt_state = run_at(b, params, opt_state)
        if not row["oom"]:
            result["max_batch"], result["max"] = b, row
            break
        b -= n
    save()
    return result


def batch_below(b: int, totals: dict, room: float, n: int) -> int:
    """The next batch to try under ``b``, whose compiled total (``totals[b]``, bytes) is over
    ``room``: along the line through ``b`` and the nearest other compiled batch, the largest
    multiple of ``n`` whose total would fit (XLA's totals grow faster than linearly at large
    batches, so a line from batch 1 overshoots there), and at least ``n`` below ``b``."""
    others = [x for x in totals if x != b]
    if not others:
        return b - n
    on_line, _ = batch_on_line(b, min(others, key=lambda x: abs(x - b)), totals, room, n)
    return b - n if on_line is None else min(b - n, on_line)


def batch_on_line(b: int, other: int, totals: dict, room: float, n: int):
    """``(batch, bytes per sequence)``: along the line through the compiled totals (bytes) at
    ``b`` and ``other``, the largest batch ``b + k n`` (k of either sign) whose total would fit
    ``room``; the batch is None where the line does not rise."""
    slope = (totals[b] - totals[other]) / (b - other)
    if slope <= 0:
        return None, slope
    return b + n * math.floor((room - totals[b]) / (slope * n)), slope


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


def run_child(
    args, policy: str, budget: float | None, phase: str = "fixed", fixed: dict | None = None
) -> dict:
    """One phase of ``policy`` in a child process (killed 300 s past ``budget``); the search
    child gets phase 1's result ``fixed`` and returns it extended."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--one", policy, "--out", out,
               "--phase", phase]  # fmt: skip
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
        env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION=str(args.mem_fraction))
        if phase == "search":  # one allocator region: freed chunks coalesce (module's Method)
            env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "true"
        timeout = None if budget is None else budget + 300  # a compile may run past the budget
        try:
            returncode = subprocess.run(cmd, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            returncode = "timeout"
        result = dict(fixed) if fixed is not None else {"policy": policy}
        if os.path.exists(out):
            with open(out) as f:
                result = json.load(f)
        result["returncode"] = returncode
        return result


def run_policy(args, policy: str, budget: float | None) -> dict:
    """Both phases of ``policy``, each in its own process (see the module's Method): the fixed
    batch, then (if there is a limit to search against and time left) the search. One result:
    the search child's, which extends the fixed one's; ``returncodes`` holds both."""
    started = time.perf_counter()
    result = run_child(args, policy, budget, "fixed")
    returncodes = {"fixed": result["returncode"]}
    if result["returncode"] == 0 and result.get("search") is None:
        left = None if budget is None else budget - (time.perf_counter() - started)
        if left is not None and left <= 0:
            result["search"] = "stopped: time budget (before the search child)"
        else:
            result = run_child(args, policy, left, "search", result)
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
    limit = first.get("device_limit_bytes")
    mesh = ", ".join(f"{k} {v}" for k, v in first.get("mesh", {}).items())
    print(
        f"\n{config['model']} ({fmt(first.get('params') and first['params'] / 1e6, '{:.4g}M')} "
        f"params), seq {config['seq_len']}, synthetic tokens, on {devices} x "
        f"{first.get('device')} (mesh {mesh or '-'}; limit "
        f"{fmt(limit and limit / 1e9, '{:.3g} GB')} per device), jax {when['jax']}, "
        f"{wall_s:.0f} s"
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
    same = lambda r: {k: r["config"].get(k, defaults.get(k)) for k in SAME}
    for p, r in zip(paths[1:], reports[1:], strict=True):
        differ = [k for k in SAME if same(r)[k] != same(reports[0])[k]]
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


def main():
    args = parse_args()
    if args.one:
        try:
            check_devices(args.fsdp)
        except ValueError as e:
            if not args.out:
                raise
            with open(args.out, "w") as f:  # the parent reports it
                json.dump({"policy": args.one, "error": str(e)}, f)
            sys.exit(2)
        fixed = None
        if args.phase == "search":
            with open(args.fixed_json) as f:
                fixed = json.load(f)
        result = measure(args, args.one, args.phase, fixed)
        print(json.dumps({k: result[k] for k in ("policy", "max_batch", "search")}))
        return
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
