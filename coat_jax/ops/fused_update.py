r"""``fp8_adamw``'s step and ``optax.apply_updates`` in one pass per parameter.

:func:`fp8_adamw_update` takes the parameters, gradients and the
:class:`~coat_jax.core.adam.ScaleByFp8AdamState` of ``scale_by_fp8_adam`` and returns the new
parameters and state, exactly as ``optax.chain(scale_by_fp8_adam(...),
optax.add_decayed_weights(wd, mask), optax.scale_by_learning_rate(lr))`` followed by
``optax.apply_updates`` would (the math: ``pallas_kernels.adam_update``). Each leaf runs the
fused Pallas kernel (``pallas_kernels.adam_update.leaf_kernel``) where the dispatch rule
(``pallas_kernels.dispatch``) and the leaf's layout allow, else its jnp reference; under a
multi-device mesh the kernel runs on every device's shard (``jax.shard_map``): the FP8 state
shards like its parameter (:func:`coat_jax.ops.sharding.optimizer_specs`), so nothing moves.

How a trainer calls it (instead of ``opt.update`` + ``optax.apply_updates``)::

    adam = coat_jax.scale_by_fp8_adam(group_size=128)        # only the moment state
    state = adam.init(params)
    ...
    scale = jnp.minimum(1.0, max_norm / optax.tree.norm(grads))  # optional clipping
    params, state = fp8_adamw_update(params, grads, state, lr_schedule,
                                     weight_decay=0.1, mask=decay_mask, clip_scale=scale)

with ``params`` and ``state`` donated to the jitted step, so the kernel updates them in place.
"""

from __future__ import annotations

import jax
import optax

from coat_jax.core import adam, master, quant
from coat_jax.core.adam import ScaleByFp8AdamState
from coat_jax.ops import master_weights, sharding
from pallas_kernels import adam_update, dispatch
from pallas_kernels.adam_step import AdamStepTuning

__all__ = ["fp8_adamw_update"]

_TUNING = AdamStepTuning()


def _local_specs(p, mu, p_spec, mesh):
    """``(param spec, group spec)`` for running the kernel on each device's shard of a leaf,
    or ``None`` when the shards do not line up with whole groups (the state's group axis must
    split like the parameter's last axis: :func:`coat_jax.ops.sharding.optimizer_specs`
    replicates it where it cannot). The FP8 codes have the parameter's shape and spec."""
    spec = (*tuple(p_spec), *(None,) * (p.ndim - len(p_spec)))
    lead, last = spec[:-1], spec[-1]
    if sharding.fits(mesh, last, mu.amax.shape[-1]) != last:  # the state's rule for its groups
        return None
    P = jax.sharding.PartitionSpec
    return P(*spec), P(*lead, last)


