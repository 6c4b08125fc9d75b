"""What a compiled train step holds at its memory peak, buffer by buffer (nothing runs).

  PYTHONPATH=. python3 bench/peak_buffers.py --config configs/llama2_7b.py \\
      --set batch_size=1 --set optimizer.update_in_backward=True --set grad_dtype=bfloat16 \\
      --json bench/results/peak_llama2_7b_inbwd_h200_$(date +%F).json

The step is the trainer's own (``coat_jax.training.run.assemble``, lowered on abstract inputs
as the planner does) compiled once with XLA's dumps on (``--xla_dump_to``, text only for the
step's module). XLA writes its buffer live ranges beside the optimized module
(``*-live-range.txt``: the schedule, each buffer's first and last position, and the buffers
live at the peak); this script reads the peak's list and names each buffer by the HLO
instruction that defines it:

* ``argument``: an input of the step (parameters, optimizer state, batch), live throughout;
* otherwise the category of ``bench/profile_step.py`` (FP8 GEMM, Pallas / Triton kernel, FP8
  quantize fusion, ...), with ``backward`` or ``forward / update`` from the instruction's JAX
  source (``transpose(jvp(...))`` in its ``op_name`` is the backward pass; copies XLA inserts
  have no source op).

Printed and written (``--json``): where in the schedule the peak falls, XLA's memory analysis
beside it, bytes at the peak by category and pass, and the ``--top`` largest buffers with
their shapes and source ops. The live-range file's peak can fall far short of the memory
analysis' total (Llama-2-7B at batch 24 with the dequantization barriers, H200, 2026-12-02:
44.67 vs 113.36 GB, while train.py's measured peaks followed the totals): the report then says
so (``live_range_peak_short``) and its buffer list is not the step's peak. This is how to
tell, on the device that matters, whether a step's peak holds every gradient at once, a copy
of the parameters, or activations.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import glob
import json
import os
import re
import tempfile

from profile_step import INSTRUCTION, add_config_args, hlo_categories, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEAK = re.compile(r"^\s*Live ranges at (\d+) \(peak\):\s*$")
LIVE = re.compile(r"^\s*([\w.\-]+)(\{[^}]*\}): (\d+) bytes")
SEQUENCE = re.compile(r"^\s*(\d+):([\w.\-]+)\s*$")
OP_NAME = re.compile(r'op_name="([^"]*)"')
LIVE_RANGE_TRUST = 0.9
"""Below this fraction of the memory analysis' total the live-range peak is reported as short."""


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_config_args(parser)
    parser.add_argument("--top", type=int, default=25, help="largest buffers listed")
    parser.add_argument("--dump_dir", help="keep XLA's dump here (default: a temp dir)")
    parser.add_argument("--json")
    return parser.parse_args(argv)


def parse_live_ranges(text: str) -> dict:
    """``{"peak_position", "positions", "buffers": [(name, shape index, bytes)]}`` from XLA's
    ``*-live-range.txt``; ``ValueError`` when the file has no peak section."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if PEAK.match(line)), None)
    if start is None:
        raise ValueError("the live-range dump has no 'Live ranges at N (peak)' section")
    buffers = []
    for line in lines[start + 1 :]:
        m = LIVE.match(line)
        if not m:
            break
        buffers.append((m.group(1), m.group(2), int(m.group(3))))
    positions = sum(1 for line in lines if SEQUENCE.match(line))
    return {"peak_position": int(PEAK.match(lines[start]).group(1)), "positions": positions,
            "buffers": buffers}  # fmt: skip


def describe_instructions(hlo_text: str) -> dict[str, dict]:
    """``{name: {"opcode", "shape", "category", "pass", "op_name"}}`` for every instruction of
    an optimized HLO module's text."""
    categories = hlo_categories(hlo_text)
    out = {}
    for line in hlo_text.splitlines():
        m = INSTRUCTION.match(line)
        if not m:
            continue
        name, out_type, opcode, rest = m.groups()
        op_name = OP_NAME.search(rest)
        op_name = op_name.group(1) if op_name else ""
        category = "argument" if opcode == "parameter" else categories.get(name, "other")
        out[name] = {"opcode": opcode, "shape": out_type, "category": category,
                     "pass": _pass_of(opcode, op_name), "op_name": op_name}  # fmt: skip
    return out


def _pass_of(opcode: str, op_name: str) -> str:
    if opcode == "parameter":
        return "input"
    if "transpose(" in op_name:
        return "backward"
    return "forward / update" if op_name else "no source op (XLA's)"


