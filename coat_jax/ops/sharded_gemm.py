r"""The Pallas per-tensor FP8 GEMM on every device's shard of a multi-device mesh.

:func:`pallas_kernels.fp8_matmul.fp8_dot_general` is one kernel on one device; XLA cannot
partition it. Under a mesh (``jax.set_mesh``) :func:`dot_general` runs it inside
``jax.shard_map`` with specs from the GEMM's role in a projection (``T`` tokens, a weight
``(K, N)``; the mesh's ``(data, fsdp)`` axes split the tokens as
:data:`coat_jax.ops.sharding.RULES` ``"batch"`` does, ``tensor`` the weight's free axis):

===========================  ===========================  ==================================
GEMM (``contract``)          operand specs                 on each device
===========================  ===========================  ==================================
``x W``, ``dy W^T``          ``a``: ``(T/rows, K)``;      its tokens' rows times the whole
(``a``'s last axis)          ``b``: gathered along the     contracted axis of the weight,
                             contracted axis, free axis    its ``tensor`` slice of the free
                             split over ``tensor``         axis; no reduction
``x^T dy`` (both axis 0)     ``a``: ``(T/rows, K/tensor)``  a partial sum over its tokens,
                             ``b``: ``(T/rows, N)``         ``psum`` over ``(data, fsdp)``
===========================  ===========================  ==================================

An axis that does not divide (:func:`coat_jax.ops.sharding.fits`) is not split: those devices
compute the same rows. The weight gradient's partial sums are reduced in ``out_dtype`` when
``partials_in_out_dtype`` (BF16 weight gradients: a BF16 all-reduce, as the XLA path's BF16
reduce-scatter), else in fp32 and cast after. :func:`local_shape` is the ``(M, K, N)`` each
device's kernel sees: the shape the GEMM dispatch table is keyed by.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from coat_jax.ops import sharding
from pallas_kernels import dispatch, fp8_matmul

__all__ = ["dot_general", "local_shape"]


def _axis(mesh, axis, size: int):
    """``axis`` (a name or a tuple of names) restricted to ``mesh``'s axes of more than one
    device, if ``size`` splits evenly over it; else ``None``."""
    names = axis if isinstance(axis, tuple) else (axis,)
    names = tuple(n for n in names if n in mesh.axis_names and mesh.shape[n] > 1)
    if not names:
        return None
    names = names if len(names) > 1 else names[0]
    return sharding.fits(mesh, names, size)


def _plan(mesh, a_shape, b_shape, contract):
    """``(a spec, b spec, out spec, axes to psum over)`` of the 2-D operands (``a`` flattened
    to ``(rows, K)`` where its contracted axis is last); ``None`` for a GEMM that is neither a
    projection (``a``'s last axis with a 2-D weight) nor a weight gradient (axis 0 of two
    matrices)."""
    P = jax.sharding.PartitionSpec
    ca, cb = contract
    if ca == len(a_shape) - 1 and len(b_shape) == 2:  # x W or dy W^T: a's rows are tokens
        rows = _axis(mesh, sharding.RULES["batch"], math.prod(a_shape[:-1]))
        free = 1 - cb
        col = _axis(mesh, "tensor", b_shape[free])
        b_spec = P(None, col) if free == 1 else P(col, None)
        return P(rows, None), b_spec, P(rows, col), None
    if (ca, cb) == (0, 0) and len(a_shape) == len(b_shape) == 2:  # x^T dy: tokens contracted
        rows = _axis(mesh, sharding.RULES["batch"], a_shape[0])
        col = _axis(mesh, "tensor", a_shape[1])
        return P(rows, col), P(rows, None), P(col, None), rows
    return None  # neither a projection nor a weight gradient: no per-shard plan


def _local(size: int, mesh, axis) -> int:
    if axis is None:
        return size
    names = axis if isinstance(axis, tuple) else (axis,)
    return size // math.prod(mesh.shape[n] for n in names)


def local_shape(a_shape, b_shape, contract) -> tuple[int, int, int]:
    """``(M, K, N)`` of the kernel each device runs for ``a`` x ``b`` (``contract``: one axis
    of each) under the mesh in context; the whole GEMM's without a multi-device mesh;
    ``None`` under one for a GEMM with no per-shard plan (:func:`dot_general` refuses it)."""
    ca, cb = contract[0] % len(a_shape), contract[1] % len(b_shape)
    k = a_shape[ca]
    m, n = math.prod(a_shape) // max(k, 1), math.prod(b_shape) // max(k, 1)
    mesh = dispatch.multi_device_mesh()
    if mesh is None:
        return m, k, n
    plan = _plan(mesh, a_shape, b_shape, (ca, cb))
    if plan is None:
        return None
    a_spec, b_spec, _, _ = plan
    if ca == len(a_shape) - 1:
        return (_local(m, mesh, a_spec[0]), k,
                _local(n, mesh, b_spec[1 - cb]))  # fmt: skip
    return _local(m, mesh, a_spec[1]), _local(k, mesh, a_spec[0]), n


def dot_general(
    a_codes, b_codes, scale, contract: tuple[int, int], out_dtype, *,
    autotune: bool = True, partials_in_out_dtype: bool = False,
) -> jax.Array:  # fmt: skip
    """``scale * sum_k a[..., k, ...] b[..., k, ...]`` through the Pallas FP8 GEMM: on one
    device directly, under a multi-device mesh on every device's shard (module docstring).
    Result axes: ``a``'s kept axes then ``b``'s, in ``out_dtype``."""
    mesh = dispatch.multi_device_mesh()
    ca, cb = contract[0] % a_codes.ndim, contract[1] % b_codes.ndim
    if mesh is None:
        return fp8_matmul.fp8_dot_general(a_codes, b_codes, scale, (ca, cb), out_dtype,
                                          autotune=autotune)  # fmt: skip
    plan = _plan(mesh, a_codes.shape, b_codes.shape, (ca, cb))
    if plan is None:
        raise ValueError(
            f"the Pallas FP8 GEMM under a {mesh.size}-device mesh: contract={contract} of "
            f"{a_codes.shape} x {b_codes.shape} is neither a projection (a's last axis, a 2-D "
            "weight) nor a weight gradient (axis 0 of two matrices); use fp8.gemm='xla'"
        )
    a_spec, b_spec, out_spec, reduce_over = plan
    lead = a_codes.shape[:-1] if ca == a_codes.ndim - 1 else None
    a2 = a_codes.reshape(-1, a_codes.shape[-1]) if lead is not None else a_codes
    local_dtype = out_dtype if reduce_over is None or partials_in_out_dtype else jnp.float32

    def local(a, b, scale):
        contract2 = (1 if lead is not None else 0, cb)
        out = fp8_matmul.fp8_dot_general(a, b, scale, contract2, local_dtype,
                                         autotune=autotune)  # fmt: skip
        return out if reduce_over is None else jax.lax.psum(out, reduce_over)

    P = jax.sharding.PartitionSpec
    out = jax.shard_map(local, mesh=mesh, in_specs=(a_spec, b_spec, P()), out_specs=out_spec,
                        check_vma=False)(a2, b_codes, jnp.asarray(scale, jnp.float32))  # fmt: skip
    out = out.astype(out_dtype)
    return out.reshape(*lead, out.shape[-1]) if lead is not None else out