def _leaf_sharded(p, g, mu, nu, hyper, decay, specs, mesh, *, tuning, interpret,
                  remainder=None):  # fmt: skip
    """The kernel on every device's shard (``jax.shard_map``): the update is elementwise within
    a group, so each device updates its own parameter rows and their FP8 groups (and, with BF16
    master weights, their remainders, which shard like the parameter)."""
    p_spec, group_spec = specs
    expanded = mu.expanded
    weight = (p,) if remainder is None else (p, remainder)
    k = len(weight)

    def arrays(q):
        codes, amax, k = quant.param_layout(q)
        return [codes, amax, *([k] if expanded else [])]

    def rebuild(a):
        return quant.from_param_layout(a[0], a[1], a[2] if expanded else None)

    def local(*args):
        w, (g, hyper), moments = args[:k], args[k : k + 2], args[k + 2 :]
        half = len(moments) // 2
        *new_w, new_mu, new_nu = adam_update.leaf_kernel(
            w[0], g, rebuild(moments[:half]), rebuild(moments[half:]), hyper, decay,
            remainder=w[1] if k == 2 else None, tuning=tuning, interpret=interpret,
        )  # fmt: skip
        return *new_w, *arrays(new_mu), *arrays(new_nu)

    moment_specs = [p_spec, group_spec, *([group_spec] if expanded else [])] * 2
    P = jax.sharding.PartitionSpec
    outs = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(*[p_spec] * k, p_spec, P(), *moment_specs),
        out_specs=(*[p_spec] * k, *moment_specs),
        check_vma=False,
    )(*weight, g, hyper, *arrays(mu), *arrays(nu))
    half = (len(outs) - k) // 2
    return (*outs[:k], rebuild(outs[k : k + half]), rebuild(outs[k + half :]))


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
    remainder=None,
    skip=False,
):
    """One AdamW step with FP8 moments, fused per leaf (math in the module docstring).

    Args:
      params: pytree of parameters.
      grads: gradients, the params' structure (fp32 or bf16 leaves).
      state: the :class:`~coat_jax.core.adam.ScaleByFp8AdamState` of ``scale_by_fp8_adam(b1,
        b2, eps, eps_root, ...)``, whose moments carry format, group size and expansion.
      learning_rate: a scalar or an optax schedule of the step count before this update.
      b1, b2, eps, eps_root: as given to ``scale_by_fp8_adam``.
      weight_decay: decoupled weight decay :math:`\\lambda`.
      mask: pytree of Python bools (or a callable of params returning one): leaves to decay.
      clip_scale: scalar multiplying the gradients, e.g. ``min(1, max_norm / global_norm)``.
      kernels: ``"auto" | "pallas" | "interpret" | "reference"`` (``pallas_kernels.dispatch``).
      tuning: knobs of the kernel.
      specs: under a multi-device mesh (``jax.set_mesh``), the ``PartitionSpec`` of each
        parameter (the params' structure): the kernel then runs on every device's shard.
        Without it, ``"auto"`` takes the XLA reference there and the kernel modes raise.
      remainder: BF16 master weights (:mod:`coat_jax.ops.master_weights`): ``params`` are the
        BF16 parts and this the remainders (int16 or int8, the params' structure). The kernel
        reads and writes both parts where the ``"adam_update_parts"`` family runs
        (``pallas`` / ``interpret``; ``"auto"``: where measured faster), else each weight is
        rebuilt in fp32 around the fp32 path and split after it.
      skip: a bool (traced or not); where true, parameters and state come back unchanged,
        the step count included. The kernel then leaves its inputs in place (it updates
        them in place otherwise), so a trainer's non-finite guard costs no copy of the
        parameters and state (a select after the update would need the old arrays kept
        beside the new).

    Returns:
      ``(new_params, new_state)``; with ``remainder``, ``(new_params, new_remainder,
      new_state)``.
    """
    if remainder is not None and dispatch.resolve(kernels, "adam_update_parts") == "reference":
        bits = {master.remainder_bits(r.dtype) for r in jax.tree.leaves(remainder)}
        if len(bits) > 1:
            raise ValueError(f"fp8_adamw_update: remainders of mixed widths {sorted(bits)}")

        def fp32_update(weights, state):
            return fp8_adamw_update(
                weights, grads, state, learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
                weight_decay=weight_decay, mask=mask, clip_scale=clip_scale, kernels=kernels,
                tuning=tuning, specs=specs, skip=skip,
            )  # fmt: skip

        old = master_weights.MasterWeightsState(remainder, state)
        new_params, parts = master_weights.apply_exactly(params, old, bits.pop() if bits else 16,
                                                         fp32_update)  # fmt: skip
        # a skipped step rebuilds and splits unchanged weights: keep the parts as they came
        new_params, new_remainder = adam_update.unless(
            skip, (params, remainder), (new_params, parts.remainder)
        )
        return new_params, new_remainder, parts.inner
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
    coeffs = adam.coefficients(b1, b2, eps, eps_root, count_inc)
    hyper = adam_update.update_vector(coeffs, lr, weight_decay, clip_scale, skip)

    flat_p, treedef = jax.tree.flatten(params)
    flat_g = treedef.flatten_up_to(grads)
    flat_r = [None] * len(flat_p) if remainder is None else treedef.flatten_up_to(remainder)
    flat_mu, flat_nu = adam.moments(state, treedef)
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
    leaves = zip(flat_p, flat_r, flat_g, flat_mu, flat_nu, flat_mask, flat_specs, strict=True)
    for p, r, g, mu, nu, decay, p_spec in leaves:
        takes = mode != "reference" and adam_update.kernel_takes(p, g, mu, nu, tuning, r)
        local = _local_specs(p, mu, p_spec, mesh) if takes and sharded else None
        if takes and not sharded:
            out.append(adam_update.leaf_kernel(p, g, mu, nu, hyper, decay, remainder=r,
                                               tuning=tuning, interpret=interpret))  # fmt: skip
        elif local is not None:
            out.append(_leaf_sharded(p, g, mu, nu, hyper, decay, local, mesh, tuning=tuning,
                                     interpret=interpret, remainder=r))  # fmt: skip
        elif r is not None:
            out.append(adam_update.leaf_reference_parts(p, r, g, mu, nu, hyper, decay))
        else:
            out.append(adam_update.leaf_reference(p, g, mu, nu, hyper, decay))
    k = 1 if remainder is None else 2
    new_state = adam.from_moments(
        state, treedef, adam_update.unless(skip, state.count, count_inc), [o[k] for o in out],
        [o[k + 1] for o in out],
    )  # fmt: skip
    new_params = treedef.unflatten([o[0] for o in out])
    if remainder is None:
        return new_params, new_state
    return new_params, treedef.unflatten([o[1] for o in out]), new_state
