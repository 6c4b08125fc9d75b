"""Precision policies: the one object a layer asks for its precision-sensitive ops.

A policy answers three questions for a Llama block, so that one model code path serves every
recipe and layers never branch on recipe names:

* ``norm_project(x, norm_scale, kernels, eps)``: ``rmsnorm(x) @ W_i`` for each kernel,
* ``project(x, kernel)``: ``x @ W``,
* ``swiglu_project(gate, up, kernel)``: ``(silu(gate) * up) @ W``.

================  ==================================  =========================================
policy            GEMMs                               saved for backward
================  ==================================  =========================================
``bf16``          BF16 operands, fp32 accumulation    BF16 inputs of every op
``fp8_linear``    FP8 (E4M3 fwd, E5M2 grads)          FP8 GEMM inputs, BF16 norm/SwiGLU inputs
                                                      (TransformerEngine-like)
``coat``          FP8 (E4M3 fwd, E5M2 grads)          FP8 1x16 norm and SwiGLU inputs; GEMM
                                                      operands recomputed from them (COAT)
================  ==================================  =========================================

Embedding, attention core, final norm, LM head and loss stay BF16/fp32 in every policy.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from coat_jax import flow

__all__ = ["POLICIES", "Bf16Policy", "CoatPolicy", "Fp8LinearPolicy", "Policy", "get_policy"]


def _bf16_dot(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """``x @ kernel`` in ``x.dtype`` (BF16 operands and output, fp32 accumulation on GPU)."""
    return jnp.dot(x, kernel.astype(x.dtype))


@dataclasses.dataclass(frozen=True)
class Policy:
    """Base policy: BF16 GEMMs and BF16 saved activations (the baseline)."""

    name: str = "bf16"

    def norm_project(self, x, norm_scale, kernels, eps):
        y = flow.rmsnorm(x, norm_scale, eps)
        return tuple(_bf16_dot(y, w) for w in kernels)

    def project(self, x, kernel):
        return _bf16_dot(x, kernel)

    def swiglu_project(self, gate, up, kernel):
        return _bf16_dot(flow.swiglu(gate, up), kernel)


Bf16Policy = Policy


@dataclasses.dataclass(frozen=True)
class Fp8LinearPolicy(Policy):
    """FP8 GEMMs that save their FP8 input; norms and SwiGLU save BF16 (TransformerEngine-like)."""

    name: str = "fp8_linear"

    def norm_project(self, x, norm_scale, kernels, eps):
        return flow.fp8_project(flow.rmsnorm(x, norm_scale, eps), tuple(kernels))

    def project(self, x, kernel):
        return flow.fp8_project(x, (kernel,))[0]

    def swiglu_project(self, gate, up, kernel):
        return flow.fp8_project(flow.swiglu(gate, up), (kernel,))[0]


@dataclasses.dataclass(frozen=True)
class CoatPolicy(Fp8LinearPolicy):
    """COAT's FP8 precision flow: norm and SwiGLU inputs saved as FP8 1x16 groups."""

    name: str = "coat"

    def norm_project(self, x, norm_scale, kernels, eps):
        return flow.fp8_norm_project(x, norm_scale, tuple(kernels), eps)

    def swiglu_project(self, gate, up, kernel):
        return flow.fp8_swiglu_project(gate, up, kernel)


POLICIES = {p.name: p for p in (Bf16Policy(), Fp8LinearPolicy(), CoatPolicy())}


def get_policy(policy: str | Policy) -> Policy:
    """The policy named ``"bf16"``, ``"fp8_linear"`` or ``"coat"`` (or ``policy`` itself)."""
    if isinstance(policy, Policy):
        return policy
    if policy not in POLICIES:
        raise ValueError(f"unknown precision policy {policy!r}; expected one of {sorted(POLICIES)}")
    return POLICIES[policy]
