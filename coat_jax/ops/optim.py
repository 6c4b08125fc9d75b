r"""AdamW whose moments are stored in FP8 with per-group dynamic range expansion.

The transformation is optax's Adam with a different storage for ``mu`` and ``nu``: each step
dequantizes them to fp32, applies the Adam recurrence in fp32 (:mod:`coat_jax.core.adam`, the
one the kernels use too), computes the update from the fp32 moments, and quantizes the new
moments back (COAT, arXiv 2410.19313). Parameters smaller
than ``min_size`` elements (norm scales, biases) and 0-d parameters keep fp32 moments.

State bytes per quantized parameter: 1 (m) + 1 (v) + per group of up to ``group_size`` elements
4 bytes of ``amax`` (+1 byte of ``k`` when expanded) for each moment: 2.078 bytes at
``group_size=128`` with expansion, against 8 for fp32 Adam.

The state (:class:`~coat_jax.core.adam.ScaleByFp8AdamState`) keeps the FP8 codes in each
parameter's own shape and the per-group scales in ``(*lead, n_groups)``, so a parameter's
``PartitionSpec`` applies to its state.

Non-finite values stay where they are, as in ``optax.adamw``: a NaN or +-Inf gradient element
makes its own moments (NaN codes) and parameter non-finite and leaves its group's other
elements alone; a finite gradient whose square overflows (1e30) stores ``v = +inf`` for that
element, whose updates are then 0 as adamw's are (:func:`coat_jax.core.adam.loaded_second_moment`),
and stays out of ``m`` (:func:`coat_jax.core.adam.first_moment_gradient`).
Wrap the optimizer in ``optax.apply_if_finite`` to skip non-finite steps entirely.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from coat_jax.core import adam, quant
from coat_jax.core.adam import ScaleByFp8AdamState
from coat_jax.ops.options import DEFAULT_GROUP_SIZE, DEFAULT_MIN_SIZE, check_format, static_int
from pallas_kernels import adam_step, dispatch

__all__ = ["DEFAULT_GROUP_SIZE", "DEFAULT_MIN_SIZE", "fp8_adamw", "scale_by_fp8_adam"]


def _check_decay(value, what: str):
    if isinstance(value, (int, float)) and not 0.0 <= value < 1.0:
        raise ValueError(f"{what} must be in [0, 1), got {value}")


def _moment_dtype(mu_dtype):
    """The dtype of the first moments kept out of FP8: ``mu_dtype`` (a floating dtype) or fp32."""
    if mu_dtype is None:
        return jnp.dtype(jnp.float32)
    try:
        dtype = jnp.dtype(mu_dtype)
    except TypeError:
        raise TypeError(f"mu_dtype must be a dtype or None, got {mu_dtype!r}") from None
    if not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize < 2:
        raise TypeError(f"mu_dtype must be a 16- or 32-bit floating dtype, got {dtype}")
    return dtype


def _check_float_leaves(tree, what: str) -> None:
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            raise TypeError(
                f"{what} {jax.tree_util.keystr(path) or '(root)'} has dtype {leaf.dtype}; "
                "fp8 Adam needs floating-point leaves (keep others out of the params, or "
                "wrap the optimizer in optax.masked)"
            )


def _check_group_shards(tree, group_size: int, quantized) -> None:
    """Raises a one-line ``ValueError`` for a quantized leaf whose last axis is sharded with
    explicit axes (``jax.sharding.AxisType.Explicit``: the sharding is in the array's type)
    into shards that do not hold whole groups: splitting the axis into groups is then a
    reshape jax cannot type. Auto axes (no sharding in the type) reshard instead."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if leaf.ndim == 0 or not quantized(leaf):
            continue
        sharding = getattr(jax.typeof(leaf), "sharding", None)
        spec = tuple(getattr(sharding, "spec", ()) or ())
        if len(spec) < leaf.ndim or spec[leaf.ndim - 1] is None:
            continue
        axes = spec[leaf.ndim - 1]
        axes = axes if isinstance(axes, tuple) else (axes,)
        shards = math.prod(sharding.mesh.shape[a] for a in axes)
        n_groups, size = quant.group_layout(leaf.shape[-1], group_size)
        if n_groups * size == leaf.shape[-1] and n_groups % shards == 0:
            continue
        raise ValueError(
            f"param {jax.tree_util.keystr(path) or '(root)'}: its last axis ({leaf.shape[-1]}) "
            f"is split over mesh axes {axes} (explicit) into {shards} shards, which do not hold "
            f"whole FP8 groups ({n_groups} of {size}); shard another axis, choose a group_size "
            "whose groups fit the shards, or use Auto mesh axes"
        )


def scale_by_fp8_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype=None,
    *,
    nesterov: bool = False,
    group_size: int | None = None,
    mu_format: str | None = "e4m3",
    nu_format: str | None = "e4m3",
    expansion: bool = True,
    min_size: int | None = None,
    kernels: str = "auto",
) -> optax.GradientTransformationExtraArgs:
    r"""Rescales updates by Adam, keeping the moments in FP8.

    With :math:`Q` quantization per group of ``group_size`` along the last axis (with dynamic
    range expansion when ``expansion``) and :math:`Q^{-1}` its inverse, at step :math:`t`:

    .. math::

      m_t &= \beta_1 Q^{-1}(\hat m_{t-1}) + (1 - \beta_1) g_t, \qquad
      v_t = \beta_2 Q^{-1}(\hat v_{t-1}) + (1 - \beta_2) g_t^2, \\
      u_t &= \frac{m_t / (1 - \beta_1^t)}{\sqrt{v_t / (1 - \beta_2^t) + \epsilon_{root}}
             + \epsilon}, \qquad \hat m_t = Q(m_t), \quad \hat v_t = Q(v_t),

    all in fp32; :math:`u_t` is returned in the gradient's dtype. With ``nesterov`` the
    numerator :math:`m_t / (1 - \beta_1^t)` becomes :math:`\beta_1 m_t / (1 - \beta_1^{t+1})
    + (1 - \beta_1) g_t / (1 - \beta_1^t)`, as in ``optax.scale_by_adam(nesterov=True)``.
    With both formats ``None`` this is ``optax.scale_by_adam`` (same arguments, same order).

    Args:
      b1: decay of the first moment.
      b2: decay of the second moment.
      eps: added to the denominator outside the square root.
      eps_root: added inside the square root.
      mu_dtype: dtype of the first moments that are not stored in FP8 (parameters under
        ``min_size``, 0-d ones, every one with ``mu_format=None``); ``None``: fp32. The step
        runs in fp32 and only the stored moment is rounded to it (``optax.scale_by_adam``
        also rounds :math:`\beta_1 m` in ``mu_dtype``).
      nesterov: Nesterov momentum (NAdam), as ``optax.scale_by_adam``'s. The Pallas moment
        kernel does not take it: with ``nesterov`` every parameter steps on the reference.
      group_size: largest quantization group along each parameter's last axis (a static int;
        ``None``: :data:`DEFAULT_GROUP_SIZE`). The ``None`` defaults keep both out of
        ``optax.inject_hyperparams``' numeric hyperparameters, so it needs no ``static_args``.
      mu_format: ``"e4m3"``, ``"e5m2"`` or ``None`` (fp32) for the first moment.
      nu_format: the same for the second moment.
      expansion: apply COAT's dynamic range expansion to each group.
      min_size: parameters with fewer elements keep fp32 moments (a static int; ``None``:
        :data:`DEFAULT_MIN_SIZE`).
      kernels: ``"pallas"`` (the fused moment kernel of ``pallas_kernels.adam_step``; Hopper
        GPU only), ``"reference"`` (XLA-fused jnp), ``"interpret"`` (the kernel in Pallas
        interpret mode, for tests on CPU) or ``"auto"``: the faster of the two as measured
        (``pallas_kernels.dispatch.AUTO_USES_KERNEL``: the kernel on one Hopper GPU), the
        reference elsewhere and under a multi-device mesh. Parameters whose layout the kernel
        does not take use the reference.

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    Raises:
      ValueError / TypeError: at construction for bad options, at ``init`` for
        non-floating-point params, at ``update`` for non-floating-point gradients.
    """
    mu_fmt = check_format(mu_format, "mu_format")
    nu_fmt = check_format(nu_format, "nu_format")
    group_size = static_int(group_size, "group_size", 1, DEFAULT_GROUP_SIZE)
    min_size = static_int(min_size, "min_size", 0, DEFAULT_MIN_SIZE)
    if not isinstance(expansion, bool):
        raise TypeError(f"expansion must be a bool, got {type(expansion).__name__}")
    _check_decay(b1, "b1")
    _check_decay(b2, "b2")
    if not isinstance(nesterov, bool):
        raise TypeError(f"nesterov must be a bool, got {type(nesterov).__name__}")
    raw_mu_dtype = _moment_dtype(mu_dtype)
    use_kernel = dispatch.resolve(kernels, "adam_step") != "reference" and not nesterov

    def quantized(param, fmt) -> bool:
        return fmt is not None and param.ndim >= 1 and param.size >= min_size

    def init_fn(params):
        _check_float_leaves(params, "param")
        _check_group_shards(
            params, group_size, lambda p: quantized(p, mu_fmt) or quantized(p, nu_fmt)
        )

        def codes(p, fmt, raw_dtype):
            if quantized(p, fmt):
                return quant.param_layout(quant.zeros(p.shape, fmt, group_size, expansion))[0]
            return jnp.zeros(p.shape, raw_dtype)

        def scales(p, dtype):  # per group; unused zeros where the moment stays fp32
            return jnp.zeros(quant.scales_shape(p.shape, group_size), dtype)

        tree = lambda f, *a: jax.tree.map(lambda p: f(p, *a), params)
        k = (lambda: tree(scales, jnp.uint8)) if expansion else (lambda: None)
        return ScaleByFp8AdamState(
            count=jnp.zeros([], jnp.int32),
            mu=tree(codes, mu_fmt, raw_mu_dtype),
            nu=tree(codes, nu_fmt, jnp.float32),
            mu_amax=tree(scales, jnp.float32),
            nu_amax=tree(scales, jnp.float32),
            mu_k=k(),
            nu_k=k(),
        )

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        _check_float_leaves(updates, "gradient")
        mesh = dispatch.multi_device_mesh()
        run_kernel = use_kernel
        if use_kernel and mesh is not None:
            if kernels != "auto":
                raise ValueError(
                    f"kernels={kernels!r}: the Pallas moment kernel does not run under a "
                    f"{mesh.size}-device mesh yet (it is not shard_map-wrapped); use 'reference'"
                )
            run_kernel = False  # "auto": the XLA path, which the partitioner shards
        elif use_kernel and kernels == "auto" and dispatch.unseen_sharding():
            run_kernel = False  # built under a mesh, traced outside it: see dispatch.resolve
        count_inc = optax.safe_increment(state.count)
        coeffs = adam.coefficients(b1, b2, eps, eps_root, count_inc)
        next_bc1 = adam.coefficients(b1, b2, eps, eps_root, optax.safe_increment(count_inc)).bc1

        def leaf(g, mu, nu):
            if run_kernel and adam_step.supported(mu, nu):
                return adam_step.fp8_adam_moments(
                    g, mu, nu, coeffs, interpret=kernels == "interpret"
                )
            nesterov_bc1 = next_bc1 if nesterov else None
            u, m, v = adam.stored_step(g.astype(jnp.float32), mu, nu, coeffs, nesterov_bc1)
            return u.astype(g.dtype), m, v

        flat_g, treedef = jax.tree.flatten(updates)
        flat_mu, flat_nu = adam.moments(state, treedef)
        out = [leaf(g, m, v) for g, m, v in zip(flat_g, flat_mu, flat_nu, strict=True)]
        new_updates = treedef.unflatten([o[0] for o in out])
        new_state = adam.from_moments(
            state, treedef, count_inc, [o[1] for o in out], [o[2] for o in out]
        )
        return new_updates, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def fp8_adamw(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype=None,
    weight_decay: float = 1e-4,
    mask=None,
    *,
    nesterov: bool = False,
    group_size: int | None = None,
    mu_format: str | None = "e4m3",
    nu_format: str | None = "e4m3",
    expansion: bool = True,
    min_size: int | None = None,
    kernels: str = "auto",
) -> optax.GradientTransformationExtraArgs:
    r"""AdamW with FP8 moments (COAT): ``optax.adamw`` at about a quarter of its state memory.

    .. math::

      \theta_t = \theta_{t-1} - \eta_t \left(u_t + \lambda \theta_{t-1}\right)

    with :math:`u_t` from :func:`scale_by_fp8_adam`, :math:`\lambda` = ``weight_decay`` applied
    where ``mask`` allows and :math:`\eta_t` = ``learning_rate`` (a float or an optax schedule).
    It is exactly ``optax.chain(scale_by_fp8_adam(...), optax.add_decayed_weights(weight_decay,
    mask), optax.scale_by_learning_rate(learning_rate))``.

    ``optax.adamw``'s arguments are taken in its order (``learning_rate, b1, b2, eps,
    eps_root, mu_dtype, weight_decay, mask``, keyword ``nesterov``), so a call to one is a
    call to the other.

    Args:
      learning_rate: a float or an optax schedule.
      b1, b2, eps, eps_root: as in ``optax.adamw``.
      mu_dtype, nesterov: see :func:`scale_by_fp8_adam`.
      weight_decay: decoupled weight decay.
      mask: pytree of bools (or a callable returning one) selecting the decayed params.
      group_size, mu_format, nu_format, expansion, min_size, kernels: see
        :func:`scale_by_fp8_adam`.

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    Example:
      >>> import jax.numpy as jnp, optax, coat_jax
      >>> params = {"w": jnp.ones((256, 256))}
      >>> opt = coat_jax.fp8_adamw(1e-3, weight_decay=0.1, min_size=0)
      >>> state = opt.init(params)
      >>> updates, state = opt.update({"w": jnp.full((256, 256), 0.5)}, state, params)
      >>> params = optax.apply_updates(params, updates)
      >>> str(state[0].mu["w"].dtype), state[0].mu["w"].shape, state[0].mu_amax["w"].shape
      ('float8_e4m3fn', (256, 256), (256, 2))

    References:
      Xi et al., COAT: Compressing Optimizer states and Activation for memory-efficient FP8
      Training, ICLR 2025, https://arxiv.org/abs/2410.19313
    """
    return optax.chain(
        scale_by_fp8_adam(
            b1,
            b2,
            eps,
            eps_root,
            mu_dtype,
            nesterov=nesterov,
            group_size=group_size,
            mu_format=mu_format,
            nu_format=nu_format,
            expansion=expansion,
            min_size=min_size,
            kernels=kernels,
        ),
        optax.add_decayed_weights(weight_decay, mask),
        optax.scale_by_learning_rate(learning_rate),
    )
