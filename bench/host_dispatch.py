"""Whether a train step is bound by the host: how long the trainer's jitted step takes to return
(the host enqueuing its kernels) beside how long it takes to finish, per policy.

  PYTHONPATH=. python3 bench/host_dispatch.py --config configs/llama_114m.py \
      [--policies coat+fp8_adamw,bf16+adamw] [--set KEY=VALUE ...] [--json out.json]

The step is ``train.py``'s own (``coat_jax.training.run.assemble``), with XLA's flags as given
(none changed, unlike ``bench/profile_step.py``, which turns command buffers off to trace).
Per step, after ``--warmup`` steps: ``dispatch`` is the time from the call to its return with
the device idle before it; ``step`` the time to the step's results. Under ``train.py``'s loop
(which reads step ``n - 1``'s metrics after enqueuing step ``n``) a step takes about
``max(dispatch, device time)``: where ``dispatch`` is near ``step``, the host binds and fewer or
cheaper launches, not faster kernels, would speed it up. Medians of ``--steps``. ``loop`` is
the mean time a step of ``--loop_steps`` back to back in that pattern (nothing else in the
loop: no batch assembly, logging or progress bar), so ``train.py``'s ``step_ms`` above it is
its loop's own work. ``--flat`` adds a row per policy with the step ``train.py`` calls
(``Run.loop_step``: the same computation on the flat list of the state's arrays) beside the
tree step (``Run.train_step``): what flax NNX's Python pytree nodes cost the call.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import jax
from profile_step import add_config_args, load_config, random_batch


def time_policy(config_path: str, sets: list[str], warmup: int, steps: int,
                flat: bool = False, loop_steps: int = 20) -> dict:  # fmt: skip
    from coat_jax.training.run import assemble
    from coat_jax.training.step import NonFiniteSteps

    run = assemble(load_config(config_path, sets))
    with jax.set_mesh(run.placement.mesh):
        state, batch = run.create(), random_batch(run)

        def call(state):
            *state, metrics = run.train_step(*state, batch)
            return state, metrics

        if flat:
            state = run.loop_step.flatten(*state)
            call = lambda leaves: run.loop_step(leaves, batch)
        dispatch, total = [], []
        for i in range(warmup + steps):
            jax.block_until_ready(state)
            started = time.perf_counter()
            state, m = call(state)
            returned = time.perf_counter()
            jax.block_until_ready(m)
            if i >= warmup:
                dispatch.append(returned - started)
                total.append(time.perf_counter() - started)
        jax.block_until_ready(state)
        nonfinite = NonFiniteSteps(run.config.skip_nonfinite)
        started = time.perf_counter()
        for i in range(loop_steps):  # train.py's pattern: read step n - 1 after enqueuing n
            state, m = call(state)
            nonfinite.record(i, m)
        nonfinite.flush()
        jax.block_until_ready(state)
        loop = (time.perf_counter() - started) / loop_steps
    return {"dispatch_ms": statistics.median(dispatch) * 1e3,
            "step_ms": statistics.median(total) * 1e3,
            "loop_ms": loop * 1e3,
            "state_leaves": len(jax.tree.leaves(state))}  # fmt: skip


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_config_args(parser)
    parser.add_argument("--policies", default="coat+fp8_adamw,bf16+adamw",
                        help="comma-separated precision+optimizer pairs")  # fmt: skip
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--loop_steps", type=int, default=20,
                        help="steps back to back for the loop column")  # fmt: skip
    parser.add_argument("--flat", action="store_true",
                        help="also time train.py's step, on the flat list of the arrays")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    policies = [p.split("+") for p in args.policies.split(",")]
    if any(len(p) != 2 for p in policies):
        parser.error(f"--policies {args.policies!r}: expected precision+optimizer[,...]")
    rows = []
    for precision, optimizer in policies:
        sets = [*args.set, f"precision={precision}", f"optimizer.name={optimizer}"]
        for flat in (False, True) if args.flat else (False,):
            row = {"policy": f"{precision}+{optimizer}" + (" (flat arrays)" if flat else ""),
                   **time_policy(args.config, sets, args.warmup, args.steps, flat,
                                  args.loop_steps)}  # fmt: skip
            rows.append(row)
            print(f"  {row}", flush=True)
    device = jax.devices()[0]
    print(f"\n{args.config} {' '.join(args.set)}, {device.device_kind}, jax {jax.__version__}")
    print("| policy | host dispatch ms | step ms (dispatch to results) | dispatch / step | "
          "loop ms a step | state leaves |\n|---|---|---|---|---|---|")  # fmt: skip
    for r in rows:
        print(f"| {r['policy']} | {r['dispatch_ms']:.2f} | {r['step_ms']:.2f} | "
              f"{r['dispatch_ms'] / r['step_ms']:.0%} | {r['loop_ms']:.2f} | "
              f"{r['state_leaves']} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": datetime.date.today().isoformat(), "device": device.device_kind,
                       "jax": jax.__version__, "config": args.config, "set": args.set,
                       "rows": rows}, f, indent=2)  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
