"""Meshes, logical axis rules, and partition specs for parameters AND the FP8 optimizer state.

Parameters carry logical axis names (``coat_jax.models.nn``: metadata ``logical_axes``); one rule
table maps them to mesh axes ``("data", "fsdp", "tensor")``. The FP8 optimizer state keeps its
codes in each parameter's shape and its per-group scales in ``(*lead, n_groups)``
(:class:`~coat_jax.core.adam.ScaleByFp8AdamState`), so its specs are the parameter's: codes
``P(*lead_spec, last_spec)`` and scales the same with the last axis split only where the group
count divides. Every state shard then sits on the device that holds the matching parameter and
gradient shard: the update needs no communication (tested on the compiled HLO) as long as
groups do not straddle shards, i.e. ``last_dim / group_size`` divides by the mesh axes of the
last axis (Llama: 4096 / 128 = 32 groups). Where it does not, the scales' last axis is
replicated and XLA moves data.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
    "MESH_AXES",
    "RULES",
    "constrain",
    "make_mesh",
    "optimizer_specs",
    "param_specs",
    "shardings",
]

MESH_AXES = ("data", "fsdp", "tensor")
RULES = {
    "batch": ("data", "fsdp"),
    "embed": "fsdp",
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "vocab": "tensor",
}
"""Logical axis name -> mesh axis (or axes)."""


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, devices=None) -> Mesh:
    """A ``(data, fsdp, tensor)`` mesh; one size may be -1 (the rest of the devices)."""
    devices = np.asarray(jax.devices() if devices is None else devices)
    sizes = [data, fsdp, tensor]
    if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"mesh sizes {dict(zip(MESH_AXES, sizes, strict=True))}: "
                         "positive, with at most one -1")  # fmt: skip
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if devices.size % known:
            raise ValueError(f"{devices.size} devices do not divide into mesh sizes {sizes}")
        sizes[sizes.index(-1)] = devices.size // known
    if math.prod(sizes) != devices.size:
        raise ValueError(f"mesh {sizes} needs {math.prod(sizes)} devices, have {devices.size}")
    return Mesh(devices.reshape(sizes), MESH_AXES)


def constrain(x: jax.Array, logical_axes, rules=RULES) -> jax.Array:
    """Pins ``x``'s sharding by logical axis names (``None``: replicated) when traced under a
    mesh (``jax.set_mesh``); without one it returns ``x`` unchanged."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    dims = zip(logical_axes, x.shape, strict=True)
    return jax.lax.with_sharding_constraint(x, P(*(fits(mesh, rules.get(a), n) for a, n in dims)))


def fits(mesh, axis, size: int):
    """``axis`` if ``size`` divides evenly over it, else ``None`` (replicated): the rule by which
    parameters, activations and the FP8 state's group axes are split."""
    if axis is None:
        return None
    names = axis if isinstance(axis, tuple) else (axis,)
    return axis if size % math.prod(mesh.shape[n] for n in names) == 0 else None


def param_specs(mesh: Mesh, params: nnx.State, rules=RULES):
    """A tree like ``params`` of ``PartitionSpec`` from each Param's ``logical_axes``."""

    def spec(variable):
        axes = variable.get_metadata().get("logical_axes") or (None,) * variable.ndim
        dims = zip(axes, variable.shape, strict=True)
        return variable.replace(P(*(fits(mesh, rules.get(a), n) for a, n in dims)))

    return jax.tree.map(spec, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def optimizer_specs(mesh: Mesh, optimizer, opt_state, specs):
    """Specs for ``opt_state`` from the parameters' ``specs`` (see module docstring): a state
    leaf of its parameter's rank takes the parameter's spec, each axis split only where its
    own size divides (the FP8 codes exactly as the parameter; the per-group scales with the
    grouped last axis where the group count divides); anything else is replicated."""

    def follow(leaf, spec):
        if getattr(leaf, "ndim", 0) != len(spec) or not len(spec):
            return P()
        return P(*(fits(mesh, a, n) for a, n in zip(spec, leaf.shape, strict=True)))

    return optax.tree_utils.tree_map_params(
        optimizer, follow, opt_state, specs, transform_non_params=lambda _: P()
    )


def shardings(mesh: Mesh, specs):
    """``NamedSharding`` for every ``PartitionSpec`` in ``specs``."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
