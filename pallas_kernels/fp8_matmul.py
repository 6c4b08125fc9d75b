r"""FP8 GEMMs for Hopper in Pallas (Mosaic GPU backend, ``wgmma``): per-tensor scaled,
block-scaled, and with a fused 1x16 quantize epilogue.

The math (``A`` is ``(M, K)``, ``B`` is ``(N, K)``, both FP8 codes; fp32 accumulation):

* per tensor (:func:`fp8_matmul`): ``C = sa * sb * A @ B^T``, the scales applied once in the
  epilogue; E4M3 x E4M3 (forward) or any E4M3/E5M2 pair (backward: E5M2 gradients).
* block scaled (:func:`fp8_matmul_block_scaled`, DeepSeek-V3's recipe): ``sa`` has one scale
  per row and 128 columns of ``A`` (1x128 tiles), ``sb`` one per 128x128 block of ``B``::

      C[m, n] = sum_kb sa[m, kb] * sb[n // 128, kb] * sum_{k in block kb} A[m, k] B[n, k]

  each 128-wide partial sum leaves the tensor core in fp32 and is scaled and added in fp32
  ("promotion" every 128 of K), so the tensor core's reduced-precision accumulation never spans
  more than 128 products.
* fused epilogue (:func:`fp8_matmul_quantize_1x16`): ``C`` as per tensor, then quantized to E4M3
  in groups of 16 along ``N`` inside the kernel: ``amax[m, j] = max |C[m, 16j:16j+16]|`` and
  ``codes = sat(C * 448 / amax)`` (``amax == 0``: factor 448), exactly
  ``coat_jax.quantize(C, "e4m3", group_size=16)``; optionally the tensor's ``amax`` (the max of
  the group maxima) for the next layer's just-in-time scale.

Layouts: FP8 ``wgmma`` reads both operands from shared memory **K-major** only (PTX has no
transposed FP8 operand; ``jax.experimental.mosaic.gpu.wgmma`` allows transposes for 16-bit
types only), with a 128-byte swizzle whose rows are 128 FP8 elements of K. So ``a`` is ``(M, K)``
row-major and ``b`` is ``(N, K)`` row-major: the weight is stored transposed, ``x @ W`` takes
``W^T``. Backward needs ``dY @ W`` (``W`` ``(K, N)`` is already K-major over N, no copy) and
``X^T @ dY`` (both transposed: ``X^T`` and ``dY^T``, i.e. column-major copies), see
:func:`fp8_dot_general`. Block scales of ``A`` travel transposed, ``(K/128, M)``, so that one
K step's scales for a tile of rows are one contiguous TMA box; the weight's block scales
travel the same way, repeated over their 128 columns (``(K/128, N)``), and are read from
shared memory, loaded before the step's ``wgmma`` is waited on.

The kernel: a persistent grid (one CTA per SM) walking output tiles in a "planar snake" order;
per CTA ``compute_wgs`` (2-4) compute warpgroups (each a ``tile_m x tile_n`` fp32 accumulator
in registers, side by side in N or M) and one memory warpgroup feeding a
``max_concurrent_steps``-deep TMA pipeline (``emit_pipeline_warp_specialized``); the epilogue
stages the output through shared memory and TMA-stores it. Optionally CTAs pair in two-CTA
clusters that share one operand's tile through TMA multicast (``GemmConfig.cluster``).

Limits: the wrapper pads M, N (to the CTA tile) and K (to ``tile_k``) with zeros when they are
not multiples, and slices the result: one extra copy of each padded operand (``M K`` and ``N K``
bytes) and of the output; shapes that are multiples cost nothing. The fused epilogue needs
``N % 16 == 0`` (else the reference runs); block scaling needs ``tile_n == 128`` per
warpgroup (one weight block per warpgroup) and ``tile_k`` of one or two 128-K blocks. Kernels
compile only on a Hopper GPU with jax >= 0.11 (Mosaic GPU, mixed E4M3/E5M2 ``wgmma``); the
``*_reference`` functions are the specification and run anywhere.

Options tried on the H200 and removed (promotion overlapped with the next pipeline step's
``wgmma``, twice, row-major group maxima): docs/pallas-backends.md; two blocks within a step
and two-CTA clusters (kept): docs/results.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax import lax

from coat_jax.core import measure
from coat_jax.core.formats import E4M3
from coat_jax.core.quant import QuantizedArray, quantize
from coat_jax.core.recipe import ACT_GROUP
from pallas_kernels import dispatch, mgpu
from pallas_kernels.mgpu import pl, plgpu

__all__ = [
    "FP8_DTYPES",
    "GemmConfig",
    "autotune",
    "config_candidates",
    "fp8_dot_general",
    "fp8_matmul",
    "fp8_matmul_block_scaled",
    "fp8_matmul_block_scaled_reference",
    "fp8_matmul_quantize_1x16",
    "fp8_matmul_quantize_1x16_reference",
    "fp8_matmul_reference",
    "padded_shape",
]

FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
BLOCK = 128
"""Block size of the block-scaled recipe: 1x128 activation tiles, 128x128 weight blocks."""
GROUP = ACT_GROUP
"""Group size of the fused quantize epilogue (1x16 along N): the FP8 recipe's ``saved_group``."""
VARIANTS = ("per_tensor", "block_scaled", "quantize_1x16")


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Tile and pipeline knobs of the kernel.

    Attributes:
      tile_m, tile_n: output tile of one compute warpgroup (``tile_m % 64 == 0``,
        ``tile_n % 8 == 0`` and ``<= 256``, the ``wgmma`` limits).
      tile_k: K per pipeline step, a multiple of 128 (one 128-byte swizzle row of FP8).
        Block-scaled, 256: two 128-K blocks a step, each into its own accumulator, both
        ``wgmma`` issued before the first is waited on, so that the first block's promotion
        runs while the tensor core works on the second (three ``tile_m x tile_n`` fp32
        accumulators per warpgroup: 2 compute warpgroups only).
      max_concurrent_steps: depth of the TMA pipeline (shared memory: ``steps x (cta_m + cta_n)
        x tile_k`` bytes).
      wg_split: ``"n"``: the compute warpgroups sit side by side in N (CTA tile
        ``tile_m x compute_wgs tile_n``); ``"m"``: stacked in M.
      grid_minor: the output-tile walk's minor dimension, ``"m"`` or ``"n"``.
      grid_tile_width: tiles per band of the walk (L2 reuse).
      epi_tile_m, epi_tile_n: staging tile of the BF16/fp32 epilogue.
      b_scales_in_smem: block-scaled only: the weight's block scales travel with the operands
        through the TMA pipeline (repeated per column, ``(K/128, N)``, one 4-byte-per-column
        row per K step) and are read from shared memory; ``False`` reads one scalar per K step
        from global memory (the 2026-11-30 kernel's way: a global load on every promotion).
      compute_wgs: compute warpgroups per CTA (2 or 3; one more feeds the pipeline), side by
        side along ``wg_split``. Block scaling waits for each K step's ``wgmma`` before
        promoting it, so a third warpgroup can keep the tensor core busy while the others
        promote; registers per thread shrink with the count (``(512 - 40) / compute_wgs``, at
        most 232). Four lowered here but hung on an H200 (2026-12-02: its GPU test and the
        bench's autotune both timed out on it), so the check refuses them.
      cluster: ``None``, or ``"m"`` / ``"n"``: two CTAs of a cluster take neighbouring output
        tiles along that dimension and share the other operand's tile: each loads half of it
        and the TMA multicasts it to both (``"m"``: the weight tile ``B``, ``"n"``: the
        activation tile ``A``), which halves that operand's traffic out of L2. M (``"m"``) or
        N (``"n"``) pads to two CTA tiles.
    """

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 128
    max_concurrent_steps: int = 4
    wg_split: str = "n"
    grid_minor: str = "n"
    grid_tile_width: int = 8
    epi_tile_m: int = 64
    epi_tile_n: int = 64
    b_scales_in_smem: bool = True
    compute_wgs: int = 2
    cluster: str | None = None

    @property
    def cta_m(self) -> int:
        return self.tile_m * (self.compute_wgs if self.wg_split == "m" else 1)

    @property
    def cta_n(self) -> int:
        return self.tile_n * (self.compute_wgs if self.wg_split == "n" else 1)

    @property
    def cluster_size(self) -> int:
        return 1 if self.cluster is None else 2

    @property
    def cluster_m(self) -> int:
        """Output rows of one cluster (of one CTA without a cluster)."""
        return self.cta_m * (2 if self.cluster == "m" else 1)

    @property
    def cluster_n(self) -> int:
        return self.cta_n * (2 if self.cluster == "n" else 1)

    def check(self, variant: str = "per_tensor") -> None:
        """Raises ``ValueError`` for a config the kernel cannot run."""
        if self.tile_m % 64 or self.tile_n % 8 or not 8 <= self.tile_n <= 256:
            raise ValueError(f"{self}: tile_m % 64 == 0 and tile_n in [8, 256] % 8 needed")
        if self.tile_k % 128:
            raise ValueError(f"{self}: tile_k must be a multiple of 128 (FP8 swizzle row)")
        if self.compute_wgs not in (2, 3):
            raise ValueError(f"{self}: compute_wgs must be 2 or 3 (4 hung on an H200)")
        if self.wg_split not in ("m", "n") or self.grid_minor not in ("m", "n"):
            raise ValueError(f"{self}: wg_split and grid_minor are 'm' or 'n'")
        if self.cluster not in (None, "m", "n"):
            raise ValueError(f"{self}: cluster is None, 'm' or 'n'")
        if self.tile_m % self.epi_tile_m or self.tile_n % self.epi_tile_n:
            raise ValueError(f"{self}: epilogue tiles must divide the warpgroup tile")
        if variant == "block_scaled" and (self.tile_k not in (BLOCK, 2 * BLOCK)
                                          or self.tile_n != BLOCK):  # fmt: skip
            raise ValueError(f"{self}: block scaling needs tile_n == {BLOCK} and tile_k "
                             f"{BLOCK} or {2 * BLOCK}")  # fmt: skip
        if variant == "block_scaled" and self.tile_k > BLOCK and self.compute_wgs != 2:
            raise ValueError(f"{self}: block scaling with tile_k > {BLOCK} holds three "
                             "accumulators per thread: 2 compute warpgroups only")  # fmt: skip
        if variant == "quantize_1x16" and self.tile_n % GROUP:
            raise ValueError(f"{self}: the 1x16 epilogue needs tile_n % {GROUP} == 0")


def config_candidates(variant: str = "per_tensor") -> tuple[GemmConfig, ...]:
    """The configs :func:`autotune` times (each checked against ``variant``'s limits)."""
    if variant == "block_scaled":
        # 64-row warpgroup tiles: 128-row ones ran at 430-520 TFLOP/s on an H200 (2026-12-02,
        # gemm_block_scaled_h200_2026-12-02.json) against 1,070-1,100. A third warpgroup only
        # stacked in M (a TMA box is at most 256 rows of B). Two 128-K blocks a step, CTA
        # 128x128: 1,181 / 1,169 TFLOP/s at 8192x4096x{11008, 4096} against 1,040-1,108 for
        # one block a step; three warpgroups 1,233 / 1,076; two blocks with a 64x256 CTA
        # 1,043 / 1,046, dropped (H200, 2026-12-04, gemm_block_scaled_2blocks_h200_2026-12-04
        # .json). With a 64x32 epilogue tile, whose freed shared memory holds a third 256-K
        # step: 1,213 / 1,208 against 1,174 / 1,171 in one later call (..._2026-12-04b.json).
        # First (the default under jit): the same in two-CTA clusters along N, the activation
        # tile multicast to both: 1,285 / 1,265 against 1,237 / 1,213 along M (the weight
        # tile multicast) and 1,228 / 1,198 for cuBLASLt's per-tensor FP8 GEMM in the same
        # call (gemm_sweep_clusters_h200_2026-12-04.json).
        raw = [
            GemmConfig(64, 128, 256, 3, "m", epi_tile_n=32, cluster="n"),
            GemmConfig(64, 128, 256, 3, "m", epi_tile_n=32),
            GemmConfig(64, 128, 128, 6, "m"),
            GemmConfig(64, 128, 128, 6, "n"),
            GemmConfig(64, 128, 128, 6, "n", b_scales_in_smem=False),
            GemmConfig(64, 128, 128, 6, "m", compute_wgs=3),
        ]
    else:
        steps_256 = 3 if variant == "quantize_1x16" else 4
        raw = [
            GemmConfig(128, 128, 128, 4, "n"),
            GemmConfig(128, 128, 128, 6, "n"),
            GemmConfig(128, 256, 128, steps_256, "n"),
            GemmConfig(128, 128, 128, 4, "m"),
            GemmConfig(128, 128, 256, 2, "n"),
            GemmConfig(128, 128, 128, 4, "n", "m"),
            # two-CTA clusters along M, the weight tile multicast: 1,496 / 1,478 TFLOP/s at
            # 8192x4096x{11008, 4096} against 1,478 / 1,462 for the first (H200, 2026-12-05,
            # gemm_sweep_defer_h200_2026-12-05.json; 1,496 / 1,481 on 2026-12-04)
            GemmConfig(128, 128, 128, 4, "n", cluster="m"),
        ]
    out = []
    for c in raw:
        try:
            c.check(variant)
        except ValueError:
            continue
        out.append(c)
    return tuple(out)  # _config_for shortens each pipeline to the shared memory


DEFAULT_CONFIG = GemmConfig()


def default_config(variant: str = "per_tensor") -> GemmConfig:
    """The config a shape runs with before (or without) autotuning: the variant's first
    candidate, the fastest measured on an H200 (per tensor and 1x16: :data:`DEFAULT_CONFIG`)."""
    return config_candidates(variant)[0]

SMEM_LIMIT = 232_448
"""Shared memory one CTA may use on Hopper (227 KiB, H100/H200); Mosaic GPU refuses more."""
_SMEM_RESERVE = 256  # barriers and alignment (H200: 64 bytes beside the buffers counted below)


def smem_bytes(config: GemmConfig, variant: str, out_dtype) -> int:
    """Shared memory of the kernel's buffers: the pipeline's ``max_concurrent_steps`` slots of
    both FP8 operand tiles (and the K step's scales when block-scaled), plus the
    epilogue's staging (two warpgroups x two slots of the BF16/fp32 tile, or the FP8 codes,
    group amax (stored transposed, ``(tile_n/16, tile_m)``) and cross-warp max scratch of the
    1x16 epilogue). Matches what Mosaic GPU reported on an H200 (fp32 per-tensor 4 steps:
    262,208; 1x16: 239,680) to 256 bytes."""
    c = config
    step = (c.cta_m + c.cta_n) * c.tile_k
    if variant == "block_scaled":  # the K step's fp32 scales: rows of A (and columns of B)
        step += 4 * (c.tile_k // BLOCK) * (c.cta_m + (c.cta_n if c.b_scales_in_smem else 0))
    wgs = c.compute_wgs
    if variant == "quantize_1x16":
        epilogue = wgs * (c.tile_m * c.tile_n + (c.tile_n // GROUP) * c.tile_m * 4) + 16 * c.tile_m
    else:
        n_epi = (c.tile_m // c.epi_tile_m) * (c.tile_n // c.epi_tile_n)
        tile_bytes = c.epi_tile_m * c.epi_tile_n * jnp.dtype(out_dtype).itemsize
        epilogue = wgs * min(2, n_epi) * tile_bytes
    return c.max_concurrent_steps * step + epilogue + _SMEM_RESERVE


def fit_smem(config: GemmConfig, variant: str, out_dtype) -> GemmConfig | None:
    """``config`` with its pipeline shortened until :func:`smem_bytes` fits :data:`SMEM_LIMIT`
    (at least 2 steps, to overlap loads with ``wgmma``), or ``None`` when even 2 do not."""
    for steps in range(config.max_concurrent_steps, 1, -1):
        fitted = dataclasses.replace(config, max_concurrent_steps=steps)
        if smem_bytes(fitted, variant, out_dtype) <= SMEM_LIMIT:
            return fitted
    return None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def padded_shape(m: int, n: int, k: int, config: GemmConfig) -> tuple[int, int, int]:
    """``(M, N, K)`` rounded up to the cluster tile (M, N; the CTA tile without a cluster) and
    to ``tile_k`` (K)."""
    return (
        _cdiv(m, config.cluster_m) * config.cluster_m,
        _cdiv(n, config.cluster_n) * config.cluster_n,
        _cdiv(k, config.tile_k) * config.tile_k,
    )


def _pad2(x: jax.Array, rows: int, cols: int, value=0) -> jax.Array:
    """Pads a matrix at the end of both axes to ``(rows, cols)`` (no copy when already so)."""
    pr, pc = rows - x.shape[0], cols - x.shape[1]
    if pr == 0 and pc == 0:
        return x
    return jnp.pad(x, ((0, pr), (0, pc)), constant_values=jnp.asarray(value, x.dtype))


# --------------------------------------------------------------------------------------------
# References: the specification (fp32 math on the dequantized operands), any shape.


def fp8_matmul_reference(a, b, a_scale, b_scale, *, out_dtype=jnp.bfloat16) -> jax.Array:
    """``(sa * sb * A @ B^T).astype(out_dtype)`` with ``A`` ``(M, K)``, ``B`` ``(N, K)`` FP8."""
    _check_operands(a, b)
    prod = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32).T, precision=lax.Precision.HIGHEST)
    scale = jnp.asarray(a_scale, jnp.float32) * jnp.asarray(b_scale, jnp.float32)
    return (prod * scale).astype(out_dtype)


def block_scales_shape(m: int, n: int, k: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Shapes of the block scales: ``a_scales (M, ceil(K/128))``, ``b_scales (ceil(N/128),
    ceil(K/128))``."""
    kb = _cdiv(k, BLOCK)
    return (m, kb), (_cdiv(n, BLOCK), kb)


def expand_block_scales(a_scales, b_scales, m: int, n: int, k: int):
    """Per-element multipliers ``(M, K)`` and ``(N, K)`` of the block scales (for references)."""
    sa = jnp.repeat(jnp.asarray(a_scales, jnp.float32), BLOCK, axis=1)[:, :k]
    sb = jnp.repeat(jnp.repeat(jnp.asarray(b_scales, jnp.float32), BLOCK, 0), BLOCK, 1)
    return sa[:m], sb[:n, :k]


def fp8_matmul_block_scaled_reference(
    a, a_scales, b, b_scales, *, out_dtype=jnp.bfloat16
) -> jax.Array:
    """``sum_k (sa[m, k//128] A[m, k]) (sb[n//128, k//128] B[n, k])`` in fp32, cast."""
    _check_operands(a, b)
    (m, k), n = a.shape, b.shape[0]
    _check_block_scales(a_scales, b_scales, m, n, k)
    sa, sb = expand_block_scales(a_scales, b_scales, m, n, k)
    a32 = a.astype(jnp.float32) * sa
    b32 = b.astype(jnp.float32) * sb
    return jnp.dot(a32, b32.T, precision=lax.Precision.HIGHEST).astype(out_dtype)


def fp8_matmul_quantize_1x16_reference(a, b, a_scale, b_scale, *, return_amax: bool = False):
    """``coat_jax.quantize(fp8_matmul_reference(..., out_dtype=f32), "e4m3", group_size=16)``,
    plus the tensor's ``amax`` (fp32 scalar) when ``return_amax``."""
    c = fp8_matmul_reference(a, b, a_scale, b_scale, out_dtype=jnp.float32)
    q = quantize(c, E4M3, group_size=GROUP)
    return (q, jnp.max(q.amax)) if return_amax else q


# --------------------------------------------------------------------------------------------
# Argument checks (before any work).


def _check_operands(a, b) -> None:
    for name, x in (("a", a), ("b", b)):
        if jnp.dtype(x.dtype) not in FP8_DTYPES:
            raise TypeError(f"{name} must be float8_e4m3fn or float8_e5m2, got {x.dtype}")
        if x.ndim != 2:
            raise ValueError(f"{name} must be 2-D, got shape {x.shape}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(
            f"a (M, K) and b (N, K) must share K (b is K-major): {a.shape} vs {b.shape}"
        )


def _check_scalar(name, s) -> None:
    if jnp.ndim(s) != 0 and jnp.size(s) != 1:
        raise ValueError(f"{name} must be a scalar (per-tensor scale), got shape {jnp.shape(s)}")


def _scalar(x) -> jax.Array:
    return jnp.asarray(x, jnp.float32).reshape(())


def _check_out_dtype(out_dtype) -> jnp.dtype:
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be bfloat16 or float32, got {out_dtype}")
    return out_dtype


def _check_block_scales(a_scales, b_scales, m, n, k) -> None:
    want_a, want_b = block_scales_shape(m, n, k)
    if tuple(a_scales.shape) != want_a:
        raise ValueError(f"a_scales must have shape (M, ceil(K/128)) = {want_a}, got "
                         f"{tuple(a_scales.shape)}")  # fmt: skip
    if tuple(b_scales.shape) != want_b:
        raise ValueError(f"b_scales must have shape (ceil(N/128), ceil(K/128)) = {want_b}, "
                         f"got {tuple(b_scales.shape)}")  # fmt: skip


# --------------------------------------------------------------------------------------------
# The kernel.


def _fp8_transforms():
    # FP8 wgmma operands: (8, 128)-element tiles, 128-byte swizzle (128 FP8 = one K row).
    return (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))


def _out_transforms(epi_tile_n: int, dtype):
    swizzle = plgpu.find_swizzle(epi_tile_n * jnp.dtype(dtype).itemsize * 8)
    elems = swizzle // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))


def _build_kernel(variant, m, n, k, a_dtype, b_dtype, out_dtype, config: GemmConfig):
    """The ``plgpu.kernel`` for padded shapes (multiples of the CTA tile and of tile_k)."""
    cfg = config
    tile_m, tile_n, tile_k = cfg.tile_m, cfg.tile_n, cfg.tile_k
    cta_m, cta_n = cfg.cta_m, cfg.cta_n
    # the walk is over cluster tiles (CTA tiles without a cluster)
    m_iters, n_iters, k_iters = m // cfg.cluster_m, n // cfg.cluster_n, k // tile_k
    multicast_a = ("cluster",) if cfg.cluster == "n" else ()  # shared by the cluster's CTAs
    multicast_b = ("cluster",) if cfg.cluster == "m" else ()
    split_m = cfg.wg_split == "m"
    block = variant == "block_scaled"
    quant = variant == "quantize_1x16"
    sb_in_smem = block and cfg.b_scales_in_smem
    blocks = tile_k // BLOCK  # block-scaled: 128-K blocks per pipeline step, one scale each
    wgs = cfg.compute_wgs
    epi_m, epi_n = cfg.epi_tile_m, cfg.epi_tile_n
    n_epi = (tile_m // epi_m) * (tile_n // epi_n)
    slots = min(2, n_epi)
    n_ctas = mgpu.num_sms() // cfg.cluster_size  # the grid: one CTA (cluster) per SM (pair)

    def kernel(*refs):
        if block:
            a_gmem, b_gmem, sa_gmem, sb_gmem, *outs = refs
        else:
            a_gmem, b_gmem, s_gmem, *outs = refs

        def tile_of(lin):
            """The output tile ``(mi, ni)`` (in CTA tiles) this CTA takes of the walk's
            cluster tile ``lin``."""
            mi, ni = plgpu.planar_snake(
                lin, (m_iters, n_iters), 0 if cfg.grid_minor == "m" else 1, cfg.grid_tile_width
            )
            if cfg.cluster == "m":  # this CTA's tile of its cluster's pair
                mi = 2 * mi + lax.axis_index("cluster")
            elif cfg.cluster == "n":
                ni = 2 * ni + lax.axis_index("cluster")
            return mi, ni

        def pipeline(body, compute_context):
            spec = functools.partial(plgpu.BlockSpec, memory_space=plgpu.SMEM)
            in_specs = [
                spec((cta_m, tile_k), lambda kk: (0, kk), transforms=_fp8_transforms(),
                     collective_axes=multicast_a),
                spec((cta_n, tile_k), lambda kk: (0, kk), transforms=_fp8_transforms(),
                     collective_axes=multicast_b),
            ]  # fmt: skip
            if block:  # the K step's activation scales for the CTA's rows: one TMA box
                in_specs.append(spec((blocks, cta_m), lambda kk: (kk, 0)))
            if sb_in_smem:  # and the weight's, one per column of the CTA
                in_specs.append(spec((blocks, cta_n), lambda kk: (kk, 0)))
            return plgpu.emit_pipeline_warp_specialized(
                body,
                grid=(k_iters,),
                memory_registers=40,
                in_specs=in_specs,
                wg_axis="wg",
                num_compute_wgs=cfg.compute_wgs,
                max_concurrent_steps=cfg.max_concurrent_steps,
                compute_context=compute_context,
            )

        ignore = lambda *_, **__: None
        gmem_ins = (a_gmem, b_gmem) + ((sa_gmem,) if block else ()) + (
            (sb_gmem,) if sb_in_smem else ()
        )
        scratch = {"pipeline_allocs": pipeline(ignore, ignore).get_allocations(*gmem_ins)}
        if quant:
            scratch["codes_smem"] = plgpu.SMEM((wgs, tile_m, tile_n), jnp.float8_e4m3fn)
            scratch["amax_smem"] = plgpu.SMEM((wgs, tile_n // GROUP, tile_m), jnp.float32)
        else:
            scratch["out_smem"] = plgpu.SMEM(
                (wgs, slots, epi_m, epi_n), out_dtype, transforms=_out_transforms(epi_n, out_dtype)
            )

        @functools.partial(pl.run_scoped, collective_axes="wg", **scratch)
        def _scope(pipeline_allocs, out_smem=None, codes_smem=None, amax_smem=None):
            wg = lax.axis_index("wg")
            wg_rows = pl.ds(wg * tile_m, tile_m) if split_m else slice(None)
            wg_cols = slice(None) if split_m else pl.ds(wg * tile_n, tile_n)

            def origin(mi, ni):
                """First row and column of this warpgroup's output tile."""
                row0 = mi * cta_m + (wg * tile_m if split_m else 0)
                col0 = ni * cta_n + (0 if split_m else wg * tile_n)
                return row0, col0

            def zeros():
                z = jnp.zeros((tile_m, tile_n), jnp.float32)
                return plgpu.layout_cast(z, plgpu.Layout.WGMMA)

            def mma(a_smem, b_smem, acc_ref, ks=slice(None)):
                a_tile = a_smem.at[wg_rows].at[:, ks]
                b_tile = b_smem.at[wg_cols].at[:, ks]
                plgpu.wgmma(acc_ref, a_tile, b_tile.transpose((1, 0)))

            def step_scale(kk, j, col0, sa_smem, sb_smem=None):
                """Block ``j`` of K step ``kk``: the promotion multipliers of this warpgroup's
                rows, (tile_m,), its activation scales times the weight block's scale."""
                sa_rows = sa_smem.at[j, wg_rows] if split_m else sa_smem.at[j]
                row_scale = mgpu.load(sa_rows, plgpu.Layout.WGMMA.reduce(1))
                if sb_smem is None:
                    return row_scale * sb_gmem[lax.div(col0, BLOCK), kk * blocks + j]
                return row_scale * sb_smem[j, 0 if split_m else wg * tile_n]

            def promote(total, part, scale):
                return total + part * lax.broadcast_in_dim(scale, (tile_m, tile_n), (0,))

            def block_step(kk, col0, a_smem, b_smem, scale_smem, carry):
                """K step ``kk`` of the block-scaled sum: ``carry`` plus its blocks, each
                promoted from a fresh fp32 accumulator."""

                def step(*part_refs):
                    for j, part_ref in enumerate(part_refs):  # all issued at once
                        mma(a_smem, b_smem, part_ref, pl.ds(j * BLOCK, BLOCK))
                    # loaded before the wgmma is waited on: their latency hides behind it
                    scales = [step_scale(kk, j, col0, *scale_smem) for j in range(blocks)]
                    total = carry
                    for j, part_ref in enumerate(part_refs):  # block j's promotion overlaps
                        later = blocks - 1 - j  # the tensor core's work on the later blocks
                        part = plgpu.wgmma_accumulator_load(part_ref, wait_n=later)
                        total = promote(total, part, scales[j])
                    return total

                acc = plgpu.ACC((tile_m, tile_n), jnp.float32)
                return pl.run_scoped(step, *([acc] * blocks))

            def epilogue(c, mi, ni):
                if quant:
                    quantize_epilogue(c, *origin(mi, ni))
                    return
                out = c.astype(out_dtype)
                out_tile = outs[0].at[pl.ds(mi * cta_m, cta_m), pl.ds(ni * cta_n, cta_n)]
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                e = 0
                for ei in range(tile_m // epi_m):
                    for ej in range(tile_n // epi_n):
                        rows = slice(ei * epi_m, (ei + 1) * epi_m)
                        cols = slice(ej * epi_n, (ej + 1) * epi_n)
                        slot = e % slots
                        e += 1
                        plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)
                        out_smem[wg, slot] = out[rows, cols]
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(
                            out_smem.at[wg, slot], out_tile.at[wg_rows, wg_cols].at[rows, cols]
                        )

            def quantize_epilogue(c, row0, col0):
                codes_gmem, amax_t_gmem = outs
                groups = tile_n // GROUP
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                for j in range(groups):
                    cj = c[:, j * GROUP : (j + 1) * GROUP]
                    gmax = jnp.max(jnp.abs(cj), axis=1)
                    factor = E4M3.max / jnp.where(gmax > 0, gmax, 1.0)
                    scaled = cj * lax.broadcast_in_dim(factor, (tile_m, GROUP), (0,))
                    codes = jnp.clip(scaled, -E4M3.max, E4M3.max).astype(jnp.float8_e4m3fn)
                    codes_smem[wg, :, j * GROUP : (j + 1) * GROUP] = codes
                    amax_smem[wg, j] = gmax
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(
                    codes_smem.at[wg], codes_gmem.at[pl.ds(row0, tile_m), pl.ds(col0, tile_n)]
                )
                plgpu.copy_smem_to_gmem(
                    amax_smem.at[wg],
                    amax_t_gmem.at[pl.ds(lax.div(col0, GROUP), groups), pl.ds(row0, tile_m)],
                )

            @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
            def _tiles(info):
                (lin,) = info.index
                mi, ni = tile_of(lin)
                if block:
                    col0 = origin(mi, ni)[1]  # once a tile, not in every K step

                    def body(idx, a_smem, b_smem, *scales_and_carry):
                        *scale_smem, carry = scales_and_carry
                        return block_step(idx[0], col0, a_smem, b_smem, scale_smem, carry)

                    def compute(eval_pipeline):
                        epilogue(eval_pipeline(zeros()), mi, ni)

                else:

                    def body(idx, a_smem, b_smem, acc_ref):
                        del idx
                        mma(a_smem, b_smem, acc_ref)
                        plgpu.wgmma_wait(0)
                        return acc_ref

                    def compute(eval_pipeline):
                        def acc_scope(acc_ref):
                            eval_pipeline(acc_ref)
                            return acc_ref[...]

                        acc = pl.run_scoped(acc_scope, plgpu.ACC((tile_m, tile_n), jnp.float32))
                        epilogue(acc * s_gmem[0], mi, ni)

                cta_rows = pl.ds(mi * cta_m, cta_m)
                cta_cols = pl.ds(ni * cta_n, cta_n)
                args = (a_gmem.at[cta_rows, :], b_gmem.at[cta_cols, :])
                if block:
                    args += (sa_gmem.at[:, cta_rows],)
                if sb_in_smem:
                    args += (sb_gmem.at[:, cta_cols],)
                pipeline(body, compute)(*args, allocations=pipeline_allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    if quant:
        out_type = (
            jax.ShapeDtypeStruct((m, n), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((n // GROUP, m), jnp.float32),
        )
    else:
        out_type = jax.ShapeDtypeStruct((m, n), out_dtype)
    clustered = cfg.cluster is not None
    return plgpu.kernel(
        kernel,
        out_type=out_type,
        grid=(n_ctas,),
        grid_names=("sm",),
        cluster=(cfg.cluster_size,) if clustered else (),
        cluster_names=("cluster",) if clustered else (),
        num_threads=cfg.compute_wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )


@functools.partial(jax.jit, static_argnames=("variant", "out_dtype", "config", "shape"))
def _run(a, b, s1, s2, *, variant, out_dtype, config, shape):
    """Pads, runs the kernel, slices. ``s1, s2``: per tensor ``(scale, unused)``; block
    ``(a_scales, b_scales)``."""
    m, n, k = shape
    mp, np_, kp = padded_shape(m, n, k, config)
    a_p, b_p = _pad2(a, mp, kp), _pad2(b, np_, kp)
    call = _build_kernel(variant, mp, np_, kp, a.dtype, b.dtype, out_dtype, config)
    if variant == "block_scaled":
        # kp is a multiple of tile_k: whole K steps of scales (1.0 over padded K, whose codes
        # are zeros)
        sa_t = _pad2(s1.astype(jnp.float32), mp, kp // BLOCK, 1.0).T  # (K/128, Mp)
        sb = _pad2(s2.astype(jnp.float32), np_ // BLOCK, kp // BLOCK, 1.0)
        if config.b_scales_in_smem:  # (K/128, Np): each block's scale over its 128 columns
            sb = jnp.repeat(sb.T, BLOCK, axis=1)
        return call(a_p, b_p, sa_t, sb)[:m, :n]
    out = call(a_p, b_p, s1.reshape(1).astype(jnp.float32))
    if variant == "quantize_1x16":
        codes, amax_t = out
        return codes[:m, :n], amax_t.T[:m, : n // GROUP]
    return out[:m, :n]


# --------------------------------------------------------------------------------------------
# Autotuning: first eager call per (variant, shape, dtypes) on a GPU; cached for the process.

_TUNED: dict[tuple, GemmConfig] = {}
AUTOTUNE_LOG: dict[tuple, list[dict]] = {}
"""Per autotuned key: each candidate's config, median ms or the error (for bench reports)."""


def _sample_inputs(variant, m, n, k, a_dtype, b_dtype):
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (m, k), jnp.float32).astype(a_dtype)
    b = jax.random.normal(kb, (n, k), jnp.float32).astype(b_dtype)
    if variant == "block_scaled":
        sa_shape, sb_shape = block_scales_shape(m, n, k)
        return a, b, jnp.ones(sa_shape, jnp.float32), jnp.ones(sb_shape, jnp.float32)
    return a, b, jnp.float32(1.0), jnp.float32(0.0)


def _tune_key(variant, m, n, k, a_dtype, b_dtype, out_dtype) -> tuple:
    """The autotune cache's key: one tuned config per variant, shape and dtypes."""
    return (variant, m, n, k, jnp.dtype(a_dtype), jnp.dtype(b_dtype), jnp.dtype(out_dtype))


def autotune(variant, m, n, k, a_dtype, b_dtype, out_dtype=jnp.bfloat16, *, iters: int = 10,
             candidates=None) -> GemmConfig:  # fmt: skip
    """Times each candidate config on the GPU, caches and returns the fastest (one that
    compiled). Falls back to :func:`default_config` when none runs (errors in AUTOTUNE_LOG,
    and a warning). Call it eagerly (outside ``jit``), e.g. once per shape before training:
    the wrappers use a shape's tuned config under ``jit`` but do not tune while tracing.

    Each candidate runs jitted and is timed by :func:`coat_jax.core.measure.kernel_time`: the
    median of ``iters`` device times from CUPTI (padding copies included). Host wall time of
    eager calls, used until 2026-12-05, measured dispatch as much as the kernel (0.41-0.99 ms
    for 0.21-0.26 ms kernels on an H200) and picked a config 19% slower than the default."""
    key = _tune_key(variant, m, n, k, a_dtype, b_dtype, out_dtype)
    if key in _TUNED:
        return _TUNED[key]
    log = AUTOTUNE_LOG.setdefault(key, [])
    best, best_ms = None, math.inf
    # Eager, not under ensure_compile_time_eval: that mode evaluates the kernel body's
    # lax.axis_index("wg") outside its mesh (H200: "unbound axis name: wg" for every candidate).
    inputs = _sample_inputs(variant, m, n, k, a_dtype, b_dtype)
    fitted = (fit_smem(c, variant, out_dtype) for c in candidates or config_candidates(variant))
    for cfg in dict.fromkeys(c for c in fitted if c is not None):  # in order, no repeats
        fn = jax.jit(functools.partial(_run, variant=variant, out_dtype=jnp.dtype(out_dtype),
                                       config=cfg, shape=(m, n, k)))  # fmt: skip
        try:
            ms, _ = measure.kernel_time(fn, *inputs, iters=iters)
        except Exception as e:  # noqa: BLE001 - a config that fails to lower is skipped
            log.append({"config": dataclasses.asdict(cfg), "error": f"{type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}"[:400]})  # fmt: skip
            continue
        log.append({"config": dataclasses.asdict(cfg), "ms": ms})
        if ms < best_ms:
            best, best_ms = cfg, ms
    if best is None:
        last = log[-1]["error"] if log else "no candidates"
        warnings.warn(f"fp8_matmul autotune {key}: none ran ({last}); default config", stacklevel=2)
    _TUNED[key] = best or default_config(variant)
    return _TUNED[key]


def _config_for(variant, m, n, k, a, b, out_dtype, config, autotune_eager: bool) -> GemmConfig:
    if config is None:
        key = _tune_key(variant, m, n, k, a.dtype, b.dtype, out_dtype)
        tracing = isinstance(a, jax.core.Tracer) or isinstance(b, jax.core.Tracer)
        if autotune_eager and not tracing:
            config = autotune(variant, m, n, k, a.dtype, b.dtype, out_dtype)
        else:  # under jit: a config tuned eagerly before, else the default
            config = _TUNED.get(key) or default_config(variant)
    config.check(variant)
    fitted = fit_smem(config, variant, out_dtype)  # a given config too: its pipeline may shorten
    if fitted is None:
        need = smem_bytes(config, variant, out_dtype)
        raise ValueError(f"{config}: needs {need} bytes of shared memory for {variant} with "
                         f"{jnp.dtype(out_dtype).name} output, over {SMEM_LIMIT}")  # fmt: skip
    return fitted


def _check_backend() -> None:
    mgpu.require("pallas_kernels.fp8_matmul")
    dispatch.check_compiled(False, "pallas_kernels.fp8_matmul")


# --------------------------------------------------------------------------------------------
# Public wrappers.


def fp8_matmul(a, b, a_scale, b_scale, *, out_dtype=jnp.bfloat16, config: GemmConfig | None =
               None, autotune: bool = True) -> jax.Array:  # fmt: skip
    """``C = a_scale * b_scale * a @ b^T`` on FP8 tensor cores, fp32 accumulation.

    Args:
      a: ``(M, K)`` FP8 codes (E4M3 or E5M2), row-major (K-major).
      b: ``(N, K)`` FP8 codes, row-major: the weight stored transposed (K-major).
      a_scale, b_scale: fp32 scalars, the dequantization multipliers (``amax / fmt.max``).
      out_dtype: ``bfloat16`` or ``float32``.
      config: force a :class:`GemmConfig` (its pipeline shortened to fit shared memory, see
        :func:`fit_smem`); ``None``: autotuned on the first eager call per shape (under
        ``jit``: that shape's tuned config, else the default).
      autotune: ``False`` takes an already tuned config or the default, also on eager calls
        (the FP8 recipe's ``gemm_autotune``).

    Returns:
      ``(M, N)`` in ``out_dtype``; equals :func:`fp8_matmul_reference` up to accumulation order.

    Raises:
      TypeError: operands not FP8, or an unsupported ``out_dtype``.
      ValueError: shapes that do not contract, non-scalar scales, a bad config, or no Hopper
        GPU.
    """
    _check_operands(a, b)
    _check_scalar("a_scale", a_scale)
    _check_scalar("b_scale", b_scale)
    out_dtype = _check_out_dtype(out_dtype)
    _check_backend()
    (m, k), n = a.shape, b.shape[0]
    config = _config_for("per_tensor", m, n, k, a, b, out_dtype, config, autotune)
    s = _scalar(a_scale) * _scalar(b_scale)
    return _run(a, b, s, jnp.float32(0), variant="per_tensor", out_dtype=out_dtype,
                config=config, shape=(m, n, k))  # fmt: skip


def fp8_matmul_block_scaled(a, a_scales, b, b_scales, *, out_dtype=jnp.bfloat16,
                            config: GemmConfig | None = None,
                            autotune: bool = True) -> jax.Array:  # fmt: skip
    """Block-scaled FP8 GEMM (DeepSeek-V3): fp32 promotion of every 128 of K.

    Args:
      a: ``(M, K)`` FP8 codes, row-major.
      a_scales: ``(M, ceil(K/128))`` fp32 multipliers of 1x128 tiles of ``a``.
      b: ``(N, K)`` FP8 codes, row-major (K-major weight).
      b_scales: ``(ceil(N/128), ceil(K/128))`` fp32 multipliers of 128x128 blocks of ``b``.
      out_dtype, config, autotune: as :func:`fp8_matmul`.

    Returns:
      ``(M, N)``, equal to :func:`fp8_matmul_block_scaled_reference` up to rounding.
    """
    _check_operands(a, b)
    (m, k), n = a.shape, b.shape[0]
    _check_block_scales(a_scales, b_scales, m, n, k)
    out_dtype = _check_out_dtype(out_dtype)
    _check_backend()
    config = _config_for("block_scaled", m, n, k, a, b, out_dtype, config, autotune)
    return _run(a, b, a_scales, b_scales, variant="block_scaled", out_dtype=out_dtype,
                config=config, shape=(m, n, k))  # fmt: skip


def fp8_matmul_quantize_1x16(a, b, a_scale, b_scale, *, return_amax: bool = False,
                             config: GemmConfig | None = None, autotune: bool = True):  # fmt: skip
    """Per-tensor FP8 GEMM whose output is quantized to E4M3 in 1x16 groups in the kernel.

    Returns:
      A per-group :class:`coat_jax.QuantizedArray` (``data (M, N/16, 16)``, ``amax (M, N/16)``,
      ``last_dim N``), plus the tensor's fp32 ``amax`` (the max of the group maxima, one
      reduction over the ``M N / 16`` group maxima) when ``return_amax``. ``N % 16 != 0``
      runs :func:`fp8_matmul_quantize_1x16_reference`.
    """
    _check_operands(a, b)
    _check_scalar("a_scale", a_scale)
    _check_scalar("b_scale", b_scale)
    _check_backend()
    (m, k), n = a.shape, b.shape[0]
    if n % GROUP:
        return fp8_matmul_quantize_1x16_reference(a, b, a_scale, b_scale, return_amax=return_amax)
    config = _config_for("quantize_1x16", m, n, k, a, b, jnp.float32, config, autotune)
    s = _scalar(a_scale) * _scalar(b_scale)
    codes, amax = _run(a, b, s, jnp.float32(0), variant="quantize_1x16", out_dtype=jnp.float32,
                       config=config, shape=(m, n, k))  # fmt: skip
    q = QuantizedArray(codes.reshape(m, n // GROUP, GROUP), amax, None, n)
    return (q, jnp.max(amax)) if return_amax else q


# --------------------------------------------------------------------------------------------
# General contraction for coat_jax.ops.flow.fp8_gemm: bring both operands to K-major matrices.


def as_k_major(x: jax.Array, contract: int) -> tuple[jax.Array, tuple[int, ...]]:
    """``x`` with its contracted axis last, flattened to ``(rows, K)``, and the kept shape.

    A transpose (one copy of ``x``'s FP8 bytes) only when the contracted axis is not last.
    """
    contract %= x.ndim
    kept = tuple(s for i, s in enumerate(x.shape) if i != contract)
    if contract != x.ndim - 1:
        x = jnp.moveaxis(x, contract, -1)
    return x.reshape(-1, x.shape[-1]), kept


def fp8_dot_general(a_codes, b_codes, scale, contract: tuple[int, int], out_dtype,
                    config: GemmConfig | None = None,
                    autotune: bool = True) -> jax.Array:  # fmt: skip
    """``scale * sum_k a[..., k, ...] b[..., k, ...]`` (one contracted axis each, no batch
    axes) through :func:`fp8_matmul`; result axes: ``a``'s kept axes then ``b``'s."""
    a2, a_kept = as_k_major(a_codes, contract[0])
    b2, b_kept = as_k_major(b_codes, contract[1])
    out = fp8_matmul(a2, b2, scale, jnp.float32(1.0), out_dtype=out_dtype, config=config,
                     autotune=autotune)
    return out.reshape(*a_kept, *b_kept)
