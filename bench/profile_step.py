"""Where a train step's time goes: a device trace of ``train.py``'s step, by category.

  PYTHONPATH=. python3 bench/profile_step.py \\
      --config configs/llama2_7b.py --set precision=coat --set optimizer.name=fp8_adamw \\
      --set batch_size=1 --json bench/results/profile_llama2_7b_coat_h200_$(date +%F).json
  # a sharded step: --set mesh.data=1 --set mesh.fsdp=2 --set batch_size=2

The step is the trainer's own (``coat_jax.training.run.assemble``: the same model, mesh,
shardings and optimizer path, under train.py's allocator), compiled ahead of time so that its
HLO names every op; after ``--warmup`` steps, ``--steps`` steps run under
``jax.profiler.trace`` (a Perfetto trace), timed by ``coat_jax.core.measure``.
Each device op of the trace is put in one category by the HLO instruction it ran:

* ``GEMM, FP8 (cuBLASLt)`` / ``GEMM (cuBLAS)`` / ``GEMM (Triton)``: the matrix products;
* ``attention (cuDNN)``: fused attention custom calls;
* ``Pallas / Triton kernel``: our kernels (``mosaic_gpu`` / Triton custom calls);
* ``communication``: all-gather, all-reduce, reduce-scatter, collective-permute, all-to-all;
* ``FP8 quantize (fusion)``: fusions that write FP8 (scales, casts: the precision flow's cost);
* ``fusion reading FP8``: fusions with an FP8 operand that write none (dequantize and friends);
* ``elementwise / reduction (fusion)``, ``copy / transpose``, ``other``.

Printed and written (``--json``): per category ms per step and share of the device time, the
communication by collective and element type (``all-gather f8e4m3fn``: an FP8 weight gather), the
top kernels, the step's wall time (median) next to the device time, how many kernels a step runs
and how long the device sits idle between them inside a step (``timeline``: what a step of
many small kernels loses to launches), and the trace's process and thread names (so an
unexpected trace layout shows); ``--hlo`` writes the compiled step's HLO text,
in which each traced op name is an instruction (its fusion's body). The trace folder is kept
(``--trace_dir``) for Perfetto / TensorBoard. CUDA graphs (XLA's command buffers) are turned off so
that every kernel keeps its HLO name (docs/bench-methods.md). On a CPU the trace has no device ops:
the script says so and still reports compile and step times (the point there is that it cannot rot).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import glob
import gzip
import itertools
import json
import os
import re
import statistics
import time

import jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")
FP8_TYPE = re.compile(r"\bf8e\w+\[")
LAYOUT = re.compile(r"\{[^{}]*\}")
EMITTER = re.compile(r'"kind":"(\w+)"')  # a kCustom fusion's emitter, in its backend_config
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")


def add_config_args(parser) -> None:
    """``--config`` (default: Llama-2-7B) and ``--set`` overrides, read by :func:`load_config`:
    the trainer's step the step benches build."""
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "llama2_7b.py"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override, e.g. precision=coat (repeatable)")  # fmt: skip


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_config_args(parser)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="steps traced")
    parser.add_argument("--top", type=int, default=15, help="kernels listed")
    parser.add_argument("--trace_dir", default=os.path.join("runs", "profile"))
    parser.add_argument("--json")
    parser.add_argument("--hlo", help="write the compiled step's HLO text here (gzip if *.gz): "
                        "what each traced op name runs")  # fmt: skip
    args = parser.parse_args(argv)
    for flag, path in (("--json", args.json), ("--hlo", args.hlo)):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            parser.error(f"{flag} {path}: no such directory")  # before the minutes of compiling
    return args


def random_batch(run, seed: int = 0):
    """One batch of random tokens of the trainer's batch shape, placed as its step takes it."""
    shape, vocab = run.batch_shape(), run.model.vocab_size
    tokens = jax.random.randint(jax.random.key(seed), shape, 0, vocab)
    return jax.device_put(tokens, run.placement.batch)


