"""coat-jax: memory-efficient FP8 training for JAX (COAT, arXiv 2410.19313).

Public API:

* :func:`fp8_adamw`, :func:`scale_by_fp8_adam`: optax optimizers whose Adam moments are FP8
  with per-group dynamic range expansion; :func:`fused_fp8_adamw_update`: the same update and
  ``optax.apply_updates`` in one pass (Pallas on Hopper, for trainers that own the step).
* :func:`quantize`, :func:`dequantize`, :class:`QuantizedArray`: FP8 quantization per tensor or
  per group along the last axis, as a pytree.
* :data:`E4M3`, :data:`E5M2`, :func:`get_format`: the FP8 formats.
"""

from coat_jax.formats import E4M3, E5M2, Fp8Format, get_format
from coat_jax.optim import (
    DEFAULT_MIN_SIZE,
    ScaleByFp8AdamState,
    fp8_adamw,
    fused_fp8_adamw_update,
    scale_by_fp8_adam,
)
from coat_jax.quant import QuantizedArray, dequantize, quantize

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MIN_SIZE",
    "E4M3",
    "E5M2",
    "Fp8Format",
    "QuantizedArray",
    "ScaleByFp8AdamState",
    "dequantize",
    "fp8_adamw",
    "fused_fp8_adamw_update",
    "get_format",
    "quantize",
    "scale_by_fp8_adam",
]
