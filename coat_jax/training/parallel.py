"""Placing a training run on a device mesh: sharded init, sharded batches, multi-process launch.

A run's arrays live on one ``(data, fsdp, tensor)`` mesh (:mod:`coat_jax.ops.sharding`):

* parameters by their logical axes (``embed`` over ``fsdp``, heads / MLP / vocab over
  ``tensor``), created directly in their shards (:func:`coat_jax.models.llama.init_params`);
* the FP8 optimizer state with the same leading shape as its parameter, so the update runs
  where the parameter shard is (:func:`coat_jax.ops.sharding.optimizer_specs`);
* each batch ``(grad_accum, micro_batch, seq_len + 1)`` split over ``data x fsdp`` along the
  micro-batch; every process builds only the rows its own devices hold.

Per-tensor FP8 scales (``amax`` of a sharded weight or activation) are ordinary reductions in
the jitted step, so XLA's SPMD partitioner reduces them across the devices that share the
tensor: every shard quantizes with the same scale, as on one device.

Multi-process runs (one process per host, or per GPU) call :func:`initialize_from_env` before
anything touches a device. It joins ``jax.distributed`` when launched with
``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``, or under SLURM /
Open MPI with more than one task (JAX detects those itself), and does nothing otherwise.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from coat_jax.ops import sharding

__all__ = [
    "Placement",
    "initialize_from_env",
    "make_placement",
    "repack",
    "sharded_batch",
    "with_shardings",
]


def initialize_from_env() -> bool:
    """Joins ``jax.distributed`` if this process was launched as one of several; returns
    whether it did. Call before any JAX computation."""
    env = os.environ
    if env.get("JAX_COORDINATOR_ADDRESS"):
        missing = [k for k in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID") if k not in env]
        if missing:
            raise ValueError(f"JAX_COORDINATOR_ADDRESS is set but {', '.join(missing)} is not")
        jax.distributed.initialize(
            env["JAX_COORDINATOR_ADDRESS"],
            num_processes=int(env["JAX_NUM_PROCESSES"]),
            process_id=int(env["JAX_PROCESS_ID"]),
        )
        return True
    tasks = env.get("SLURM_NTASKS") or env.get("OMPI_COMM_WORLD_SIZE") or "1"
    if int(tasks) > 1:
        jax.distributed.initialize()  # SLURM / Open MPI: JAX reads its own variables
        return True
    return False


def with_shardings(tree, shardings):
    """``tree``'s shapes and dtypes (``ShapeDtypeStruct``) with ``shardings`` (a tree like it):
    the target to restore or load arrays straight into their shards."""
    place = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
    return jax.tree.map(place, tree, shardings)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where each piece of a training run lives on ``mesh``.

    Attributes:
      mesh: the ``(data, fsdp, tensor)`` mesh.
      params: ``NamedSharding`` tree like the parameters.
      opt_state: ``NamedSharding`` tree like the optimizer state.
      batch: sharding of a batch ``(grad_accum, micro_batch, seq_len + 1)``.
      eval_batch: sharding of an eval batch ``(batch, seq_len + 1)``.
      replicated: every device holds the whole value (metrics, scalars).
    """

    mesh: Mesh
    params: Any
    opt_state: Any
    batch: NamedSharding
    eval_batch: NamedSharding
    replicated: NamedSharding

    @property
    def batch_shards(self) -> int:
        """How many ways a batch's examples are split (``data x fsdp``)."""
        return self.mesh.shape["data"] * self.mesh.shape["fsdp"]

    def abstract(self, params, opt_state):
        """Shapes and dtypes of (``params``, ``opt_state``) with this placement's shardings:
        the target a checkpoint is restored into."""
        return with_shardings(params, self.params), with_shardings(opt_state, self.opt_state)

    def init_opt_state(self, optimizer, params):
        """``optimizer.init(params)``, computed directly in its shards."""
        return jax.jit(optimizer.init, out_shardings=self.opt_state)(params)


def repack(tree):
    """``tree``'s arrays moved to the host and back, every device buffer of it freed first.

    Device memory is one pool of the allocator (BFC): an initialization that frees a large
    transient array (the fp32 weights BF16 master weights are split from) leaves a hole below
    the arrays that outlive it, and the train step's temporary buffer, one contiguous block,
    may then find no room although the free bytes add up. Written back in one pass into an
    emptied pool, the arrays lie packed from its low end. Each process copies its own shards
    (host memory: its share of ``tree``); values and shardings are unchanged. Where the host
    has less memory available than that (Linux's ``MemAvailable``, with a 10% margin), it warns
    and returns ``tree`` as it is.
    """
    leaves, treedef = jax.tree.flatten(tree)
    arrays = list({id(x): x for x in leaves if isinstance(x, jax.Array)}.values())
    counts = [len(x.addressable_shards) for x in arrays]
    shards = [s for x in arrays for s in x.addressable_shards]
    need, free = sum(s.data.nbytes for s in shards), _available_host_bytes()
    if free is not None and need > 0.9 * free:
        warnings.warn(
            f"repack skipped: {need / 2**30:.1f} GiB of arrays, {free / 2**30:.1f} GiB of host "
            "memory available; the step's temporary buffer may find no contiguous room",
            stacklevel=2,
        )
        return tree
    host = jax.device_get([s.data for s in shards])  # all copies started before any waits
    devices = [s.device for s in shards]
    for x in arrays:
        x.delete()
    placed = iter(jax.device_put(host, devices))
    rebuilt = {
        id(x): jax.make_array_from_single_device_arrays(
            x.shape, x.sharding, [next(placed) for _ in range(count)]
        )
        for x, count in zip(arrays, counts, strict=True)
    }  # fmt: skip
    rebuilt = [rebuilt.get(id(x), x) for x in leaves]
    return jax.tree.unflatten(treedef, rebuilt)


def _available_host_bytes() -> int | None:
    """The host memory available to a new allocation (``/proc/meminfo``), ``None`` if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def make_placement(mesh: Mesh, params, optimizer, rules=sharding.RULES) -> Placement:
    """The placement of ``params`` (real or abstract) and ``optimizer``'s state on ``mesh``."""
    param_specs = sharding.param_specs(mesh, params, rules)
    state = jax.eval_shape(optimizer.init, params)
    state_specs = sharding.optimizer_specs(mesh, optimizer, state, param_specs)
    batch_axes = rules["batch"]
    return Placement(
        mesh=mesh,
        params=sharding.shardings(mesh, param_specs),
        opt_state=sharding.shardings(mesh, state_specs),
        batch=NamedSharding(mesh, P(None, batch_axes, None)),
        eval_batch=NamedSharding(mesh, P(batch_axes, None)),
        replicated=NamedSharding(mesh, P()),
    )


def sharded_batch(rows_of: Callable[[np.ndarray], np.ndarray], shape, target: NamedSharding):
    """A global int32 array of ``shape`` whose flattened leading rows come from ``rows_of``.

    ``shape`` is ``(grad_accum, micro_batch, seq_len + 1)`` or ``(batch, seq_len + 1)``; row
    ``r`` of the flattened batch is example ``r``. ``rows_of(row_ids)`` returns those examples
    (``(len(row_ids), seq_len + 1)``); it is asked only for the rows this process's devices hold.
    """
    lead = shape[:-1]
    ids = np.arange(int(np.prod(lead))).reshape(lead)

    def local(index):
        wanted = ids[index[:-1]]
        return rows_of(wanted.reshape(-1)).reshape(*wanted.shape, shape[-1])[..., index[-1]]

    return jax.make_array_from_callback(tuple(shape), target, local)
