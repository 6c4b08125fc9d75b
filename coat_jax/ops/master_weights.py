r"""Master weights as BF16 parameters plus a remainder in the optimizer state.

:func:`master_weights` wraps any optax transformation so that the parameters a model holds
and reads are BF16 and the fp32 master weight lives on as ``bf16 part + remainder``
(:mod:`coat_jax.core.master`): 16 remainder bits rebuild the fp32 weight exactly (training is
bit-identical to fp32 master weights whose forward reads ``bf16_part(w)``), 8 bits within
2^-15 relative. Per parameter: 2 + 2 (or 1) bytes instead of 4, and the gradients come out
BF16 since the model differentiates BF16 weights.

Each step rebuilds the fp32 weights, runs the inner transformation on them and
``optax.apply_updates`` in fp32, and splits the result again (:func:`apply_exactly`). Inside a
trainer that owns the step (``train.py``: ``config.optimizer.master_weights``), the split
result *is* the new parameters. As an optax transformation, ``update`` returns
``bf16(new) - params`` in fp32, which ``optax.apply_updates`` adds back to the same BF16
values, except where a weight shrinks by more than 2^16x in one step (the difference then
rounds in fp32): the remainder kept refers to the intended BF16 value.

Usage as an optax optimizer::

    opt = master_weights(coat_jax.fp8_adamw(1e-3), bits=16)
    state = opt.init(params)            # fp32 params: their remainders are kept
    params = to_bf16_parts(params)      # what the model holds from now on
    updates, state = opt.update(grads, state, params)
    params = optax.apply_updates(params, updates)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from coat_jax.core import master

__all__ = [
    "MasterWeightsState",
    "apply_exactly",
    "init_from_parts",
    "join_tree",
    "master_weights",
    "split_leaf_by_leaf",
    "split_tree",
    "to_bf16_parts",
]


class MasterWeightsState(NamedTuple):
    """``remainder``: a tree like the parameters (int16 or int8); ``inner``: the wrapped
    transformation's state, made from the fp32 weights."""

    remainder: Any
    inner: optax.OptState


def to_bf16_parts(params):
    """The BF16 parameters a model holds under :func:`master_weights` (of fp32 ``params``)."""
    return jax.tree.map(master.bf16_part, params)


def split_tree(weights, bits: int):
    """``(BF16 parts, remainders)``: :func:`coat_jax.core.master.split` of every fp32 leaf of
    ``weights``, as two trees like it."""
    parts = jax.tree.map(lambda w: master.split(w, bits), weights)
    is_part = lambda x: isinstance(x, tuple)
    hi = jax.tree.map(lambda p: p[0], parts, is_leaf=is_part)
    return hi, jax.tree.map(lambda p: p[1], parts, is_leaf=is_part)


def join_tree(hi, remainder):
    """The fp32 weights of BF16 parts ``hi`` and their remainders (:func:`split_tree`'s
    inverse; exact with 16-bit remainders)."""
    return jax.tree.map(master.join, hi, remainder)


def split_leaf_by_leaf(weights, bits: int):
    """:func:`split_tree` of fp32 ``weights`` on the devices, deleting each fp32 array as soon
    as its parts exist: the devices hold the fp32 tree plus one leaf's parts at most, where
    splitting the whole tree at once holds the fp32 tree and all its parts (Llama-2-7B with 16
    bits: 27 GB instead of 54). Each part keeps its leaf's sharding. ``weights``' arrays are
    deleted: do not use them afterwards."""
    leaves, treedef = jax.tree.flatten(weights)
    parts = {}  # by array: a leaf the tree holds twice (tied weights) is split once
    for i, w in enumerate(leaves):
        if id(w) not in parts:
            parts[id(w)] = _split_leaf(w, bits)
            w.delete()  # the runtime keeps the buffer until the split has read it
        leaves[i] = parts[id(w)]
    hi, remainder = zip(*leaves, strict=True) if leaves else ((), ())
    return treedef.unflatten(hi), treedef.unflatten(remainder)


@functools.partial(jax.jit, static_argnums=1)
def _split_leaf(w, bits):
    return master.split(w, bits)


def init_from_parts(init: Callable[[Any], optax.OptState], hi, remainder, out_shardings=None):
    """``init(fp32 weights)`` (a :func:`master_weights` transformation's ``init``, or a chain
    holding one) from the weights' BF16 parts and remainders, jitted with ``remainder``
    donated: the state's remainders reuse its buffers and the fp32 weights are rebuilt one
    fusion at a time, never as a whole tree (use after :func:`split_leaf_by_leaf`).
    ``out_shardings``: the state's (``None``: XLA's choice)."""
    rebuilt_init = lambda h, r: init(join_tree(h, r))
    return jax.jit(rebuilt_init, out_shardings=out_shardings, donate_argnums=1)(hi, remainder)


def _fp32(tree):
    return jax.tree.map(lambda x: jnp.asarray(x).astype(jnp.float32), tree)


def apply_exactly(
    params, state: MasterWeightsState, bits: int,
    step: Callable[[Any, optax.OptState], tuple[Any, optax.OptState]],
) -> tuple[Any, MasterWeightsState]:  # fmt: skip
    """``step(fp32 weights, inner state) -> (new fp32 weights, new inner state)`` run on the
    weights rebuilt from BF16 ``params`` and ``state.remainder``; returns the new weights'
    BF16 parts and a state with their remainders."""
    weights = jax.tree.map(master.join, params, state.remainder)
    new_weights, inner = step(weights, state.inner)
    hi, remainder = split_tree(new_weights, bits)
    return hi, MasterWeightsState(remainder, inner)


def master_weights(inner: optax.GradientTransformation, bits: int = 16):
    """``inner`` with BF16 parameters and the fp32 master weights' remainders in its state.

    Args:
      inner: any optax transformation (it sees fp32 weights and fp32 gradients, as the
        trainer gives it: BF16 gradients are upcast first).
      bits: remainder bits, 16 (exact fp32 master weights) or 8 (lossy, 3 bytes a weight).

    Returns:
      An optax ``GradientTransformationExtraArgs`` whose state is a
      :class:`MasterWeightsState`; ``init`` takes the fp32 parameters, ``update`` the BF16 ones
      (module docstring).
    """
    master.remainder_dtype(bits)  # raises on bad bits
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        weights = _fp32(params)
        return MasterWeightsState(split_tree(weights, bits)[1], inner.init(weights))

    def update_fn(updates, state, params=None, **extra_args):
        if params is None:
            raise ValueError("master_weights: update needs params (the BF16 parameters)")

        def step(weights, inner_state):
            u, inner_state = inner.update(_fp32(updates), inner_state, weights, **extra_args)
            return optax.apply_updates(weights, _fp32(u)), inner_state

        hi, new_state = apply_exactly(params, state, bits, step)
        deltas = jax.tree.map(lambda h, p: h.astype(jnp.float32) - p.astype(jnp.float32),
                              hi, params)  # fmt: skip
        return deltas, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