def load_config(path: str, sets: list[str]):
    from coat_jax.training import configs

    config = configs.load_file(path, configs.parse_overrides(sets))
    configs.validate(config)
    return config


# --------------------------------------------------------------------------------------------
# HLO: one category per instruction name.


def hlo_categories(hlo_text: str) -> dict[str, str]:
    """``{instruction name: category}`` for every instruction of a compiled HLO module's text
    (names as the profiler reports them, without ``%``)."""
    parsed = _instructions(hlo_text)
    types = {name: out_type for name, out_type, _, _ in parsed}
    categories = {}
    for name, out_type, opcode, rest in parsed:
        categories[name] = _category(out_type, opcode, rest, types)
    return categories


def hlo_signatures(hlo_text: str) -> dict[str, str]:
    """``{instruction name: signature}``: its category, opcode, fusion kind or custom-call
    target and output type without layouts (``GEMM (Triton) | fusion __triton_gemm |
    bf16[8192,4096]``), so that a step's ops sum by what they are rather than by their
    per-layer names (:func:`summarize`'s ``top_signatures``)."""
    parsed = _instructions(hlo_text)
    types = {name: out_type for name, out_type, _, _ in parsed}
    signatures = {}
    for name, out_type, opcode, rest in parsed:
        kind = (re.search(r'custom_call_target="([^"]+)"', rest) or EMITTER.search(rest)
                or re.search(r"\bkind=(\w+)", rest))  # fmt: skip
        shape = LAYOUT.sub("", out_type)
        what = f"{opcode} {kind.group(1)}" if kind else opcode
        signatures[name] = f"{_category(out_type, opcode, rest, types)} | {what} | {shape}"
    return signatures


def collective_kinds(hlo_text: str) -> dict[str, str]:
    """``{instruction name: "<collective> <element type>"}`` for the collectives of a compiled
    HLO module (``all-gather f8e4m3fn``, ``reduce-scatter f32``, ...): which communication an
    FP8 policy changed."""
    kinds = {}
    for name, out_type, opcode, _ in _instructions(hlo_text):
        base = _collective(opcode)
        if base:
            dtype = re.search(r"\b(\w+)\[", out_type)
            kinds[name] = f"{base} {dtype.group(1)}" if dtype else base
    return kinds


def _instructions(hlo_text: str) -> list[tuple[str, str, str, str]]:
    """``(name, output type, opcode, rest of the line)`` of each instruction line."""
    return [m.groups() for m in map(INSTRUCTION.match, hlo_text.splitlines()) if m]


def _collective(opcode: str) -> str | None:
    """The collective an opcode runs (its async ``-start`` / ``-done`` halves included)."""
    base = opcode.removesuffix("-start").removesuffix("-done")
    return base if base in COLLECTIVES else None


def _collective_kind(name: str, kinds: dict[str, str]) -> str:
    """A traced collective's kind: its HLO instruction's (``kinds``), else the collective its
    name starts with (element type unknown: on an H200 the async gathers and reduce-scatters
    are traced under names the compiled module's text does not hold), else ``other``."""
    if name in kinds:
        return kinds[name]
    return next((c for c in COLLECTIVES if name.startswith(c)), "other")


def _category(out_type: str, opcode: str, rest: str, types: dict[str, str]) -> str:
    if _collective(opcode):
        return "communication"
    target = re.search(r'custom_call_target="([^"]+)"', rest)
    target = target.group(1).lower() if target else ""
    if opcode == "custom-call":
        if "cublas" in target:
            return "GEMM, FP8 (cuBLASLt)" if "f8" in target else "GEMM (cuBLAS)"
        if "cudnn" in target and any(k in target for k in ("fmha", "flash", "sdpa", "attn")):
            return "attention (cuDNN)"
        if any(k in target for k in ("mosaic", "triton", "pallas")):
            return "Pallas / Triton kernel"
        return "other"
    if opcode == "fusion":
        custom = EMITTER.search(rest)
        if custom and "gemm" in custom.group(1):  # __triton_gemm, __triton_nested_gemm_fusion
            return "GEMM (Triton)"  # (plain __triton fusions are XLA's Triton reductions)
        if FP8_TYPE.search(out_type):
            return "FP8 quantize (fusion)"
        operands = re.findall(r"%([\w.\-]+)", rest.split("),")[0])
        if any(FP8_TYPE.search(types.get(o, "")) for o in operands):
            return "fusion reading FP8"
        return "elementwise / reduction (fusion)"
    if opcode in ("copy", "transpose"):
        return "copy / transpose"
    return "other"


