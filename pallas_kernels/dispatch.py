"""When compiled Pallas kernels may run: one rule for every kernel family and optimizer option,
and where a per-tensor FP8 GEMM runs for an FP8 recipe's ``gemm`` (:func:`gemm_backend`).

The kernels are written for, and tested on, NVIDIA Hopper (compute capability 9.x: H100,
H200, H800, GH200). Compiled kernels run only when JAX's default backend is ``gpu`` and every
local device is a Hopper part; everywhere else the jnp references in :mod:`coat_jax` run, and
``interpret=True`` runs the kernels' own bodies on any backend (tests on the CPU).

``kernels=`` options, as taken by :func:`coat_jax.scale_by_fp8_adam` and friends:

* ``"pallas"``: the compiled kernel; a ``ValueError`` off Hopper.
* ``"interpret"``: the kernel in Pallas interpret mode (slow; for tests and debugging).
* ``"reference"``: the XLA-compiled jnp reference.
* ``"auto"``: the compiled kernel on Hopper *if a GPU measurement says it beats the reference*
  (:data:`AUTO_USES_KERNEL`; some families on one device only, :data:`AUTO_ONE_DEVICE`), else
  the reference.

Shapes a kernel cannot tile (a ragged last axis, a group size that is not a power of two) fall
back to the reference inside each family's wrapper, without error, whatever the mode.
"""

from __future__ import annotations

import jax

from coat_jax.core.recipe import GEMM_BACKENDS, KERNEL_OPTIONS

__all__ = [
    "AUTO_ONE_DEVICE",
    "AUTO_USES_KERNEL",
    "GEMM_AUTO_USES_KERNEL",
    "GEMM_PALLAS_FASTER",
    "KERNEL_OPTIONS",
    "check_compiled",
    "gemm_backend",
    "hopper_gpu",
    "multi_device_mesh",
    "resolve",
    "unseen_sharding",
]

AUTO_USES_KERNEL: dict[str, bool] = {
    # The fused moment kernel (pallas_kernels/adam_step.py), H200, jax 0.11.2, 1.01B params
    # (bench/results/optimizer_h200_2026-11-30.json): 14.31 ms against the XLA reference's
    # 16.45 ms; compiled tests pass there.
    "adam_step": True,
    # The full AdamW update (pallas_kernels/adam_update.py), same run: 9.37 ms against its
    # XLA reference's 16.32 ms; compiled tests pass there.
    "adam_update": True,
    # The same kernel reading and writing BF16 master weights' parts, H200, jax 0.11.2, 1.01B
    # params (bench/results/optimizer_master_h200_2026-12-01.json): 9.92 ms (16-bit remainder;
    # 8-bit 10.17) against 14.37 ms for fp32 rebuilt around the kernel above. Its compiled
    # tests (tests/test_master_weights.py, tests/test_pallas_adam_update.py) passed on an H200
    # on 2026-12-02, and Llama-2-7B trained through it there with the losses of the rebuilt
    # path (bench/results/train_llama2_7b_b1_inbwd_parts_*_h200_2026-12-02.txt).
    "adam_update_parts": True,
    # The COAT norm / SwiGLU forwards with quantization inside (pallas_kernels/fused_quantize.py):
    # compiled tests pass on an H200 (2026-12-01), but one 7B block is no faster (13.79 ms
    # against 13.70 unfused, bench/results/layer_fused_h200_2026-12-01.json).
    "fused_quantize": False,
    # COAT's MLP with the gate / up GEMMs writing SwiGLU's saved 1x16 groups from their
    # epilogue (coat_jax.ops.flow.fp8_mlp, pallas_kernels.fp8_matmul.fp8_matmul_quantize_1x16),
    # and SwiGLU's and the norms' backwards as one pass each over their FP8-saved inputs
    # (pallas_kernels/fused_backward.py): Llama-2-7B through train.py at batch 4 on an H100,
    # jax 0.11.2, 2026-12-06: 14,760 tokens/s unfused, 15,250 with the MLP, 15,470 with both
    # (bench/results/train_llama2_7b_b4_coat_*_h100_2026-12-06.txt); a 2-layer 7B step at batch
    # 8 100.0 -> 97.5 device ms (pending_gpu_part48_h100_2026-12-06.log); compiled tests pass
    # there. Loss: Llama-114M, 2000 steps, same seed, final train loss +0.18% / eval +0.01%
    # against unfused (train_114m_2000_coat_*_h100_2026-12-06.jsonl). One device only
    # (AUTO_ONE_DEVICE).
    "fused_mlp": True,
    "fused_backward": True,
    # Each output gradient's E5M2 codes in both layouts from one pass
    # (pallas_kernels.quantize.quantize_transpose_per_tensor, Fp8Recipe.grad_transpose), one
    # H100, jax 0.11.2, 2026-12-07 (bench/results/*grad_transpose*_h100_2026-12-07.*): a 2-layer
    # 7B COAT step at batch 8, 79.0 -> 77.1 device ms (XLA's quantize-and-transpose fusions 3.7
    # ms at 1.4-1.7 TB/s, the kernel 2.0 ms at 2.7-2.8 TB/s); one 7B block at batch 4 in three
    # rounds, COAT 13.34 / 13.99 / 13.78 -> 13.00 / 13.04 / 13.24 ms, FP8-linear 12.94 / 13.06 /
    # 13.41 -> 12.67 / 12.72 / 12.91; Llama-2-7B through train.py at batch 4, 15,820 / 15,610 ->
    # 16,010 / 16,240 tokens/s. Compiled tests pass there; with XLA's excess precision off, COAT's
    # train steps equal the XLA path's bit for bit (tests/test_grad_transpose.py).
    "quantize_transpose": True,
}
"""Per kernel family, whether ``kernels="auto"`` picks the compiled kernel on a Hopper GPU.
Flip an entry only with a GPU measurement showing the kernel faster, and cite it above."""

