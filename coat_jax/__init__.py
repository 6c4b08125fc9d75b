"""coat-jax: memory-efficient FP8 training for JAX (COAT, arXiv 2410.19313).

Public API:

* :func:`fp8_adamw`, :func:`scale_by_fp8_adam`: optax optimizers whose Adam moments are FP8
  with per-group dynamic range expansion; :func:`fused_fp8_adamw_update`: the same update and
  ``optax.apply_updates`` in one pass (Pallas on Hopper, for trainers that own the step).
* :func:`master_weights`: any optax transformation with BF16 parameters and the fp32 master
  weights' remainders (16 bits: exact) in its state.
* :func:`fp8_state`, :class:`Fp8WrappedState`: any optax transformation (``optax.adam``,
  ``optax.lion``, ...) with its parameter-shaped float state stored in FP8.
* :func:`quantize`, :func:`dequantize`, :class:`QuantizedArray`: FP8 quantization per tensor or
  per group along the last axis, as a pytree.
* :data:`E4M3`, :data:`E5M2`, :func:`get_format`: the FP8 formats; :class:`Fp8Recipe`: how a
  model computes in FP8 (formats, group size, GEMM backend).

The package is layered, each layer importing only those below it (``tests/test_layers.py``):
``coat_jax.core`` (math, state types, recipe) <- ``pallas_kernels`` <- ``coat_jax.ops`` (FP8
ops, optimizers, sharding) <- ``coat_jax.models`` <- ``coat_jax.training`` <- ``train.py``,
``coat_jax.tools``, ``bench/``. The names above load on first use, so that importing a low
layer (a kernel, say) never loads this package's higher layers.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_PUBLIC = {
    "DEFAULT_GROUP_SIZE": "coat_jax.ops.options",
    "DEFAULT_MIN_SIZE": "coat_jax.ops.options",
    "E4M3": "coat_jax.core.formats",
    "E5M2": "coat_jax.core.formats",
    "Fp8Format": "coat_jax.core.formats",
    "Fp8Recipe": "coat_jax.core.recipe",
    "Fp8WrappedState": "coat_jax.ops.fp8_state",
    "QuantizedArray": "coat_jax.core.quant",
    "ScaleByFp8AdamState": "coat_jax.core.adam",
    "dequantize": "coat_jax.core.quant",
    "fp8_adamw": "coat_jax.ops.optim",
    "fp8_state": "coat_jax.ops.fp8_state",
    "fused_fp8_adamw_update": ("coat_jax.ops.fused_update", "fp8_adamw_update"),
    "get_format": "coat_jax.core.formats",
    "master_weights": "coat_jax.ops.master_weights",
    "quantize": "coat_jax.core.quant",
    "scale_by_fp8_adam": "coat_jax.ops.optim",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'coat_jax' has no attribute {name!r}")
    module, attr = _PUBLIC[name] if isinstance(_PUBLIC[name], tuple) else (_PUBLIC[name], name)
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted([*globals(), *_PUBLIC])
