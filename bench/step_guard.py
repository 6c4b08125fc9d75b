"""What the train step's non-finite guard costs: the step with and without it, side by side.

train.py's step skips a step whose loss or gradient norm is NaN or Inf: the optimizer update
runs under ``lax.cond`` (``coat_jax.training.step.make_train_step(skip_nonfinite=True)``).
A conditional around the update could cost memory (XLA keeping the old and the new state
apart instead of updating in place) or time (a GPU conditional reads its predicate on the
host). This compiles both steps from the same :func:`coat_jax.training.run.assemble` run and
reports XLA's compiled memory (total, temp) and the median step time of each, timed in
alternating rounds, per policy at its batch.

  PYTHONPATH=. python3 bench/step_guard.py --json bench/results/step_guard_h200_$(date +%F).json
  PYTHONPATH=. python3 bench/step_guard.py --set model.n_layers=2 --set seq_len=128 \\
      --policies coat+fp8_adamw=2        # a CPU smoke run
"""

from __future__ import annotations

import argparse
import json

import jax

from coat_jax.core import measure
from coat_jax.training import allocator, configs, planner, step
from coat_jax.training.optimizer import make_fused_update
from coat_jax.training.run import assemble

POLICY_KEYS = {
    "bf16+adamw": {"precision": "bf16", "optimizer.name": "adamw"},
    "fp8_linear+adamw": {"precision": "fp8_linear", "optimizer.name": "adamw"},
    "coat+fp8_adamw": {"precision": "coat", "optimizer.name": "fp8_adamw"},
}


def steps_of(run):
    """``{guarded: step}``: train.py's step (the guard on) and the same step without it."""
    fused = make_fused_update(run.optimizer, run.placement)
    return {
        guarded: step.make_train_step(
            run.graph,
            run.optimizer.tx,
            run.placement,
            fused_update=fused,
            compiler_options=run.model.policy().compiler_options(),
            grad_dtype=run.grad_dtype,
            skip_nonfinite=guarded,
        )  # fmt: skip
        for guarded in (False, True)
    }


def measure_policy(args, policy: str, batch: int) -> dict:
    overrides = dict(configs.parse_overrides(args.set), **POLICY_KEYS[policy], batch_size=batch)
    config = configs.load_file(args.config, overrides)
    configs.validate(config)
    run = assemble(config)
    steps = steps_of(run)
    abstract = (*run.abstract_state(), run.abstract_batch())
    row = {"policy": policy, "batch": batch, "fused_optimizer": run.fused_update}
    with jax.set_mesh(run.placement.mesh):
        for guarded, fn in steps.items():
            analysis = fn.lower(*abstract).compile().memory_analysis()
            key = "guarded" if guarded else "unguarded"
            row[f"{key}_compiled_total"] = planner.analysis_total(analysis)
            row[f"{key}_compiled_temp"] = int(analysis.temp_size_in_bytes)
        shape = run.batch_shape()
        tokens = jax.random.randint(jax.random.key(0), shape, 0, run.model.vocab_size)
        tokens = jax.device_put(tokens, run.placement.batch)
        carry = (*run.create(), None)
        times = {False: [], True: []}
        for _ in range(args.rounds):
            for guarded, fn in steps.items():
                timing, carry = measure.time_loop(
                    lambda c, fn=fn: fn(c[0], c[1], tokens), carry, warmup=1, iters=args.steps
                )
                times[guarded] += timing.times_ms
        for guarded, ms in times.items():
            key = "guarded" if guarded else "unguarded"
            row[f"{key}_step_ms"] = sorted(ms)[len(ms) // 2]
        row["skipped"] = bool(carry[2]["skipped"])
    row["time_ratio"] = row["guarded_step_ms"] / row["unguarded_step_ms"]
    row["memory_ratio"] = row["guarded_compiled_total"] / row["unguarded_compiled_total"]
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/llama2_7b.py")
    parser.add_argument("--policies", default="bf16+adamw=6,coat+fp8_adamw=12",
                        help="POLICY=BATCH,...")  # fmt: skip
    parser.add_argument("--set", action="append", default=[], help="config KEY=VALUE")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    rows = []
    for item in args.policies.split(","):
        policy, _, batch = item.partition("=")
        if policy not in POLICY_KEYS:
            parser.error(f"--policies: unknown policy {policy!r}; known: {list(POLICY_KEYS)}")
        rows.append(measure_policy(args, policy, int(batch)))
        print(json.dumps(rows[-1]), flush=True)
    gib = lambda b: f"{b / 2**30:.3f}"
    print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}, "
          f"{measure.allocator_settings()}")  # fmt: skip
    print("| policy | batch | compiled GiB off / on | temp GiB off / on | step ms off / on | "
          "time ratio |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['policy']} | {r['batch']} | {gib(r['unguarded_compiled_total'])} / "
              f"{gib(r['guarded_compiled_total'])} | {gib(r['unguarded_compiled_temp'])} / "
              f"{gib(r['guarded_compiled_temp'])} | {r['unguarded_step_ms']:.1f} / "
              f"{r['guarded_step_ms']:.1f} | {r['time_ratio']:.3f} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": jax.devices()[0].device_kind,
                    "jax": jax.__version__,
                    "allocator": measure.allocator_settings(),
                    "rows": rows,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    allocator.configure()
    main()
