"""Precision policies: the one object a layer asks for its precision-sensitive ops.

A policy answers three questions for a Llama block, so that one model code path serves every
recipe and layers never branch on recipe names:

* ``norm_project(x, norm_scale, kernels, eps, kind)``: ``norm(x) @ W_i`` for each kernel, the
  norm being RMSNorm (``kind="rms"``) or OLMo's weightless LayerNorm (``"layer"``,
  ``norm_scale=None``; :func:`coat_jax.ops.plain.norm`),
* ``project(x, kernel)``: ``x @ W``,
* ``swiglu_project(gate, up, kernel)``: ``(silu(gate) * up) @ W``,

and says how its train step compiles (:meth:`Policy.compiler_options`).

================  ==================================  =========================================
policy            GEMMs                               saved for backward
================  ==================================  =========================================
``fp32``          fp32 operands and accumulation      fp32 inputs of every op (the reference
                  (``HIGHEST`` precision: no TF32)    of fidelity runs; everything in fp32)
``bf16``          BF16 operands, fp32 accumulation    BF16 inputs of every op
``fp8_linear``    FP8 (E4M3 fwd, E5M2 grads)          FP8 GEMM inputs, BF16 norm/SwiGLU inputs
                                                      (TransformerEngine-like)
``coat``          FP8 (E4M3 fwd, E5M2 grads)          FP8 1x16 norm and SwiGLU inputs; GEMM
                                                      operands recomputed from them (COAT)
================  ==================================  =========================================

The FP8 policies carry an :class:`~coat_jax.core.recipe.Fp8Recipe` (formats, group size, GEMM
backend, operand scaling; the table shows the default). Embedding, attention core, final norm,
LM head and loss stay BF16/fp32 in every policy but ``fp32``, which computes everything in fp32
(:attr:`Policy.compute_dtype`, :attr:`Policy.matmul_precision`); the head's backward GEMMs read
the loss gradient rounded to BF16 (:func:`coat_jax.ops.plain.head_logits`).
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp

from coat_jax.core.recipe import Fp8Recipe
from coat_jax.ops import flow, plain

__all__ = [
    "POLICIES",
    "Bf16Policy",
    "CoatPolicy",
    "Fp32Policy",
    "Fp8LinearPolicy",
    "Policy",
    "get_policy",
]


def _bf16_dot(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """``x @ kernel`` in ``x.dtype`` (BF16 operands and output, fp32 accumulation on GPU)."""
    return jnp.dot(x, kernel.astype(x.dtype))


@dataclasses.dataclass(frozen=True)
class Policy:
    """Base policy: BF16 GEMMs and BF16 saved activations (the baseline).

    Attributes:
      name: the policy's name (``config.precision``).
      recipe: the FP8 recipe; the BF16 policy does not use it.
      compute_dtype: dtype of the activations between ops (the model casts the embedding
        output to it).
      matmul_precision: ``jax.default_matmul_precision`` the model is traced under (``None``:
        JAX's default, TF32 for fp32 dots on a GPU).
    """

    name: str = "bf16"
    recipe: Fp8Recipe = Fp8Recipe()
    compute_dtype: jnp.dtype = jnp.dtype(jnp.bfloat16)
    matmul_precision: str | None = None

    def precision_scope(self):
        """The context the model's forward (and so its backward) is traced in."""
        if self.matmul_precision is None:
            return contextlib.nullcontext()
        return jax.default_matmul_precision(self.matmul_precision)

    def norm_project(self, x, norm_scale, kernels, eps, kind="rms"):
        y = plain.norm(x, norm_scale, eps, kind)
        return tuple(_bf16_dot(y, w) for w in kernels)

    def project(self, x, kernel):
        return _bf16_dot(x, kernel)

    def swiglu_project(self, gate, up, kernel):
        return _bf16_dot(plain.swiglu(gate, up), kernel)

    def mlp(self, x, norm_scale, w_gate, w_up, w_down, eps, kind="rms"):
        """The pre-norm SwiGLU MLP: :meth:`norm_project` to gate and up, then
        :meth:`swiglu_project` (a policy may run it as one op)."""
        gate, up = self.norm_project(x, norm_scale, (w_gate, w_up), eps, kind)
        return self.swiglu_project(gate, up, w_down)

    def compiler_options(self) -> dict | None:
        """XLA options for a train step of this policy (``jax.jit(compiler_options=...)``):
        XLA's defaults for BF16."""
        return None


Bf16Policy = Policy


@dataclasses.dataclass(frozen=True)
class Fp32Policy(Policy):
    """Everything in fp32 with full-precision dots (``HIGHEST``: no TF32 or BF16 passes on a
    GPU): the reference fidelity runs measure the other policies against."""

    name: str = "fp32"
    compute_dtype: jnp.dtype = jnp.dtype(jnp.float32)
    matmul_precision: str | None = "highest"


@dataclasses.dataclass(frozen=True)
class Fp8LinearPolicy(Policy):
    """FP8 GEMMs that save their FP8 input; norms and SwiGLU save BF16 (TransformerEngine-like)."""

    name: str = "fp8_linear"

    def norm_project(self, x, norm_scale, kernels, eps, kind="rms"):
        y = plain.norm(x, norm_scale, eps, kind)
        return flow.fp8_project(y, tuple(kernels), self.recipe)

    def project(self, x, kernel):
        return flow.fp8_project(x, (kernel,), self.recipe)[0]

    def swiglu_project(self, gate, up, kernel):
        return flow.fp8_project(plain.swiglu(gate, up), (kernel,), self.recipe)[0]

    def compiler_options(self) -> dict | None:
        """The recipe's (:meth:`Fp8Recipe.compiler_options`: cuBLASLt-only GEMMs on a GPU)."""
        return self.recipe.compiler_options()


@dataclasses.dataclass(frozen=True)
class CoatPolicy(Fp8LinearPolicy):
    """COAT's FP8 precision flow: norm and SwiGLU inputs saved as FP8 1x16 groups."""

    name: str = "coat"

    def norm_project(self, x, norm_scale, kernels, eps, kind="rms"):
        return flow.fp8_norm_project(x, norm_scale, tuple(kernels), eps, self.recipe, kind)

    def swiglu_project(self, gate, up, kernel):
        return flow.fp8_swiglu_project(gate, up, kernel, self.recipe)

    def mlp(self, x, norm_scale, w_gate, w_up, w_down, eps, kind="rms"):
        return flow.fp8_mlp(x, norm_scale, w_gate, w_up, w_down, eps, self.recipe, kind)


POLICIES = {p.name: p for p in (Fp32Policy(), Bf16Policy(), Fp8LinearPolicy(), CoatPolicy())}


def get_policy(policy: str | Policy, recipe: Fp8Recipe | None = None) -> Policy:
    """The policy named ``"fp32"``, ``"bf16"``, ``"fp8_linear"`` or ``"coat"`` (or ``policy``
    itself), with ``recipe`` when given."""
    if not isinstance(policy, Policy):
        if policy not in POLICIES:
            raise ValueError(
                f"unknown precision policy {policy!r}; expected one of {sorted(POLICIES)}"
            )
        policy = POLICIES[policy]
    return policy if recipe is None else dataclasses.replace(policy, recipe=recipe)