def peak_report(live: dict, instructions: dict[str, dict], top: int) -> dict:
    """Bytes at the peak by ``(category, pass)`` and the ``top`` largest buffers."""
    by_kind = collections.Counter()
    rows = []
    for name, index, size in live["buffers"]:
        info = instructions.get(name, {"opcode": "?", "shape": "?", "category": "unknown",
                                       "pass": "unknown", "op_name": ""})  # fmt: skip
        by_kind[f"{info['category']} | {info['pass']}"] += size
        rows.append({"buffer": name + index, "bytes": size, **info})
    rows.sort(key=lambda r: -r["bytes"])
    return {
        "peak_position": live["peak_position"],
        "schedule_length": live["positions"],
        "peak_bytes": sum(size for _, _, size in live["buffers"]),
        "by_kind": dict(by_kind.most_common()),
        "largest": rows[:top],
    }


def _dumped(dump_dir: str, suffix: str) -> list[str]:
    return sorted(glob.glob(os.path.join(dump_dir, f"*{suffix}")), key=os.path.getsize)


def main(argv=None):
    args = parse_args(argv)
    dump_dir = args.dump_dir or tempfile.mkdtemp(prefix="peak_buffers_")
    # XLA reads XLA_FLAGS when JAX's backend starts (the first compile or device query), not
    # when jax is imported: set them before anything here touches a device
    flags = (f"--xla_dump_to={dump_dir} --xla_dump_hlo_as_text "
             "--xla_dump_hlo_module_re=.*step.*")  # fmt: skip
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()
    import jax

    # an executable from JAX's persistent cache is loaded, not compiled: XLA would dump nothing
    jax.config.update("jax_enable_compilation_cache", False)

    from coat_jax.core import measure
    from coat_jax.training import allocator, planner
    from coat_jax.training.run import assemble

    allocator.configure()
    run = assemble(load_config(args.config, args.set))
    analysis = planner._compiled(run, None).memory_analysis()
    live_files = _dumped(dump_dir, "-live-range.txt")
    if not live_files:
        raise SystemExit(f"peak_buffers: XLA wrote no *-live-range.txt under {dump_dir}")
    live_file = live_files[-1]  # the train step: the largest module compiled
    hlo_file = live_file.replace("-live-range.txt", ".txt")
    with open(live_file) as f:
        live = parse_live_ranges(f.read())
    with open(hlo_file) as f:
        instructions = describe_instructions(f.read())
    report = peak_report(live, instructions, args.top)
    result = {
        "date": datetime.date.today().isoformat(),
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "config": os.path.relpath(args.config, ROOT),
        "set": args.set,
        "allocator": measure.allocator_settings(),
        "memory_analysis": {
            "arguments": int(analysis.argument_size_in_bytes),
            "outputs": int(analysis.output_size_in_bytes),
            "aliased": int(analysis.alias_size_in_bytes),
            "temp": int(analysis.temp_size_in_bytes),
            "total": planner.analysis_total(analysis),
        },  # fmt: skip
        "dump": live_file,
        **report,
    }
    result["live_range_peak_short"] = report["peak_bytes"] < LIVE_RANGE_TRUST * (
        result["memory_analysis"]["total"])
    gb = lambda b: f"{b / 1e9:.2f}" if b >= 1e8 else f"{b / 1e9:.2g}"
    print(f"{result['config']} {' '.join(args.set)} on {result['device']}, jax {result['jax']}")
    print(f"peak at schedule position {report['peak_position']} of {report['schedule_length']}: "
          f"{gb(report['peak_bytes'])} GB live (XLA's memory analysis: total "
          f"{gb(result['memory_analysis']['total'])} GB, temp "
          f"{gb(result['memory_analysis']['temp'])} GB)")  # fmt: skip
    if result["live_range_peak_short"]:
        print(f"WARNING: the live-range peak is under {LIVE_RANGE_TRUST:.0%} of XLA's total: "
              "the buffers below are not the step's peak; trust the total")  # fmt: skip
    print("| category | pass | GB at the peak |\n|---|---|---|")
    for kind, size in report["by_kind"].items():
        category, _, where = kind.partition(" | ")
        print(f"| {category} | {where} | {gb(size)} |")
    print("| GB | buffer | opcode | shape | source op |\n|---|---|---|---|---|")
    for r in report["largest"]:
        print(f"| {gb(r['bytes'])} | {r['buffer']} | {r['opcode']} | {r['shape'][:40]} | "
              f"{r['op_name'][-70:]} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print("wrote", args.json)


if __name__ == "__main__":
    main()