AUTO_ONE_DEVICE: frozenset[str] = frozenset({"fused_mlp", "fused_backward", "quantize_transpose"})
"""Families whose ``kernels="auto"`` picks the kernel only outside a multi-device mesh: their
per-shard path (``shard_map``) is tested on virtual CPU devices against one device, but has
not run on several GPUs; ``"pallas"`` runs it there by name."""

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


def resolve(kernels: str, family: str, *, placed: bool = False) -> str:
    """Maps a ``kernels=`` option to ``"pallas"``, ``"interpret"`` or ``"reference"``.

    ``"auto"`` keeps the reference where :func:`unseen_sharding` (more than one device, no
    mesh in context): the arrays may be split by ``jit``'s shardings, which a kernel's call
    cannot see, and XLA would gather them whole around it.

    Args:
      kernels: one of :data:`KERNEL_OPTIONS`.
      family: a key of :data:`AUTO_USES_KERNEL`.
      placed: the caller knows where its arrays are and sets the mesh before it traces
        (``train.py``'s optimizer, built before ``jax.set_mesh``): no unseen sharding.

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
        sharded = family in AUTO_ONE_DEVICE and multi_device_mesh() is not None
        unseen = not placed and unseen_sharding()
        use_kernel = AUTO_USES_KERNEL[family] and hopper_gpu() and not (sharded or unseen)
        return "pallas" if use_kernel else "reference"
    return kernels


def unseen_sharding() -> bool:
    """Whether arrays may be sharded where a kernel cannot see it: no mesh in context
    (``jax.set_mesh``) while the program spans more than one device. Under ``jit`` with
    ``in_shardings`` alone a Pallas call gets whole arrays (XLA all-gathers them first: an
    FSDP state would be gathered on every device)."""
    return jax.sharding.get_abstract_mesh().empty and jax.device_count() > 1


def multi_device_mesh():
    """The mesh in context (``jax.set_mesh``) when it spans more than one device, else ``None``:
    where kernels that are not partitioned must not run on whole arrays."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty or mesh.size <= 1 else mesh


