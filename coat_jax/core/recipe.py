"""The FP8 recipe: one object that says how a model computes in FP8.

=====================  =========  ===========================================================
field                  default    meaning
=====================  =========  ===========================================================
``forward_format``     ``e4m3``   FP8 format of forward GEMM operands (activations, weights),
                                  scaled per tensor just in time
``grad_format``        ``e5m2``   FP8 format of output gradients as GEMM operands (per tensor)
``saved_format``       ``e4m3``   FP8 format of the inputs non-linear layers save for backward
``saved_group``        ``16``     their scaling group along the hidden axis (COAT's 1x16)
``scaling``            ``tensor`` scales of GEMM operands: ``tensor`` (one per tensor), ``row`` (one
                                  per row of each operand) or ``block`` (1x128 activation and
                                  gradient tiles, 128x128 weight blocks, fp32 promotion every
                                  128 of K: DeepSeek-V3); :mod:`coat_jax.ops.scaled_gemm`
``forward_gemm``       ``fp8``    ``fp8``: forward GEMMs in FP8 as above; ``bf16``: forward GEMMs in
                                  BF16 and only the backward's (``dx``, ``dW``: two thirds of
                                  the FLOPs) in FP8; saved activations stay FP8 either way
``gemm``               ``xla``    GEMM backend: ``xla`` (FP8 codes into ``dot_general``, XLA's
                                  cuBLASLt FP8 call on Hopper), ``pallas`` (the Mosaic GPU
                                  kernel, Hopper only; on each shard under a mesh), ``auto``
                                  (Pallas for the shapes measured faster,
                                  ``pallas_kernels.dispatch``)
``gemm_product``       ``fp32``   what XLA's cuBLASLt FP8 GEMM writes before the two scales
                                  multiply its product: ``fp32`` (one rounding, to the output
                                  dtype after the scales) or ``bf16`` (a BF16 product, scaled
                                  and cast by its consumer: half the bytes written and read
                                  back, one more rounding; ``bench/fp8_epilogue.py``: XLA
                                  never joins the scales and a BF16 output to the FP8 call)
``pow2_scales``        ``False``  round each per-tensor GEMM operand's scale up to a power of
                                  two (:func:`coat_jax.core.quant.pow2_amax`): scaling is then
                                  exact, and a BF16 ``gemm_product`` rounds exactly where the
                                  fp32 one does (per-tensor scaling only)
``gemm_autotune``      ``True``   let the Pallas GEMM time its tile configs on eager calls
``fused_quantize``     ``auto``   the COAT norm and SwiGLU forwards as two Pallas passes that
                                  quantize inside the op (``pallas_kernels.fused_quantize``;
                                  per-tensor FP8 forward GEMMs; per shard under a mesh):
                                  ``auto`` (where measured faster,
                                  ``pallas_kernels.dispatch``), ``pallas``, ``interpret`` or
                                  ``reference`` (the XLA ops)
``fused_mlp``          ``auto``   COAT's MLP as one op whose gate and up GEMMs quantize their
                                  products into SwiGLU's saved 1x16 FP8 groups in the GEMM's
                                  epilogue (:func:`coat_jax.ops.flow.fp8_mlp`; per-tensor FP8
                                  forward GEMMs, E4M3 1x16 saved groups): ``auto`` (where
                                  measured faster, ``pallas_kernels.dispatch``), ``pallas``
                                  (the Mosaic GPU kernel, Hopper only), ``interpret`` (the
                                  fused op with the kernel's jnp reference: Mosaic GPU kernels
                                  have no interpret mode) or ``reference`` (the norm-project
                                  and SwiGLU-project ops, unfused)
``fused_backward``     ``auto``   SwiGLU's and the norms' backwards as one Pallas pass each
                                  over their saved 1x16 groups and the next projection's input
                                  gradient: the weight-gradient operand, the input gradients
                                  and their maxima, the norm weight's gradient
                                  (``pallas_kernels.fused_backward``; per-tensor scaling; per
                                  shard under a mesh): ``auto`` (where measured faster,
                                  ``pallas_kernels.dispatch``), ``pallas``, ``interpret`` or
                                  ``reference`` (the XLA ops)
``grad_transpose``     ``auto``   each output gradient's FP8 GEMM operands (``grad_format``, per
                                  tensor) in both layouts the backward's GEMMs read, row-major
                                  for ``dx = dy W^T`` and K-major (``dy^T``) for ``dW = x^T dy``,
                                  from one Pallas pass over ``dy``
                                  (``pallas_kernels.quantize.quantize_transpose_per_tensor``;
                                  per shard under a mesh): ``auto`` (where measured faster,
                                  ``pallas_kernels.dispatch``), ``pallas``, ``interpret`` or
                                  ``reference`` (XLA's quantize and transpose fusions)
``triton_gemm``        ``False``  let XLA compile dots as Triton fusions on a GPU
``saved_weights``      ``fp8``    what backward reads of per-tensor FP8 weights: ``fp8`` (the
                                  forward's codes, kept: 1 byte a parameter held from each
                                  layer's forward to its backward, all layers' at once when
                                  backward starts) or ``requantize`` (the weights, which the
                                  step holds anyway, quantized again with the forward's
                                  ``amax``: same codes, one more read of the weights a step)
=====================  =========  ===========================================================

The precision policies (``coat_jax.models.policy``) hold a recipe; the FP8 ops
(``coat_jax.ops.flow``) and kernels read it; ``config.fp8`` sets it for a training run.
:meth:`Fp8Recipe.compiler_options` gives the XLA options a step compiled with FP8 GEMMs needs:
with ``triton_gemm=False`` every FP8 dot goes to cuBLASLt on a GPU (docs/history.md, 2026-11-30:
Triton's FP8 GEMM fusions made the sharded 7B step compile for minutes or run 17x slower).
"""

