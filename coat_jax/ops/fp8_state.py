r"""Any optax transformation with its parameter-shaped float state stored in FP8.

:func:`fp8_state` wraps a transformation (``optax.adam``, ``optax.lion``, ``optax.sgd`` with
momentum, a chain, ...) and changes only where its state lives: between steps each floating-point
state leaf of at least ``min_size`` elements is kept as FP8 codes with per-group scales along its
last axis (COAT's storage, arXiv 2410.19313); each step decodes those leaves to fp32, runs the
wrapped ``update`` on them and quantizes what it returns. The wrapped transformation's math,
learning rate and masks are untouched.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from coat_jax.core import adam, quant
from coat_jax.ops.options import DEFAULT_GROUP_SIZE, DEFAULT_MIN_SIZE, check_format, static_int

__all__ = ["Fp8WrappedState", "fp8_state"]

SECOND_MOMENT_KEY = "nu"
"""State leaves under a NamedTuple field or dict key of this name are non-negative second
moments (optax's ``ScaleByAdamState.nu`` and its kin): their NaN codes read back as ``+inf``."""


class Fp8WrappedState(NamedTuple):
    """State of :func:`fp8_state`.

    ``amax`` and ``k`` have ``inner_state``'s tree structure (wrappers such as ``nnx.Variable``
    or linen's boxes included), one array per leaf, so whatever maps over the inner state maps
    over them too; codes keep their leaf's shape, so a parameter's ``PartitionSpec`` applies to
    them.

    Attributes:
      inner_state: the wrapped transformation's state, each quantized leaf replaced by its FP8
        codes in the leaf's own shape (grouped along the last axis); other leaves as the
        wrapped transformation keeps them.
      amax: fp32 group maxima, shape ``(*leaf.shape[:-1], n_groups)``; for leaves not quantized
        unused zeros of that shape (shape ``()`` for 0-d and non-array leaves).
      k: uint8 codes ``16 k`` of the range-expansion exponents, shaped like ``amax``; ``None``
        without range expansion.

    A quantized leaf is ``quant.from_param_layout(codes, amax, k)``
    (:func:`coat_jax.core.quant.from_param_layout`).
    """

    inner_state: optax.OptState
    amax: optax.OptState
    k: optax.OptState | None = None


def _is_second_moment(path) -> bool:
    names = (getattr(key, "name", getattr(key, "key", None)) for key in path)
    return any(name == SECOND_MOMENT_KEY for name in names)


def _is_codes(leaf) -> bool:
    return hasattr(leaf, "dtype") and adam.is_fp8(leaf)


def _assemble(treedef, stored, expanded: bool) -> Fp8WrappedState:
    """The state from ``(codes or leaf, amax, k)`` per leaf in ``treedef``'s order."""
    field = lambda i: treedef.unflatten([s[i] for s in stored])
    return Fp8WrappedState(field(0), field(1), field(2) if expanded else None)


@functools.partial(jax.jit, static_argnames=("fmt", "group_size", "expand", "hide"))
def _encode(x, fmt, group_size: int, expand: bool, hide: bool = False):
    """``(codes, amax, k)`` of ``x`` in the parameter layout, as one program: an eager ``init``
    or ``update`` compiles one per leaf shape, not one per operation.

    ``hide`` puts ``x`` behind an optimization barrier, for ``init``: it keeps XLA from
    constant-folding the group reductions of inner's constant zeros at compile time (a jitted
    init of one 4096 x 4096 Adam parameter compiled in 146 s on a CPU without it, in 1 s with
    it). ``update`` leaves it off so that the inner step fuses into the quantization.
    """
    if hide:
        x = jax.lax.optimization_barrier(x)
    return quant.param_layout(quant.quantize(x, fmt, group_size=group_size, expand=expand))


@functools.partial(jax.jit, static_argnames=("second_moment",))
def _decode(codes, amax, k, second_moment: bool) -> jax.Array:
    """The fp32 leaf of ``(codes, amax, k)``; NaN codes of a second moment read as ``+inf``."""
    x = quant.dequantize(quant.from_param_layout(codes, amax, k))
    return adam.loaded_second_moment(x) if second_moment else x


def _placeholder(leaf, group_size: int, dtype) -> jax.Array:
    """Zeros shaped like the group scales of ``leaf`` (``()`` for 0-d and non-array leaves)."""
    return jnp.zeros(quant.scales_shape(getattr(leaf, "shape", ()), group_size), dtype)


def fp8_state(
    inner: optax.GradientTransformation,
    *,
    fmt: str = "e4m3",
    group_size: int | None = None,
    expansion: bool = True,
    min_size: int | None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""Stores the float state of ``inner`` in FP8 between steps; its math is unchanged.

    With :math:`Q` quantization to ``fmt`` per group of up to ``group_size`` elements along the
    last axis (with dynamic range expansion when ``expansion``) and :math:`Q^{-1}` its inverse
    (to fp32), a step of the wrapped transformation :math:`(u_t, s_t) = f(g_t, s_{t-1},
    \theta_{t-1})` becomes

    .. math::

      (u_t, s_t) = f\left(g_t,\ Q^{-1}(\hat s_{t-1}),\ \theta_{t-1}\right), \qquad
      \hat s_t = Q(s_t), \qquad \hat s_0 = Q(\mathrm{init}(\theta_0)),

    leaf by leaf, for the floating-point state leaves with at least one axis and at least
    ``min_size`` elements (Adam's ``mu`` and ``nu``, Lion's ``mu``, SGD's momentum ``trace``).
    Every other leaf stays as ``inner`` keeps it: integer counters, 0-d values (injected
    hyperparameters), leaves smaller than ``min_size`` (norm scales, biases), empty leaves.
    ``inner`` sees its quantized leaves as fp32 whatever their dtype at ``init``.

    A stored leaf costs 1 byte per element plus, per group, 4 bytes of ``amax`` and 1 of ``k``
    (with expansion): 1.04 bytes per element at ``group_size=128`` against 4 in fp32, so
    ``fp8_state(optax.adam(...))`` keeps 2.08 bytes per parameter and ``optax.lion`` 1.04.

    Non-finite values: a NaN or +-Inf element is stored as the format's NaN code and left out
    of its group's scale, so it stays non-finite and its neighbours keep their precision. Leaves
    under a field or key named ``nu`` are second moments (non-negative): their NaN codes read
    back as ``+inf`` (:func:`coat_jax.core.adam.loaded_second_moment`), so an element whose
    ``g**2`` overflowed gets the update ``optax.adam`` gives it, 0, and a NaN gradient still
    makes only its own element NaN. Elsewhere a stored ``+-inf`` reads back as NaN. A huge
    finite element (a gradient of 1e30 in Adam's ``mu``) sets its group's scale, and the
    group's other elements lose precision until it decays (:func:`coat_jax.fp8_adamw`, which
    knows its recurrence, leaves such a gradient out of ``m``).

    Args:
      inner: the transformation whose state to store in FP8.
      fmt: ``"e4m3"`` or ``"e5m2"``.
      group_size: largest quantization group along a leaf's last axis (a static int; ``None``:
        :data:`~coat_jax.ops.options.DEFAULT_GROUP_SIZE`). The ``None`` defaults keep both sizes
        out of ``optax.inject_hyperparams``' numeric hyperparameters.
      expansion: apply COAT's dynamic range expansion to each group.
      min_size: leaves with fewer elements stay as they are (a static int; ``None``:
        :data:`~coat_jax.ops.options.DEFAULT_MIN_SIZE`).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is :class:`Fp8WrappedState`;
      ``update`` forwards ``params`` and extra arguments to ``inner``.

    Raises:
      ValueError / TypeError: at construction for bad options; at ``init`` when ``inner``'s
        state already holds FP8 leaves.

    Example:
      >>> import jax.numpy as jnp, optax, coat_jax
      >>> params = {"w": jnp.ones((256, 256)), "b": jnp.zeros(256)}
      >>> opt = coat_jax.fp8_state(optax.adam(1e-3))
      >>> state = opt.init(params)
      >>> updates, state = opt.update({"w": jnp.full((256, 256), 0.5), "b": params["b"]}, state)
      >>> params = optax.apply_updates(params, updates)
      >>> adam_state = state.inner_state[0]
      >>> str(adam_state.mu["w"].dtype), adam_state.mu["w"].shape, state.amax[0].mu["w"].shape
      ('float8_e4m3fn', (256, 256), (256, 2))
      >>> str(adam_state.mu["b"].dtype)
      'float32'

    References:
      Xi et al., COAT: Compressing Optimizer states and Activation for memory-efficient FP8
      Training, ICLR 2025, https://arxiv.org/abs/2410.19313
    """
    if not isinstance(inner, optax.GradientTransformation):
        hint = "; pass its .gradient_transformation()" if hasattr(inner, "has_updated") else ""
        raise TypeError(
            f"inner must be an optax.GradientTransformation, got {type(inner).__name__}{hint}"
        )
    fp8 = check_format(fmt, "fmt")
    if fp8 is None:
        raise ValueError("fmt: None; fp8_state needs 'e4m3' or 'e5m2'")
    group_size = static_int(group_size, "group_size", 1, DEFAULT_GROUP_SIZE)
    min_size = static_int(min_size, "min_size", 0, DEFAULT_MIN_SIZE)
    if not isinstance(expansion, bool):
        raise TypeError(f"expansion must be a bool, got {type(expansion).__name__}")
    inner = optax.with_extra_args_support(inner)

    def quantized(leaf) -> bool:
        return (
            hasattr(leaf, "dtype")
            and jnp.issubdtype(leaf.dtype, jnp.floating)
            and leaf.ndim >= 1
            and leaf.size > 0
            and leaf.size >= min_size
        )

    def init_fn(params):
        flat, treedef = jax.tree_util.tree_flatten_with_path(inner.init(params))
        for path, leaf in flat:
            if _is_codes(leaf):
                raise TypeError(
                    f"inner state {jax.tree_util.keystr(path)} is already FP8 ({leaf.dtype}); "
                    "fp8_state would decode it"
                )

        def store(leaf):
            amax = _placeholder(leaf, group_size, jnp.float32)
            k = _placeholder(leaf, group_size, jnp.uint8) if expansion else None
            if quantized(leaf):
                leaf, amax, k = _encode(leaf, fp8, group_size, expansion, hide=True)
            return leaf, amax, k

        return _assemble(treedef, [store(leaf) for _, leaf in flat], expansion)

    def update_fn(updates, state, params=None, **extra_args):
        flat, treedef = jax.tree_util.tree_flatten_with_path(state.inner_state)
        flat_amax = treedef.flatten_up_to(state.amax)
        expanded = state.k is not None
        flat_k = treedef.flatten_up_to(state.k) if expanded else [None] * len(flat)

        def load(path, leaf, amax, k):
            return _decode(leaf, amax, k, _is_second_moment(path)) if _is_codes(leaf) else leaf

        decoded = [load(p, x, a, k) for (p, x), a, k in zip(flat, flat_amax, flat_k, strict=True)]
        new_updates, new_inner = inner.update(
            updates, treedef.unflatten(decoded), params, **extra_args
        )

        def store(old, new, amax, k):
            if not _is_codes(old):
                return new, amax, k  # as the inner transformation returned it
            like = jax.eval_shape(quant.from_param_layout, old, amax, k)  # shapes only
            size = like.data.shape[-1]  # the stored groups, whatever group_size made them
            return _encode(new, like.fmt, size, like.expanded)

        olds = [leaf for _, leaf in flat]
        news = treedef.flatten_up_to(new_inner)
        stored = [store(*t) for t in zip(olds, news, flat_amax, flat_k, strict=True)]
        return new_updates, _assemble(treedef, stored, expanded)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
