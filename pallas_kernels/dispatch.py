"""When compiled Pallas kernels may run: one rule for every kernel family and optimizer option.

The kernels are written for, and tested on, NVIDIA Hopper (compute capability 9.x: H100,
H200, H800, GH200). Compiled kernels run only when JAX's default backend is ``gpu`` and every
local device is a Hopper part; everywhere else the jnp references in :mod:`coat_jax` run, and
``interpret=True`` runs the kernels' own bodies on any backend (tests on the CPU).

``kernels=`` options, as taken by :func:`coat_jax.scale_by_fp8_adam` and friends:

* ``"pallas"``: the compiled kernel; a ``ValueError`` off Hopper.
* ``"interpret"``: the kernel in Pallas interpret mode (slow; for tests and debugging).
* ``"reference"``: the XLA-compiled jnp reference.
* ``"auto"``: the compiled kernel on Hopper *if a GPU measurement says it beats the reference*
  (:data:`AUTO_USES_KERNEL`), else the reference.

Shapes a kernel cannot tile (a ragged last axis, a group size that is not a power of two) fall
back to the reference inside each family's wrapper, without error, whatever the mode.
"""

from __future__ import annotations

import jax

__all__ = ["AUTO_USES_KERNEL", "KERNEL_OPTIONS", "check_compiled", "hopper_gpu", "resolve"]

KERNEL_OPTIONS = ("auto", "pallas", "reference", "interpret")

AUTO_USES_KERNEL: dict[str, bool] = {
    # H200, jax 0.11.2, bench/optimizer.py, 1.01B params (2026-11-30): the first fused moment
    # kernel took 31.5 ms against the XLA reference's 17.9 ms. Rewritten since (one group per
    # tile row, exp2 forms, hoisted per-group math); flip after bench/optimizer.py shows it faster.
    "adam_step": False,
    # The full AdamW update (pallas_kernels/adam_update.py), H200, jax 0.11.2, 1.01B params
    # (bench/results/optimizer_h200_2026-11-30.json): 9.37 ms against its XLA reference's
    # 16.32 ms (and optax.adamw's 7.61 ms with fp32 moments); compiled tests pass there.
    "adam_update": True,
}
"""Per kernel family, whether ``kernels="auto"`` picks the compiled kernel on a Hopper GPU.
Flip an entry only with a GPU measurement showing the kernel faster, and cite it above."""

_HOPPER_KINDS = ("h100", "h200", "h800", "gh200")


def _is_hopper(device) -> bool:
    cc = getattr(device, "compute_capability", None)
    if cc:
        return str(cc).split(".")[0] == "9"
    return any(name in str(getattr(device, "device_kind", "")).lower() for name in _HOPPER_KINDS)


def hopper_gpu(devices=None) -> bool:
    """Whether compiled kernels may run: the default backend is ``gpu`` and every device in
    ``devices`` (default: ``jax.local_devices()``) is a Hopper GPU, known by its compute
    capability 9.x or, where a runtime does not report one, by its ``device_kind``."""
    if jax.default_backend() != "gpu":
        return False
    devices = jax.local_devices() if devices is None else devices
    return bool(devices) and all(_is_hopper(d) for d in devices)


def resolve(kernels: str, family: str) -> str:
    """Maps a ``kernels=`` option to ``"pallas"``, ``"interpret"`` or ``"reference"``.

    Args:
      kernels: one of :data:`KERNEL_OPTIONS`.
      family: a key of :data:`AUTO_USES_KERNEL`.

    Raises:
      ValueError: an unknown option or family, or ``"pallas"`` off a Hopper GPU.
    """
    if kernels not in KERNEL_OPTIONS:
        raise ValueError(f"kernels={kernels!r}: expected one of {', '.join(KERNEL_OPTIONS)}")
    if family not in AUTO_USES_KERNEL:
        raise ValueError(f"unknown kernel family {family!r}")
    if kernels == "pallas" and not hopper_gpu():
        raise ValueError("kernels='pallas' needs a Hopper GPU; use 'auto' or 'interpret'")
    if kernels == "auto":
        return "pallas" if AUTO_USES_KERNEL[family] and hopper_gpu() else "reference"
    return kernels


def check_compiled(interpret: bool, who: str) -> None:
    """Raises ``ValueError`` when ``who`` is asked to compile a kernel off a Hopper GPU."""
    if not interpret and not hopper_gpu():
        raise ValueError(
            f"{who} compiles for a Hopper GPU, not {jax.default_backend()}; pass "
            "interpret=True to run the kernel here, or use the coat_jax reference"
        )
