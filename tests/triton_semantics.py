"""Evaluate a traced function the way Pallas Triton lowers ``max`` and ``min``.

Pallas Triton lowers ``lax.max_p`` / ``lax.min_p`` to ``arith.maxnumf`` / ``minnumf`` (IEEE
maxNum: a NaN operand loses to a number), where XLA propagates the NaN. Per-tile math that
the kernels trace and that relies on ``jnp.maximum(nan, x)`` being NaN passes every CPU test in
interpret mode and drops the NaN on the GPU (found 2026-12-04: the fused moment kernel decoded
a NaN second moment as a finite one). :func:`eval_like_triton` re-evaluates ``fn``'s jaxpr
with those two primitives replaced by ``jnp.fmax`` / ``jnp.fmin``, so a CPU test can check
that the kernels' shared math does not depend on the difference.
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core

_NAN_DROPPING = {lax.max_p: jnp.fmax, lax.min_p: jnp.fmin}


def _closed_subjaxpr(params):
    for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = params.get(name)
        if sub is not None and hasattr(sub, "jaxpr") and hasattr(sub, "consts"):
            return sub
    return None


def _eval(jaxpr, consts, *args):
    env = {}

    def read(v):
        return v.val if isinstance(v, core.Literal) else env[v]

    for var, val in zip(jaxpr.constvars, consts, strict=True):
        env[var] = val
    for var, val in zip(jaxpr.invars, args, strict=True):
        env[var] = val
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        sub = _closed_subjaxpr(eqn.params)
        if eqn.primitive in _NAN_DROPPING:
            outvals = [_NAN_DROPPING[eqn.primitive](*invals)]
        elif sub is not None:
            outvals = _eval(sub.jaxpr, sub.consts, *invals)
        else:
            out = eqn.primitive.bind(*invals, **eqn.params)
            outvals = out if eqn.primitive.multiple_results else [out]
        for var, val in zip(eqn.outvars, outvals, strict=True):
            env[var] = val
    return [read(v) for v in jaxpr.outvars]


def eval_like_triton(fn, *args):
    """``fn(*args)`` with every ``max`` / ``min`` taken as IEEE maxNum / minNum (Triton's)."""
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
    out = _eval(closed.jaxpr, closed.consts, *jax.tree.leaves(args))
    return jax.tree.unflatten(jax.tree.structure(shapes), out)