# --------------------------------------------------------------------------------------------
# The trace: device ops, summed by category.


def _load_trace(trace_dir: str) -> list[dict]:
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))
    files = files or sorted(
        glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    )
    if not files:
        return []
    with gzip.open(files[-1]) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def device_ops(events: list[dict]) -> tuple[list[tuple[str, float, int, float]], dict]:
    """``([(op name, microseconds, device pid, start in microseconds)], layout)`` from a
    trace's events: complete events of device processes (``/device:GPU:n``...), from the
    thread that names XLA ops when there is one (else every thread: CUDA streams), so that
    nothing is counted twice. ``layout`` lists processes and threads with their event counts."""
    procs = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}  # fmt: skip
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}  # fmt: skip
    counts = collections.Counter((e.get("pid"), e.get("tid")) for e in events if e.get("ph") == "X")
    layout = {
        procs.get(pid, str(pid)): {threads.get((pid, tid), str(tid)): n
                                   for (p, tid), n in counts.items() if p == pid}
        for pid in {p for p, _ in counts}
    }  # fmt: skip
    device_pids = {pid for pid, name in procs.items() if "/device:" in name.lower()}
    ops_threads = {key for key, name in threads.items()
                   if key[0] in device_pids and "xla ops" in name.lower()}  # fmt: skip
    out = []
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in device_pids:
            continue
        key = (e["pid"], e.get("tid"))
        pid_has_ops = any(k[0] == e["pid"] for k in ops_threads)
        if pid_has_ops and key not in ops_threads:
            continue
        name = (e.get("args") or {}).get("hlo_op") or e.get("name", "")
        out.append((name.lstrip("%"), float(e.get("dur", 0.0)), e["pid"], float(e.get("ts", 0.0))))
    return out, layout


def timeline(ops, steps: int) -> dict:
    """How busy each device is inside a step, from :func:`device_ops`' start times.

    ``measure.time_loop`` waits for the device after every step, so a device's ops fall in
    ``steps`` bursts: they are split at the ``steps - 1`` widest idle gaps. Per step, ``span``
    runs from its first op's start to its last op's end and ``busy`` is the union of its ops'
    intervals; ``span - busy`` is time the device sat idle between kernels inside the step
    (launch latency, the host enqueuing slower than the kernels run: what a step of many small
    kernels loses). Medians over steps, averaged over devices, in ms; ``kernels_per_step`` the
    ops a step. Empty for a trace without device ops (a CPU)."""
    by_device = collections.defaultdict(list)
    for _, us, pid, start in ops:
        by_device[pid].append((start, start + us))
    rows = []
    for intervals in by_device.values():
        intervals.sort()
        gaps, reach = [], intervals[0][1]  # idle gap before op i (i >= 1); the union's end
        for i, (start, end) in enumerate(intervals[1:], 1):
            gaps.append((start - reach, i))
            reach = max(reach, end)
        cuts = sorted(i for _, i in sorted(gaps, reverse=True)[: max(steps - 1, 0)])
        bounds = [0, *cuts, len(intervals)]
        per_step = []
        for lo, hi in itertools.pairwise(bounds):
            busy, reach = 0.0, float("-inf")
            for start, end in intervals[lo:hi]:
                busy += max(end - max(start, reach), 0.0)
                reach = max(reach, end)
            per_step.append((hi - lo, reach - intervals[lo][0], busy))
        rows.append([statistics.median(column) for column in zip(*per_step, strict=True)])
    if not rows:
        return {}
    kernels, span, busy = (sum(column) / len(rows) for column in zip(*rows, strict=True))
    return {"kernels_per_step": kernels, "span_ms": span / 1e3, "busy_ms": busy / 1e3,
            "idle_in_step_ms": (span - busy) / 1e3}  # fmt: skip