from __future__ import annotations

import dataclasses

import jax

from coat_jax.core.formats import Fp8Format, get_format

__all__ = ["ACT_GROUP", "FORWARD_GEMMS", "GEMM_BACKENDS", "GEMM_PRODUCTS", "KERNEL_OPTIONS",
           "SAVED_WEIGHTS", "SCALINGS", "Fp8Recipe"]  # fmt: skip

ACT_GROUP = 16
"""COAT's group size for FP8 inputs of non-linear layers (1x16 along the hidden axis)."""

GEMM_BACKENDS = ("xla", "pallas", "auto")
SCALINGS = ("tensor", "row", "block")
FORWARD_GEMMS = ("fp8", "bf16")
SAVED_WEIGHTS = ("fp8", "requantize")
GEMM_PRODUCTS = ("fp32", "bf16")
KERNEL_OPTIONS = ("auto", "pallas", "reference", "interpret")
"""Where a Pallas kernel family runs (``pallas_kernels.dispatch.resolve``)."""


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """Formats, group size, GEMM backend and compiler options of an FP8 computation (see the
    module docstring for each field). Frozen and hashable: FP8 ops take it as a static
    argument. Raises ``ValueError`` naming the field on a bad value."""

    forward_format: str = "e4m3"
    grad_format: str = "e5m2"
    saved_format: str = "e4m3"
    saved_group: int = ACT_GROUP
    scaling: str = "tensor"
    forward_gemm: str = "fp8"
    gemm: str = "xla"
    gemm_product: str = "fp32"
    pow2_scales: bool = False
    gemm_autotune: bool = True
    fused_quantize: str = "auto"
    fused_mlp: str = "auto"
    fused_backward: str = "auto"
    grad_transpose: str = "auto"
    triton_gemm: bool = False
    saved_weights: str = "fp8"

    def __post_init__(self):
        for name in ("forward_format", "grad_format", "saved_format"):
            try:
                get_format(getattr(self, name))
            except ValueError as e:
                raise ValueError(f"Fp8Recipe.{name}: {e}") from None
        group = self.saved_group
        if isinstance(group, bool) or not isinstance(group, int) or group <= 0:
            raise ValueError(f"Fp8Recipe.saved_group must be a positive int, got {group!r}")
        if self.scaling not in SCALINGS:
            raise ValueError(f"Fp8Recipe.scaling={self.scaling!r}: expected one of {SCALINGS}")
        if self.forward_gemm not in FORWARD_GEMMS:
            raise ValueError(
                f"Fp8Recipe.forward_gemm={self.forward_gemm!r}: expected one of {FORWARD_GEMMS}"
            )
        if self.gemm not in GEMM_BACKENDS:
            raise ValueError(f"Fp8Recipe.gemm={self.gemm!r}: expected one of {GEMM_BACKENDS}")
        if self.gemm_product not in GEMM_PRODUCTS:
            raise ValueError(
                f"Fp8Recipe.gemm_product={self.gemm_product!r}: expected one of {GEMM_PRODUCTS}"
            )
        for name in ("fused_quantize", "fused_mlp", "fused_backward", "grad_transpose"):
            if getattr(self, name) not in KERNEL_OPTIONS:
                raise ValueError(
                    f"Fp8Recipe.{name}={getattr(self, name)!r}: expected one of {KERNEL_OPTIONS}"
                )
        if self.saved_weights not in SAVED_WEIGHTS:
            raise ValueError(
                f"Fp8Recipe.saved_weights={self.saved_weights!r}: expected one of {SAVED_WEIGHTS}"
            )
        for name in ("gemm_autotune", "triton_gemm", "pow2_scales"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Fp8Recipe.{name} must be a bool, got {getattr(self, name)!r}")
        if self.pow2_scales and self.scaling != "tensor":
            raise ValueError(
                f"Fp8Recipe.pow2_scales rounds per-tensor scales; scaling={self.scaling!r} has none"
            )

    @property
    def forward(self) -> Fp8Format:
        return get_format(self.forward_format)

    @property
    def grad(self) -> Fp8Format:
        return get_format(self.grad_format)

    @property
    def saved(self) -> Fp8Format:
        return get_format(self.saved_format)

    def compiler_options(self) -> dict | None:
        """XLA options for a step with this recipe's GEMMs: on a GPU without ``triton_gemm``,
        ``xla_gpu_enable_triton_gemm=False``; ``None`` (XLA's defaults) elsewhere."""
        if self.triton_gemm or jax.default_backend() != "gpu":
            return None
        return {"xla_gpu_enable_triton_gemm": False}
