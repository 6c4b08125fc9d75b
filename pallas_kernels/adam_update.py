r"""Full-fusion FP8 AdamW: parameters, gradients and FP8 moments in, new parameters and moments
out, one pass over memory.

Per parameter leaf, with :math:`s` the clip scale (1 without clipping), :math:`\eta` the
learning rate, :math:`\lambda` the weight decay where the leaf is decayed (0 elsewhere) and
:math:`Q` / :math:`Q^{-1}` the per-group FP8 (range-expanded) quantization:

.. math::

  g &= s\,\nabla, \quad m = \beta_1 Q^{-1}(\hat m) + (1 - \beta_1) g, \quad
  v = \beta_2 Q^{-1}(\hat v) + (1 - \beta_2) g^2, \\
  u &= \mathrm{cast}_{\nabla}\!\left(\frac{m / (1 - \beta_1^t)}{\sqrt{v / (1 - \beta_2^t) +
       \epsilon_{root}} + \epsilon}\right), \quad
  \theta' = \theta + (-\eta)\,(u + \lambda \theta), \quad \hat m' = Q(m), \ \hat v' = Q(v).

This is exactly ``optax.chain(scale_by_fp8_adam(...), optax.add_decayed_weights(wd, mask),
optax.scale_by_learning_rate(lr))`` followed by ``optax.apply_updates`` (``u`` is rounded to the
gradient's dtype as the chain does), computed without materialising ``u`` or the update.

Bytes per parameter: param read + write 8, fp32 gradient 4 (bf16: 2), moments read + write
2 x 2 x 1.04 = 4.2: 16.2 (14.2 with bf16 gradients), against ``optax.adamw``'s 28 (param
r/w, gradient, fp32 m and v r/w, plus the update it writes and reads between its steps when XLA
does not fuse them).

How a trainer calls it (instead of ``opt.update`` + ``optax.apply_updates``)::

    adam = coat_jax.scale_by_fp8_adam(group_size=128)        # only the moment state
    state = adam.init(params)
    ...
    scale = jnp.minimum(1.0, max_norm / optax.global_norm(grads))  # optional clipping
    params, state = fp8_adamw_update(params, grads, state, lr_schedule,
                                     weight_decay=0.1, mask=decay_mask, clip_scale=scale)

with ``params`` and ``state`` donated to the jitted step, so the kernel updates them in place
(its outputs alias its inputs). Checkpoints hold the same ``ScaleByFp8AdamState`` as
``fp8_adamw``'s first link.

Kernel: Pallas Triton, the tile layout and per-group math of :mod:`pallas_kernels.adam_step`
(:func:`~pallas_kernels.adam_step.moment_update`), tuned by the same ``AdamStepTuning``.
Leaves the kernel cannot take (padded groups, fp32 moments of small parameters, non-fp32
parameters) run :func:`leaf_reference`, the jnp twin, without error.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from jax.experimental import pallas as pl

from coat_jax import sharding
from coat_jax.optim import ScaleByFp8AdamState
from coat_jax.quant import QuantizedArray, dequantize, quantize
from pallas_kernels import adam_step, dispatch
from pallas_kernels.adam_step import AdamStepTuning

__all__ = ["fp8_adamw_update", "leaf_kernel", "leaf_reference"]

_TUNING = AdamStepTuning()
N_HYPER = 16  # b1, 1-b1, b2, 1-b2, eps, eps_root, bc1, bc2, -lr, wd, clip scale, padding


def _step(p, u, neg_lr, wd, decay: bool, grad_dtype):
    """``p + (-lr) (u + wd p)`` in the dtypes the chain uses: on undecayed leaves optax scales
    ``u`` by the learning rate in ``u``'s dtype, the gradient's (a no-op for fp32)."""
    if decay:
        return p + neg_lr * (u + wd * p)
    low = lambda x: x.astype(grad_dtype).astype(jnp.float32)
    return p + low(low(neg_lr) * u)


def leaf_reference(p, g, mu, nu, hyper, decay: bool):
    """The jnp (XLA-fused) update of one leaf, op for op as the optax chain computes it.

    ``mu`` / ``nu`` are QuantizedArrays or fp32 arrays (small parameters); ``hyper`` is the
    fp32 vector of :func:`fp8_adamw_update`. Returns ``(new_p, new_mu, new_nu)``.
    """
    b1, omb1, b2, omb2, eps, eps_root, bc1, bc2, neg_lr, wd, clip = (hyper[i] for i in range(11))
    g32 = g.astype(jnp.float32) * clip
    dec = lambda s: dequantize(s) if isinstance(s, QuantizedArray) else s

    def enc(x, like):
        if not isinstance(like, QuantizedArray):
            return x
        return quantize(x, like.fmt, group_size=like.data.shape[-1], expand=like.expanded)

    m = omb1 * g32 + b1 * dec(mu)
    v = omb2 * (g32 * g32) + b2 * dec(nu)
    u = ((m / bc1) / (jnp.sqrt(v / bc2 + eps_root) + eps)).astype(g.dtype).astype(jnp.float32)
    new_p = _step(p, u, neg_lr, wd, decay, g.dtype)
    return new_p.astype(p.dtype), enc(m, mu), enc(v, nu)


def _kernel_takes(p, g, mu, nu, tuning) -> bool:
    return (
        adam_step.supported(mu, nu, tuning)
        and p.dtype == jnp.float32
        and p.shape == g.shape == mu.shape
        and mu.data.shape[-1] == nu.data.shape[-1]
    )


def leaf_kernel(p, g, mu, nu, hyper, decay: bool, *, tuning=_TUNING, interpret=False):
    """The fused kernel on one leaf (layouts :func:`adam_step.supported` takes, fp32 ``p``).

    Returns ``(new_p, new_mu, new_nu)``; the outputs alias ``p`` and the moments' arrays.
    """
    if not _kernel_takes(p, g, mu, nu, tuning):
        raise ValueError("adam_update.leaf_kernel: unsupported layout; use leaf_reference")
    dispatch.check_compiled(interpret, "pallas_kernels.adam_update")
    n, group, br = adam_step.group_rows(mu, tuning)
    outs = _call(
        p.reshape(n, group), g.reshape(n, group), jnp.asarray(hyper, jnp.float32).reshape(1, -1),
        *adam_step.moment_operands(mu, nu, n, group),
        static=(mu.fmt, nu.fmt, mu.expanded, br, bool(decay), tuning, interpret),
    )  # fmt: skip
    new_mu, new_nu = adam_step.rebuild(mu, outs[1:])
    return outs[0].reshape(p.shape), new_mu, new_nu


@functools.partial(jax.jit, static_argnames=("static",))
def _call(p, g, hyper, *moments, static):
    mu_fmt, nu_fmt, expanded, br, decay, tuning, interpret = static
    n, group = p.shape
    log = adam_step.log_fn(tuning, interpret)
    specs, shapes = adam_step.moment_specs(n, group, br, expanded, mu_fmt, nu_fmt)
    n_mom = len(specs)

    def kernel(p_ref, g_ref, h_ref, *refs):
        ins, outs = refs[:n_mom], refs[n_mom:]
        h = [h_ref[0, i] for i in range(11)]
        neg_lr, wd, clip = h[8:11]
        m_state, v_state = adam_step.read_moments(ins, expanded)
        u, new_m, new_v = adam_step.moment_update(
            g_ref[...].astype(jnp.float32) * clip, m_state, v_state, h[:8],
            mu_fmt=mu_fmt, nu_fmt=nu_fmt, expanded=expanded, log=log,
        )  # fmt: skip
        u = u.astype(g.dtype).astype(jnp.float32)  # the chain's u has the gradient's dtype
        outs[0][...] = _step(p_ref[...], u, neg_lr, wd, decay, g.dtype)
        adam_step.write_moments(outs[1:], new_m, new_v, expanded)

    tile = pl.BlockSpec((br, group), lambda i: (i, 0))
    return pl.pallas_call(
        kernel,
        grid=(n // br,),
        in_specs=[tile, tile, pl.BlockSpec((1, N_HYPER), lambda i: (0, 0)), *specs],
        out_specs=[tile, *specs],
        out_shape=[jax.ShapeDtypeStruct((n, group), jnp.float32), *shapes],
        input_output_aliases={0: 0, **{3 + j: 1 + j for j in range(n_mom)}},
        compiler_params=adam_step.compiler_params(tuning),
        interpret=interpret,
    )(p, g, hyper, *moments)


def _local_specs(p, mu, p_spec, mesh):
    """``(param spec, codes spec, group spec)`` for running the kernel on each device's shard
    of a leaf, or ``None`` when the shards do not line up with whole groups (the state's group
    axis must split like the parameter's last axis: :func:`coat_jax.sharding.optimizer_specs`
    replicates it where it cannot)."""
    spec = (*tuple(p_spec), *(None,) * (p.ndim - len(p_spec)))
    lead, last = spec[:-1], spec[-1]
    if sharding.fits(mesh, last, mu.amax.shape[-1]) != last:  # the state's rule for its groups
        return None
    P = jax.sharding.PartitionSpec
    return P(*spec), P(*lead, last, None), P(*lead, last)


def _leaf_sharded(p, g, mu, nu, hyper, decay, specs, mesh, *, tuning, interpret):
    """:func:`leaf_kernel` on every device's shard (``jax.shard_map``): the update is
    elementwise within a group, so each device updates its own parameter rows and their FP8
    groups, and nothing moves between devices."""
    p_spec, codes_spec, group_spec = specs
    expanded = mu.expanded

    def arrays(q):
        return [q.data, q.amax, *([q.k] if expanded else [])]

    def local(p, g, hyper, *moments):
        half = len(moments) // 2
        rebuild = lambda a: QuantizedArray(a[0], a[1], a[2] if expanded else None,
                                           a[0].shape[-2] * a[0].shape[-1])  # fmt: skip
        new_p, new_mu, new_nu = leaf_kernel(
            p, g, rebuild(moments[:half]), rebuild(moments[half:]), hyper, decay,
            tuning=tuning, interpret=interpret,
        )  # fmt: skip
        return new_p, *arrays(new_mu), *arrays(new_nu)

    moment_specs = [codes_spec, group_spec, *([group_spec] if expanded else [])] * 2
    P = jax.sharding.PartitionSpec
    outs = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(p_spec, p_spec, P(), *moment_specs),
        out_specs=(p_spec, *moment_specs),
        check_vma=False,
    )(p, g, hyper, *arrays(mu), *arrays(nu))
    half = (len(outs) - 1) // 2
    glob = lambda a, like: QuantizedArray(a[0], a[1], a[2] if expanded else None, like.last_dim)
    return outs[0], glob(outs[1 : 1 + half], mu), glob(outs[1 + half :], nu)


def fp8_adamw_update(
    params,
    grads,
    state: ScaleByFp8AdamState,
    learning_rate: optax.ScalarOrSchedule,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    weight_decay: float = 1e-4,
    mask=None,
    clip_scale=1.0,
    kernels: str = "auto",
    tuning: AdamStepTuning = _TUNING,
    specs=None,
):
    """One AdamW step with FP8 moments, fused per leaf (math in the module docstring).

    Args:
      params: pytree of parameters.
      grads: gradients, the params' structure (fp32 or bf16 leaves).
      state: the :class:`~coat_jax.optim.ScaleByFp8AdamState` of ``scale_by_fp8_adam(b1, b2,
        eps, eps_root, ...)``, whose moments carry format, group size and expansion.
      learning_rate: a scalar or an optax schedule of the step count before this update.
      b1, b2, eps, eps_root: as given to ``scale_by_fp8_adam``.
      weight_decay: decoupled weight decay :math:`\\lambda`.
      mask: pytree of Python bools (or a callable of params returning one): leaves to decay.
      clip_scale: scalar multiplying the gradients, e.g. ``min(1, max_norm / global_norm)``.
      kernels: ``"auto" | "pallas" | "interpret" | "reference"`` (see ``pallas_kernels.dispatch``).
      tuning: knobs of the kernel.
      specs: under a multi-device mesh (``jax.set_mesh``), the ``PartitionSpec`` of each
        parameter (the params' structure; the state shards like its parameter, as
        :func:`coat_jax.sharding.optimizer_specs` lays it out): the kernel then runs on every
        device's shard (``jax.shard_map``). Without it, ``"auto"`` takes the XLA reference there
        and the kernel modes raise.

    Returns:
      ``(new_params, new_state)``.
    """
    mode = dispatch.resolve(kernels, "adam_update")
    mesh = dispatch.multi_device_mesh()
    sharded = mesh is not None
    if sharded and specs is None and mode != "reference":
        if kernels != "auto":
            raise ValueError(
                f"fp8_adamw_update(kernels={kernels!r}) under a {mesh.size}-device mesh needs "
                "specs= (the parameters' PartitionSpecs) to run the kernel on each shard"
            )
        mode = "reference"

    count_inc = optax.safe_increment(state.count)
    lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    terms = [b1, 1 - b1, b2, 1 - b2, eps, eps_root]
    terms += [1 - f32(b1) ** count_inc, 1 - f32(b2) ** count_inc, -1 * f32(lr), weight_decay]
    hyper = jnp.stack([f32(t) for t in [*terms, clip_scale]] + [f32(0.0)] * (N_HYPER - 11))

    flat_p, treedef = jax.tree.flatten(params)
    flat_g = treedef.flatten_up_to(grads)
    flat_mu, flat_nu = treedef.flatten_up_to(state.mu), treedef.flatten_up_to(state.nu)
    flat_specs = treedef.flatten_up_to(specs) if sharded and specs is not None else None
    flat_specs = flat_specs or [None] * len(flat_p)
    if mask is None:
        flat_mask = [True] * len(flat_p)
    else:
        flat_mask = treedef.flatten_up_to(mask(params) if callable(mask) else mask)
        if not all(isinstance(d, bool) for d in flat_mask):
            raise TypeError("fp8_adamw_update: mask leaves must be Python bools (static)")
    out = []
    interpret = mode == "interpret"
    leaves = zip(flat_p, flat_g, flat_mu, flat_nu, flat_mask, flat_specs, strict=True)
    for p, g, mu, nu, decay, p_spec in leaves:
        takes = mode != "reference" and _kernel_takes(p, g, mu, nu, tuning)
        local = _local_specs(p, mu, p_spec, mesh) if takes and sharded else None
        if takes and not sharded:
            out.append(leaf_kernel(p, g, mu, nu, hyper, decay, tuning=tuning,
                                   interpret=interpret))  # fmt: skip
        elif local is not None:
            out.append(_leaf_sharded(p, g, mu, nu, hyper, decay, local, mesh, tuning=tuning,
                                     interpret=interpret))  # fmt: skip
        else:
            out.append(leaf_reference(p, g, mu, nu, hyper, decay))
    new_p, new_mu, new_nu = (treedef.unflatten([o[i] for o in out]) for i in range(3))
    return new_p, ScaleByFp8AdamState(count=count_inc, mu=new_mu, nu=new_nu)