def _fallback_category(name: str) -> str:
    low = name.lower()
    if "nccl" in low or any(c in low for c in COLLECTIVES):
        return "communication"
    if any(k in low for k in ("gemm", "xmma", "cutlass", "cublas", "matmul")):
        return "GEMM, FP8 (cuBLASLt)" if any(k in low for k in ("e4m3", "e5m2", "fp8")) else (
            "GEMM (cuBLAS)")  # fmt: skip
    if any(k in low for k in ("flash", "fmha", "cudnn")):
        return "attention (cuDNN)"
    if any(k in low for k in ("mosaic", "triton", "pallas")):
        return "Pallas / Triton kernel"
    return "other"


def summarize(ops, categories: dict[str, str], steps: int, top: int, kinds=None,
              signatures=None) -> dict:  # fmt: skip
    """Per category: ms per step (summed over devices, divided by their number) and share;
    the ``top`` op names by total time; the ``top`` signatures (:func:`hlo_signatures`) by
    total time with their ops per step; ms per step of each collective kind (``kinds``, from
    :func:`collective_kinds`). ``categories`` maps HLO names (unknown names fall back to
    kernel-name patterns)."""
    devices = max(len({op[2] for op in ops}), 1)
    per_cat, per_op, per_kind = collections.Counter(), collections.Counter(), collections.Counter()
    per_sig, sig_count = collections.Counter(), collections.Counter()
    cat_of, kinds, signatures = {}, kinds or {}, signatures or {}
    for name, us, *_ in ops:
        cat = categories.get(name) or _fallback_category(name)
        cat_of[name] = cat
        per_cat[cat] += us
        per_op[name] += us
        sig = signatures.get(name, f"{cat} | {name}")
        per_sig[sig] += us
        sig_count[sig] += 1
        if cat == "communication":
            per_kind[_collective_kind(name, kinds)] += us
    total = sum(per_cat.values())
    scale = 1e-3 / (steps * devices)  # microseconds over all steps and devices -> ms per step
    return {
        "device_ms_per_step": total * scale,
        "trace_devices": devices,
        "categories": {
            cat: {"ms_per_step": us * scale, "share": us / total if total else 0.0}
            for cat, us in per_cat.most_common()
        },  # fmt: skip
        "top_ops": [
            {"name": n, "category": cat_of[n], "ms_per_step": us * scale}
            for n, us in per_op.most_common(top)
        ],  # fmt: skip
        "top_signatures": [
            {"signature": sig, "ops_per_step": sig_count[sig] / (steps * devices),
             "ms_per_step": us * scale}
            for sig, us in per_sig.most_common(top)
        ],  # fmt: skip
        "communication_ms_per_step": {k: us * scale for k, us in per_kind.most_common()},
    }


# --------------------------------------------------------------------------------------------