def check_compiled(interpret: bool, who: str) -> None:
    """Raises ``ValueError`` when ``who`` is asked to compile a kernel off a Hopper GPU."""
    if not interpret and not hopper_gpu():
        raise ValueError(
            f"{who} compiles for a Hopper GPU, not {jax.default_backend()}; pass "
            "interpret=True to run the kernel here, or use the coat_jax reference"
        )


GEMM_AUTO_USES_KERNEL = False
"""Whether the ``"auto"`` GEMM backend picks the Pallas per-tensor FP8 GEMM
(pallas_kernels/fp8_matmul.py) for shapes missing from :data:`GEMM_PALLAS_FASTER`. Measured in a
whole step (Llama-2-7B COAT, batch 4, H200, 2026-12-02,
bench/results/profile_llama2_7b_coat_b4_gemm_{xla,auto}_sig_h200_2026-12-02.json): the Pallas
GEMMs took 232.5 ms a step against cuBLASLt's 225.6 for the same GEMMs, and the K-major operand
copies they need added ~56 ms of fusions (513 -> 566 ms on the device); ``"auto"`` is therefore
not the trainer's default (``Fp8Recipe.gemm="xla"``)."""

GEMM_PALLAS_FASTER: dict[tuple[int, int, int], bool] = {
    # H200, jax 0.11.2, bench/gemm.py (bench/results/gemm_h200_2026-11-30*.json), TFLOP/s of
    # the Pallas per-tensor kernel (default config) vs XLA's cuBLASLt FP8 on the faster of its
    # two weight layouts, (N, K): 1469 vs 1197, 1471 vs 1232, 1520 vs 1388, 1501 vs 1382.
    (8192, 4096, 4096): True,
    (8192, 4096, 11008): True,
    (8192, 11008, 4096): True,
    (8192, 8192, 8192): True,
    # Same, 2026-12-02 (bench/results/gemm_step_shapes_h200_2026-12-02.json): a 7B step's
    # weight-gradient GEMMs at batch 4 (x^T dy: M = K_in, K = 8192 tokens) and a forward at
    # batch 8: 1525 vs 1346, 1484 vs 1385, 1489 vs 1379; 1487 vs 1245.
    (4096, 8192, 4096): True,
    (4096, 8192, 11008): True,
    (11008, 8192, 4096): True,
    (16384, 4096, 4096): True,
}
"""Per ``(M, K, N)`` of a per-tensor FP8 GEMM, whether bench/gemm.py measured the Pallas kernel
faster than XLA's cuBLASLt FP8 on a Hopper GPU (``"auto"`` uses it there; shapes not listed
follow :data:`GEMM_AUTO_USES_KERNEL`). Fill from a dated bench/results/gemm_*.json."""


def gemm_backend(choice: str, shape: tuple[int, int, int] | None = None) -> str:
    """``"xla"`` or ``"pallas"``: where a per-tensor FP8 GEMM of ``shape`` ``(M, K, N)`` runs
    for the recipe's ``gemm`` ``choice`` (``coat_jax.core.recipe.Fp8Recipe.gemm``):

    * ``"xla"``: FP8 codes into ``lax.dot_general`` (XLA's cuBLASLt FP8 rewrite on a GPU).
    * ``"pallas"``: the Pallas wgmma kernel; a ``ValueError`` off a Hopper GPU.
    * ``"auto"``: Pallas on Hopper where :data:`GEMM_PALLAS_FASTER` says so, else XLA.

    ``shape`` is the kernel's on one device: under a multi-device mesh the caller runs it on
    each device's shard (``coat_jax.ops.sharded_gemm``) and passes the shard's shape.
    """
    if choice not in GEMM_BACKENDS:
        raise ValueError(f"gemm={choice!r}: expected one of {', '.join(GEMM_BACKENDS)}")
    if choice == "pallas":
        if not hopper_gpu():
            raise ValueError("gemm='pallas' needs a Hopper GPU; use 'auto' or 'xla'")
        return "pallas"
    if choice == "auto" and hopper_gpu():
        faster = GEMM_PALLAS_FASTER.get(shape, GEMM_AUTO_USES_KERNEL)
        return "pallas" if faster else "xla"
    return "xla"