def main(argv=None):
    args = parse_args(argv)
    # XLA GPU records a step's kernels as CUDA graphs ("command buffers"): the trace then shows
    # one op per graph, with no HLO name to categorise. Off for profiling (set before the
    # backend starts; an explicit --xla_gpu_enable_command_buffer in XLA_FLAGS wins).
    if "xla_gpu_enable_command_buffer" not in os.environ.get("XLA_FLAGS", ""):
        flags = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="
        os.environ["XLA_FLAGS"] = flags.strip()
    from coat_jax.core import measure
    from coat_jax.training import allocator, metrics
    from coat_jax.training.run import assemble

    allocator.configure()  # train.py's allocator, unless the environment sets one
    config = load_config(args.config, args.set)
    run = assemble(config)
    devices = list(run.placement.mesh.devices.flat)
    result = {"date": datetime.date.today().isoformat(), "device": devices[0].device_kind,
              "devices": len(devices), "jax": jax.__version__, "config": args.config,
              "set": args.set, "mesh": dict(run.placement.mesh.shape),
              "params": run.model.num_params(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "allocator": measure.allocator_settings(),
              "gemm_backend": config.fp8.gemm}  # fmt: skip
    with jax.set_mesh(run.placement.mesh):
        started = time.perf_counter()
        params, opt_state = run.create()
        batch = random_batch(run)
        result["init_s"] = time.perf_counter() - started
        started = time.perf_counter()
        compiled = run.loop_step.lower(params, opt_state, batch).compile()  # train.py's call
        result["compile_s"] = time.perf_counter() - started
        print(f"compiled in {result['compile_s']:.0f} s", flush=True)
        hlo = compiled.as_text()
        if args.hlo:
            with (gzip.open if args.hlo.endswith(".gz") else open)(args.hlo, "wt") as f:
                f.write(hlo)
        categories, kinds = hlo_categories(hlo), collective_kinds(hlo)
        signatures = hlo_signatures(hlo)
        step = lambda carry: compiled(carry[0], batch)
        carry = (run.loop_step.flatten(params, opt_state), None)
        for _ in range(args.warmup):  # untimed, outside the trace
            carry = jax.block_until_ready(step(carry))
        with jax.profiler.trace(args.trace_dir, create_perfetto_trace=True):
            timing, _ = measure.time_loop(step, carry, warmup=0, iters=args.steps)
    peaks = [measure.device_memory([d]).peak for d in devices]
    result["peak_bytes_per_device"] = peaks  # None on a CPU
    result["step_ms_median"] = timing.median_ms
    result["tokens_per_s"] = config.batch_size * config.seq_len / (timing.median_ms / 1e3)
    mfu = metrics.mfu(run.model, config.seq_len, result["tokens_per_s"], len(devices),
                      config.peak_tflops)  # fmt: skip
    if mfu is not None:
        result["mfu"] = mfu
    ops, layout = device_ops(_load_trace(args.trace_dir))
    result["trace_layout"] = layout
    result["hlo_instructions"] = len(categories)
    result.update(summarize(ops, categories, args.steps, args.top, kinds, signatures))
    result["timeline"] = timeline(ops, args.steps)

    print(f"\n{result['device']} x {result['devices']}, mesh {result['mesh']}, "
          f"{result['params'] / 1e6:.0f}M params, {' '.join(args.set)}")  # fmt: skip
    print(
        f"step {result['step_ms_median']:.1f} ms (wall, median of {args.steps}), device "
        f"{result['device_ms_per_step']:.1f} ms per device; compile {result['compile_s']:.0f} s"
    )
    if result["timeline"]:
        t = result["timeline"]
        print(f"inside a step: {t['kernels_per_step']:.0f} kernels; the device busy "
              f"{t['busy_ms']:.1f} of {t['span_ms']:.1f} ms from its first kernel to its last "
              f"(idle between kernels {t['idle_in_step_ms']:.1f} ms)")  # fmt: skip
    if all(peaks):
        print(f"peak memory per device: {', '.join(f'{p / 1e9:.1f} GB' for p in peaks)}")
    if not ops:
        print("no device ops in the trace (a CPU run, or an unexpected layout):", layout)
    else:
        print("| category | ms / step | share |\n|---|---|---|")
        for cat, v in result["categories"].items():
            print(f"| {cat} | {v['ms_per_step']:.2f} | {v['share']:.1%} |")
        if result["communication_ms_per_step"]:
            print("\n| collective | ms / step |\n|---|---|")
            for kind, ms in result["communication_ms_per_step"].items():
                print(f"| {kind} | {ms:.2f} |")
        print("\n| op signature (category, op, output) | ops / step | ms / step |\n|---|---|---|")
        for sig in result["top_signatures"]:
            print(f"| {sig['signature']} | {sig['ops_per_step']:g} | {sig['ms_per_step']:.2f} |")
        print("\n| top op | category | ms / step |\n|---|---|---|")
        for op in result["top_ops"][:5]:
            print(f"| {op['name']} | {op['category']} | {op['ms_per_step']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
