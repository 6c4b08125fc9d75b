r"""FP8 precision flow: differentiable ops whose residuals for backward are FP8 (COAT, section 5).

Each op is a ``jax.custom_vjp`` with its forward, backward and ``defvjp`` side by side, so what
backward reads is explicit. What each op quantizes, and how, is the
:class:`~coat_jax.core.recipe.Fp8Recipe` it is given (a static argument; default: COAT's):

* GEMM operands are quantized **per tensor** just in time (scale from the current ``amax``,
  rounded up to a power of two with ``recipe.pow2_scales``: :func:`_per_tensor`):
  activations and weights in ``recipe.forward_format`` (E4M3) for the forward, output
  gradients in ``recipe.grad_format`` (E5M2) for the backward (both layouts its GEMMs read
  from one Pallas pass where ``recipe.grad_transpose`` picks it); products accumulate in fp32
  (:func:`fp8_gemm`, the one place the recipe's GEMM backend plugs in). With
  ``recipe.scaling`` ``"row"`` or ``"block"`` every operand is scaled along its contracted axis
  instead (:mod:`coat_jax.ops.scaled_gemm`; the weight-gradient GEMM's operands along the
  tokens), and backward keeps the weights themselves rather than FP8 copies.
* ``recipe.forward_gemm == "bf16"``: the forward GEMMs run in BF16, the backward's in FP8 as
  above; what is saved for backward does not change.
* Inputs of non-linear layers are saved in groups of ``recipe.saved_group`` (1x16) along the
  hidden axis, in ``recipe.saved_format`` (E4M3).

Ops, with what each saves for backward (``T`` tokens, ``h`` hidden, ``f`` MLP width):

=========================  =================================================================
``fp8_project``            ``x @ W_i`` for several ``W_i``; saves ``x`` FP8 per tensor (T h
                           bytes) and the FP8 weights. The TransformerEngine-like linear.
``fp8_norm_project``       ``norm(x) @ W_i`` (RMSNorm, or OLMo's weightless LayerNorm); saves
                           ``x`` FP8 1x16 (1.25 T h bytes), the norm weight (if any) and the
                           normed input's scale; the GEMM operand is recomputed in backward.
``fp8_swiglu_project``     ``(silu(g) * u) @ W``; saves ``g``, ``u`` FP8 1x16 and one scale; the
                           GEMM operand is recomputed in backward.
``fp8_mlp``                the two above as COAT's MLP; saves what they save. Fused
                           (``recipe.fused_mlp``), ``g`` and ``u`` leave their GEMMs as those
                           1x16 groups (the kernel's epilogue), never as BF16.
=========================  =================================================================

The COAT forward consumes the dequantized FP8 input (as COAT's FP8 kernels do), so backward's
recomputation reproduces the forward's GEMM operand exactly (same values, same saved scale).
With ``recipe.fused_quantize`` resolving to a kernel, those forwards (save the 1x16 copies,
apply the op, quantize its output per tensor) run as the two Pallas passes of
:mod:`pallas_kernels.fused_quantize`, per shard under a mesh; same codes, same residuals.
The ops without FP8 (norm, SwiGLU, RoPE, attention) are :mod:`coat_jax.ops.plain`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from coat_jax.core.quant import QuantizedArray, dequantize, finite_amax, pow2_amax, quantize
from coat_jax.core.recipe import Fp8Recipe
from coat_jax.ops import scaled_gemm, sharded_gemm, sharding
from coat_jax.ops.plain import norm_fp32, swiglu_fp32
from pallas_kernels import dispatch, fp8_matmul, fused_backward, fused_quantize
from pallas_kernels import quantize as quantize_kernels

__all__ = [
    "fp8_gemm",
    "fp8_mlp",
    "fp8_norm_project",
    "fp8_project",
    "fp8_swiglu_project",
    "fused_kernels",
]

COAT = Fp8Recipe()
"""The default recipe: COAT's formats, 1x16 groups, XLA's cuBLASLt GEMMs."""


# --------------------------------------------------------------------------------------------
# The GEMM: one function behind which the backend (XLA cuBLASLt FP8 or Pallas) is chosen.


def fp8_gemm(
    a: QuantizedArray,
    b: QuantizedArray,
    contract: tuple[int, int],
    out_dtype=jnp.float32,
    recipe: Fp8Recipe = COAT,
    *,
    partials_in_out_dtype: bool = False,
) -> jax.Array:
    """``sum_k a[..., k] b[k, ...]`` of two per-tensor FP8 operands, in ``out_dtype``.

    FP8 codes feed ``lax.dot_general`` directly with fp32 accumulation, the pattern that XLA
    rewrites into a cuBLASLt FP8 GEMM on Hopper; the two scales multiply the fp32 product and
    the cast to ``out_dtype`` follow it (XLA writes the fp32 product and a fusion reads it
    back: ``bench/fp8_epilogue.py``); with ``recipe.gemm_product == "bf16"`` the GEMM writes a
    BF16 product instead (half the bytes, one more rounding) and its consumer scales it.
    Where ``recipe.gemm`` picks Pallas for this shape
    (:func:`pallas_kernels.dispatch.gemm_backend`; under a mesh, for each device's shard of
    it) the Pallas wgmma kernel runs instead (:mod:`pallas_kernels.fp8_matmul`, on every
    shard through :mod:`coat_jax.ops.sharded_gemm`; operands moved to K-major first, a copy
    for each operand whose contracted axis is not its last).

    Args:
      a, b: per-tensor :class:`QuantizedArray` operands.
      contract: the contracted axis of ``a`` and of ``b``.
      out_dtype: dtype of the result.
      recipe: supplies the backend (``gemm``) and the Pallas kernel's ``gemm_autotune``.
      partials_in_out_dtype: the XLA GEMM emits ``out_dtype`` itself (fp32 accumulation
        inside it) and the scales multiply afterwards, so that where the contracted axis is
        sharded, the partial sums the partitioner reduces across devices are ``out_dtype``
        (BF16 weight gradients: a BF16 reduce-scatter, half the bytes of an fp32 one), at one
        more rounding to ``out_dtype``. Off, the scales join the fp32 product before the cast.
    """
    ca, cb = contract[0] % a.data.ndim, contract[1] % b.data.ndim
    pallas_out = jnp.dtype(out_dtype) in fp8_matmul.OUT_DTYPES
    if pallas_out and recipe.gemm != "xla":
        shape = sharded_gemm.local_shape(a.data.shape, b.data.shape, (ca, cb))
        if dispatch.gemm_backend(recipe.gemm, shape) == "pallas" and (
            shape is not None or recipe.gemm == "pallas"  # (dot_general says why it cannot)
        ):
            return sharded_gemm.dot_general(
                a.data, b.data, a.scale * b.scale, (ca, cb), out_dtype,
                autotune=recipe.gemm_autotune, partials_in_out_dtype=partials_in_out_dtype,
            )  # fmt: skip
    dims = (((ca,), (cb,)), ((), ()))
    product_dtype = out_dtype if partials_in_out_dtype else jnp.float32
    if recipe.gemm_product == "bf16":
        product_dtype = jnp.bfloat16
    out = jax.lax.dot_general(a.data, b.data, dims, preferred_element_type=product_dtype)
    return (out.astype(jnp.float32) * (a.scale * b.scale)).astype(out_dtype)


def _matrix(x):
    """Collapses all leading axes: ``(..., K) -> (M, K)``."""
    return x.reshape(-1, x.shape[-1])


def _operand_amax(amax, fmt, recipe: Fp8Recipe):
    """A per-tensor GEMM operand's ``amax`` as the recipe scales it: rounded up to
    ``fmt.max * 2^k`` with ``recipe.pow2_scales`` (:func:`~coat_jax.core.quant.pow2_amax`,
    idempotent: a saved operand's ``amax`` passes through unchanged), else as measured."""
    return pow2_amax(amax, fmt) if recipe.pow2_scales else amax


def _per_tensor(x, fmt, recipe: Fp8Recipe, amax=None) -> QuantizedArray:
    """``x`` quantized per tensor as a GEMM operand in ``fmt`` with ``amax`` (``None``: its
    own ``max |x|``), its scale as :func:`_operand_amax` makes it."""
    if recipe.pow2_scales:
        amax = _operand_amax(finite_amax(x) if amax is None else amax, fmt, recipe)
    return quantize(x, fmt, amax=amax)


def _project_backward(x_saved, w_saved, douts, w_dtypes, recipe: Fp8Recipe, dout_amaxes=None):
    """Shared backward of a projection ``y_i = x @ W_i``: ``(dx, (dW_i, ...))``.

    ``x_saved`` / ``w_saved`` are what :func:`_project_forward` returned for backward (per
    tensor: FP8 ``x`` and FP8 weights; finer scaling: ``x^T`` as an FP8 operand along the
    tokens, and the weights themselves). ``dx`` comes in the output gradients' dtype (summed
    in fp32 over several kernels), each ``dW_i`` in its kernel's dtype, straight from its
    GEMM (``partials_in_out_dtype``): with BF16 weights (``grad_dtype=bfloat16``) the weight
    gradients' reduction over data-parallel shards runs in BF16, as the BF16 policy's does.
    ``dout_amaxes``: each output gradient's ``max |dy|`` where the caller has it
    (:func:`_materialized`), else measured here.
    """
    if recipe.scaling != "tensor":
        return _scaled_backward(x_saved, w_saved, douts, w_dtypes, recipe)
    dx, dy_operands = _input_grads(w_saved, douts, recipe, dout_amaxes)
    return dx, _weight_grads(x_saved, dy_operands, w_dtypes, recipe)


def _input_grads(w_saved, douts, recipe: Fp8Recipe, dout_amaxes=None):
    """``(dx, (dy_i's weight-gradient operand, ...))`` of per-tensor projections ``y_i = x @
    W_i``: ``dx = sum_i dy_i @ W_i^T`` in the output gradients' dtype (summed in fp32 over
    several kernels), and each output gradient in ``recipe.grad`` as :func:`_weight_grads`
    reads it (:func:`_grad_operands`)."""
    w_saved = _weight_codes(w_saved, douts[0], recipe)
    dx_dtype = douts[0].dtype
    term_dtype = dx_dtype if len(w_saved) == 1 else jnp.float32
    dx, wgrad_operands = None, []
    dout_amaxes = (None,) * len(douts) if dout_amaxes is None else dout_amaxes
    for wq, dy, dy_amax in zip(w_saved, douts, dout_amaxes, strict=True):
        dyq, wgrad_operand = _grad_operands(dy, dy_amax, recipe)
        term = fp8_gemm(dyq, wq, contract=(-1, 1), out_dtype=term_dtype, recipe=recipe)
        dx = term if dx is None else dx + term
        wgrad_operands.append(wgrad_operand)
    return dx.astype(dx_dtype), tuple(wgrad_operands)


def _grad_operands(dy, amax, recipe: Fp8Recipe):
    r"""``(dy_q, (dy's codes as a matrix, its contracted axis))``: the output gradient ``dy
    (..., N)`` quantized per tensor in ``recipe.grad`` with ``amax`` (``None``: its own), as
    ``dx = dy W^T`` reads it, and as the weight-gradient GEMM ``dW = x^T dy`` contracts it over
    the ``M`` tokens.

    With ``recipe.grad_transpose`` resolving to the kernel, one Pallas pass over ``dy`` writes
    both: ``Q(dy)`` ``(..., N)`` and ``Q(dy)^T`` ``(N, M)``, K-major as an FP8 tensor-core GEMM
    wants it (:func:`pallas_kernels.quantize.quantize_transpose_per_tensor`; same codes as
    :func:`~coat_jax.core.quant.quantize`); under a multi-device mesh on every device's shard
    (tokens split like the batch, ``N`` like the MLP where it divides). Else ``Q(dy)`` alone
    ``(M, N)``, contracted over axis 0, and XLA writes the copy the GEMM needs."""
    mode = _grad_transpose_mode(recipe)
    if mode is None:
        dyq = _per_tensor(dy, recipe.grad, recipe, amax)
        return dyq, (QuantizedArray(_matrix(dyq.data), dyq.amax), 0)
    amax = finite_amax(dy) if amax is None else jnp.asarray(amax, jnp.float32)
    amax = _operand_amax(amax, recipe.grad, recipe)
    dy2 = _matrix(dy)

    def local(d, a):
        q, q_t = quantize_kernels.quantize_transpose_per_tensor(d, a, recipe.grad,
                                                                interpret=mode == "interpret")
        return q.data, q_t.data

    mesh = dispatch.multi_device_mesh()
    if mesh is None:
        codes, codes_t = local(dy2, amax)
    else:
        P = jax.sharding.PartitionSpec
        rows = sharding.fits(mesh, sharding.RULES["batch"], dy2.shape[0])
        col = sharding.fits(mesh, sharding.RULES["mlp"], dy2.shape[1])
        codes, codes_t = jax.shard_map(
            local, mesh=mesh, in_specs=(P(rows, col), P()),
            out_specs=(P(rows, col), P(col, rows)), check_vma=False,
        )(dy2, amax)  # fmt: skip
    return QuantizedArray(codes.reshape(dy.shape), amax), (QuantizedArray(codes_t, amax), 1)


def _grad_transpose_mode(recipe: Fp8Recipe) -> str | None:
    """``"pallas"`` / ``"interpret"`` where :func:`_grad_operands` runs the quantize-transpose
    kernel (per-tensor scaling), else ``None``."""
    if recipe.scaling != "tensor":
        return None
    mode = dispatch.resolve(recipe.grad_transpose, "quantize_transpose")
    return None if mode == "reference" else mode


def _weight_grads(x_saved, wgrad_operands, w_dtypes, recipe: Fp8Recipe):
    """``(x^T dy_i, ...)`` over all tokens of the per-tensor FP8 input and the output gradients'
    operands from :func:`_input_grads`, each in its weight's dtype (:func:`fp8_gemm`'s
    ``partials_in_out_dtype``)."""
    x2 = QuantizedArray(_matrix(x_saved.data), x_saved.amax)
    return tuple(
        fp8_gemm(x2, dyq, contract=(0, axis), out_dtype=dtype, recipe=recipe,
                 partials_in_out_dtype=True)
        for (dyq, axis), dtype in zip(wgrad_operands, w_dtypes, strict=True)
    )  # fmt: skip


def _scaled_backward(xt, kernels, douts, w_dtypes, recipe: Fp8Recipe):
    """:func:`_project_backward` with row or block scales (:mod:`coat_jax.ops.scaled_gemm`):
    ``dx = dy @ W^T`` from ``dy`` scaled along ``N`` and ``W (K, N)`` along ``N``;
    ``dW = x^T dy`` from ``xt`` and ``dy^T`` scaled along the tokens."""
    operand = functools.partial(scaled_gemm.quantize_operand, scaling=recipe.scaling)
    dx = None
    dws = []
    for w, dy, dtype in zip(kernels, douts, w_dtypes, strict=True):
        dy2 = _matrix(dy)
        wq = operand(w, recipe.forward, role="weight")
        term = scaled_gemm.scaled_matmul(operand(dy2, recipe.grad, role="activation"), wq)
        dx = term if dx is None else dx + term
        dyt = operand(dy2.T, recipe.grad, role="activation")
        dws.append(scaled_gemm.scaled_matmul(xt, dyt, dtype, partials_in_out_dtype=True))
    return dx.reshape(*douts[0].shape[:-1], -1).astype(douts[0].dtype), tuple(dws)


def _dtypes(arrays) -> tuple:
    return tuple(jnp.dtype(a.dtype) for a in arrays)


def _project_forward(x, kernels, out_dtype, recipe: Fp8Recipe):
    """``(x @ W_i for each kernel, (x, weights) as backward reads them)``.

    Per tensor: ``x`` is quantized once and saved with the FP8 weights. Row or block scales:
    ``x`` and each weight are quantized as GEMM operands, and backward gets ``x^T`` quantized
    along the tokens (for ``dW``) and the weights themselves (requantized along ``N`` for
    ``dx``). With ``recipe.forward_gemm == "bf16"`` the products are BF16 GEMMs of ``x`` and
    the weights, and backward gets the same FP8 operands.
    """
    if recipe.forward_gemm == "bf16":
        outs = tuple(jnp.dot(x, w.astype(x.dtype)).astype(out_dtype) for w in kernels)
        return outs, _backward_operands(x, kernels, recipe)
    if recipe.scaling == "tensor":
        return _project_quantized(_per_tensor(x, recipe.forward, recipe), kernels, out_dtype,
                                  recipe)  # fmt: skip
    operand = functools.partial(scaled_gemm.quantize_operand, scaling=recipe.scaling)
    x2 = _matrix(x)
    xq = operand(x2, recipe.forward, role="activation")
    outs = tuple(
        scaled_gemm.scaled_matmul(xq, operand(w.T, recipe.forward, role="weight"), out_dtype)
        .reshape(*x.shape[:-1], w.shape[1])
        for w in kernels
    )  # fmt: skip
    return outs, _backward_operands(x, kernels, recipe)


def _project_quantized(xq: QuantizedArray, kernels, out_dtype, recipe: Fp8Recipe):
    """:func:`_project_forward` per tensor, from ``x`` already quantized (``xq``)."""
    wqs = tuple(_per_tensor(w, recipe.forward, recipe) for w in kernels)
    outs = tuple(fp8_gemm(xq, wq, (-1, 0), out_dtype, recipe) for wq in wqs)
    return outs, (xq, _saved_weights(kernels, wqs, recipe))


def _saved_weights(kernels, wqs, recipe: Fp8Recipe):
    """What backward keeps of per-tensor FP8 weights ``wqs``: the codes themselves
    (``recipe.saved_weights == "fp8"``: 1 byte a parameter, every layer's held from its
    forward to its backward), or the weights and their ``amax`` (``"requantize"``: nothing
    the step does not hold anyway; :func:`_weight_codes` rebuilds the same codes)."""
    if recipe.saved_weights == "fp8":
        return wqs
    return tuple((w, wq.amax) for w, wq in zip(kernels, wqs, strict=True))


def _in_backward(saved, dout):
    """``saved`` (residuals) as backward reads them: behind an optimization barrier with the
    output gradient ``dout``. What backward computes from them then can neither be merged with
    the forward's identical computation (XLA's CSE) nor run before backward reaches this layer.
    Without it XLA merged backward's dequantization of the saved FP8 groups with the forward's
    and kept the forward's BF16 result from forward to backward in place of the FP8 codes:
    1.25 -> 2 bytes an element of every saved group, and the forward's FP8 operands that
    backward requantizes alike (Llama-2-7B on an H200, every memory option: 5.19 -> 3.24 GB a
    2048-token sequence; ``docs/results.md``)."""
    saved, _ = jax.lax.optimization_barrier((saved, dout))
    return saved


def _weight_codes(w_saved, dout, recipe: Fp8Recipe):
    """The FP8 weights backward multiplies by, from :func:`_saved_weights`: the forward's
    codes, requantized with the forward's ``amax`` where only the weights were kept (after the
    output gradient ``dout``: :func:`_in_backward`)."""
    if recipe.saved_weights == "fp8":
        return w_saved
    return tuple(_per_tensor(w, recipe.forward, recipe, amax)
                 for w, amax in _in_backward(w_saved, dout))  # fmt: skip


def fused_kernels(recipe: Fp8Recipe) -> tuple[str, ...]:
    """The ``Fp8Recipe`` options of the fused precision flow (``fused_quantize``, ``fused_mlp``,
    ``fused_backward``, ``grad_transpose``) whose kernels the COAT ops run under ``recipe``
    here: on this backend, in the mesh in context (``pallas_kernels.dispatch``: ``auto`` where
    measured faster). ``grad_transpose`` runs in every per-tensor FP8 projection's backward,
    FP8-linear's too.

    Raises:
      ValueError: an option is ``"pallas"`` off a Hopper GPU.
    """
    modes = {"fused_quantize": _fused_mode(recipe), "fused_mlp": _fused_mlp_mode(recipe),
             "fused_backward": _fused_backward_mode(recipe),
             "grad_transpose": _grad_transpose_mode(recipe)}  # fmt: skip
    return tuple(name for name, mode in modes.items() if mode is not None)


def _fused_mode(recipe: Fp8Recipe) -> str | None:
    """``"pallas"`` / ``"interpret"`` where the COAT ops' forwards run
    :mod:`pallas_kernels.fused_quantize` (per-tensor FP8 forward GEMMs), else ``None``."""
    if recipe.scaling != "tensor" or recipe.forward_gemm != "fp8":
        return None
    mode = dispatch.resolve(recipe.fused_quantize, "fused_quantize")
    return None if mode == "reference" else mode


def _save_and_operand(rows, fn, extras, whole_rows: bool, recipe: Fp8Recipe, mode: str):
    """:func:`pallas_kernels.fused_quantize.save_and_operand` of the matrices ``rows``; under a
    multi-device mesh on every device's shard (``jax.shard_map``): rows split like the batch
    (``data x fsdp``), an element-wise op's columns like the MLP (``tensor``), and the tensor's
    ``amax`` the ``pmax`` of the shards' (then as :func:`_operand_amax` scales it)."""
    kwargs = dict(saved_fmt=recipe.saved, group=recipe.saved_group, operand_fmt=recipe.forward,
                  whole_rows=whole_rows, interpret=mode == "interpret")  # fmt: skip
    scaled = lambda m: _operand_amax(m, recipe.forward, recipe)
    mesh = dispatch.multi_device_mesh()
    if mesh is None:
        return fused_quantize.save_and_operand(rows, fn, extras, amax_of=scaled, **kwargs)
    n_rows, cols = rows[0].shape
    tile, vector = _shard_specs(mesh, n_rows, cols, whole_rows, recipe)
    P = jax.sharding.PartitionSpec
    amax_of = lambda m: scaled(jax.lax.pmax(m, mesh.axis_names))

    def local(rows, extras):
        saved, yq = fused_quantize.save_and_operand(rows, fn, extras, amax_of=amax_of, **kwargs)
        return tuple((q.data.reshape(q.data.shape[0], -1), q.amax) for q in saved), (yq.data,
                                                                                     yq.amax)

    saved, (y_codes, y_amax) = jax.shard_map(
        local, mesh=mesh, in_specs=((tile,) * len(rows), (vector,) * len(extras)),
        out_specs=(((tile, tile),) * len(rows), (tile, P())), check_vma=False,
    )(tuple(rows), tuple(extras))  # fmt: skip
    group = recipe.saved_group
    saved = tuple(QuantizedArray(c.reshape(n_rows, cols // group, group), a, None, cols)
                  for c, a in saved)  # fmt: skip
    return saved, QuantizedArray(y_codes, y_amax)


def _shard_specs(mesh, n_rows: int, cols: int, whole_rows: bool, recipe: Fp8Recipe):
    """``(tile, vector)`` partition specs of a fused kernel's ``(rows, cols)`` matrices and
    ``(cols,)`` vectors under ``mesh``: rows split like the batch (``data x fsdp``), an
    element-wise op's columns like the MLP (``tensor``) where every shard holds whole groups."""
    row_axes = sharding.fits(mesh, sharding.RULES["batch"], n_rows)
    col_axis = None if whole_rows else sharding.fits(mesh, sharding.RULES["mlp"], cols)
    if col_axis is not None and (cols // mesh.shape[col_axis]) % recipe.saved_group:
        col_axis = None  # whole groups on every shard
    P = jax.sharding.PartitionSpec
    return P(row_axes, col_axis), P(col_axis)


def _fused_saved_operand(inputs, fn, extras, whole_rows: bool, recipe: Fp8Recipe, mode: str):
    """``(saved inputs, operand)`` of a COAT op's forward through the fused kernels: ``inputs
    (..., c)`` saved in 1x``saved_group`` groups, and ``fn`` of them quantized per tensor."""
    lead, cols = inputs[0].shape[:-1], inputs[0].shape[-1]
    saved, yq = _save_and_operand(tuple(x.reshape(-1, cols) for x in inputs), fn, tuple(extras),
                                  whole_rows, recipe, mode)  # fmt: skip
    groups = cols // recipe.saved_group
    saved = tuple(
        QuantizedArray(q.data.reshape(*lead, groups, -1), q.amax.reshape(*lead, groups), None,
                       cols)  # fmt: skip
        for q in saved
    )
    return saved, QuantizedArray(yq.data.reshape(*lead, cols), yq.amax)


def _fused_forward(inputs, fn, extras, kernels, whole_rows: bool, recipe: Fp8Recipe, mode: str):
    """``(outs, saved inputs, operand amax, saved weights)``: :func:`_fused_saved_operand`,
    then the operand multiplied by each kernel."""
    saved, yq = _fused_saved_operand(inputs, fn, extras, whole_rows, recipe, mode)
    outs, (_, w_saved) = _project_quantized(yq, kernels, inputs[0].dtype, recipe)
    return outs, saved, yq.amax, w_saved


def _backward_operands(x, kernels, recipe: Fp8Recipe):
    """What backward reads of a projection whose forward did not leave FP8 operands to keep
    (a BF16 forward; finer scaling, whose forward operands are scaled along ``K``): per
    tensor, FP8 ``x`` and FP8 weights; finer scaling, ``x^T`` along the tokens and the
    weights."""
    if recipe.scaling == "tensor":
        wqs = tuple(_per_tensor(w, recipe.forward, recipe) for w in kernels)
        return _per_tensor(x, recipe.forward, recipe), _saved_weights(kernels, wqs, recipe)
    return _wgrad_operand(x, recipe), tuple(kernels)


def _wgrad_operand(x, recipe: Fp8Recipe):
    """``x^T (K, tokens)`` as the weight-gradient GEMM's FP8 operand (finer scaling only)."""
    return scaled_gemm.quantize_operand(
        _matrix(x).T, recipe.forward, scaling=recipe.scaling, role="activation"
    )


def _backward_x(y, y_amax, recipe: Fp8Recipe):
    """What :func:`_project_backward` reads of a GEMM input ``y`` recomputed in backward: per
    tensor ``y`` quantized with the forward's ``amax`` (measured afresh after a BF16 forward),
    else its weight-gradient operand."""
    if recipe.scaling == "tensor":
        return _per_tensor(y, recipe.forward, recipe, y_amax)
    return _wgrad_operand(y, recipe)


# --------------------------------------------------------------------------------------------
# fp8_project: the TransformerEngine-like FP8 linear (saves its input in FP8, per tensor).


def fp8_project(
    x: jax.Array, kernels: tuple[jax.Array, ...], recipe: Fp8Recipe = COAT
) -> tuple[jax.Array, ...]:
    """``(x @ W_1, x @ W_2, ...)`` in FP8, quantizing ``x`` once; outputs in ``x.dtype``.

    Args:
      x: activations ``(..., K)``.
      kernels: weights ``(K, N_i)`` in any float dtype (gradients come back in that dtype).
      recipe: the FP8 recipe (formats and GEMM backend).
    """
    _check_project(x, kernels)
    return _fp8_project(_dtypes(kernels), recipe, x, tuple(kernels))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fp8_project(w_dtypes, recipe, x, kernels):
    return _fp8_project_fwd(w_dtypes, recipe, x, kernels)[0]


def _fp8_project_fwd(w_dtypes, recipe, x, kernels):
    del w_dtypes
    return _project_forward(x, kernels, x.dtype, recipe)


def _fp8_project_bwd(w_dtypes, recipe, residuals, douts):
    x_saved, w_saved = residuals
    dx, dws = _project_backward(x_saved, w_saved, douts, w_dtypes, recipe)
    return dx.astype(douts[0].dtype), dws


_fp8_project.defvjp(_fp8_project_fwd, _fp8_project_bwd)


# --------------------------------------------------------------------------------------------
# COAT fused ops: FP8 1x16 inputs saved, FP8 per-tensor GEMM operands recomputed in backward.


def _save_groups(x, recipe: Fp8Recipe):
    return quantize(x, recipe.saved, group_size=recipe.saved_group)


def fp8_norm_project(
    x: jax.Array,
    norm_scale: jax.Array | None,
    kernels: tuple[jax.Array, ...],
    eps: float = 1e-6,
    recipe: Fp8Recipe = COAT,
    kind: str = "rms",
) -> tuple[jax.Array, ...]:
    """``(norm(x) @ W_1, ...)`` with ``x`` saved as FP8 groups; outputs in ``x.dtype``.

    Args:
      x: residual stream ``(..., h)``; ``h`` must be a multiple of ``recipe.saved_group``.
      norm_scale: RMSNorm weight ``(h,)``; ``None`` for ``kind="layer"``.
      kernels: projection weights ``(h, N_i)``.
      eps: the norm's epsilon.
      recipe: the FP8 recipe.
      kind: ``"rms"`` or ``"layer"`` (:func:`coat_jax.ops.plain.norm_fp32`).
    """
    _check_project(x, kernels)
    _check_groups(x, "fp8_norm_project: x", recipe)
    return _fp8_norm_project(eps, kind, _dtypes(kernels), recipe, x, norm_scale, tuple(kernels))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _fp8_norm_project(eps, kind, w_dtypes, recipe, x, norm_scale, kernels):
    return _fp8_norm_project_fwd(eps, kind, w_dtypes, recipe, x, norm_scale, kernels)[0]


def _fp8_norm_project_fwd(eps, kind, w_dtypes, recipe, x, norm_scale, kernels):
    del w_dtypes
    if _fused_mode(recipe) is not None:
        xg, yq = _norm_operand(eps, kind, recipe, x, norm_scale)
        outs, (_, w_saved) = _project_quantized(yq, kernels, x.dtype, recipe)
        return outs, (xg, norm_scale, yq.amax, w_saved)
    xg, y = _norm_of_saved(eps, kind, recipe, x, norm_scale)
    outs, (yq, w_saved) = _project_forward(y, kernels, x.dtype, recipe)
    return outs, (xg, norm_scale, _amax(yq), w_saved)


def _norm_of_saved(eps, kind, recipe, x, norm_scale):
    """``(x saved in 1x16 groups, the norm of that saved copy dequantized)``: what backward
    recomputes is then the forward's operand exactly.

    The norm reads the saved codes behind an optimization barrier. Without it XLA computes
    the row's ``rms`` in the fusion that writes the codes and hands the norm's consumers the
    dequantized copy it had there, written to memory in fp32 (excess precision: 4 bytes an
    element written and read again against the codes' one; 0.36 ms a layer in a 2-layer 7B
    step at batch 8, docs/results.md); behind it every consumer dequantizes the codes itself."""
    xg = jax.lax.optimization_barrier(_save_groups(x, recipe))
    return xg, norm_fp32(dequantize(xg, x.dtype), norm_scale, eps, kind).astype(x.dtype)


def _norm_operand(eps, kind, recipe, x, norm_scale):
    """``(x saved in 1x16 groups, norm(x) quantized per tensor)``: the COAT norm's forward up to
    its GEMMs, for per-tensor FP8 forward GEMMs; through :mod:`pallas_kernels.fused_quantize`
    where ``recipe.fused_quantize`` picks it, else as :func:`_norm_of_saved`."""
    mode = _fused_mode(recipe)
    if mode is not None:
        fn = lambda xd, *scale: norm_fp32(xd, *(scale or (None,)), eps, kind).astype(x.dtype)
        extras = () if norm_scale is None else (norm_scale,)
        (xg,), yq = _fused_saved_operand((x,), fn, extras, True, recipe, mode)
        return xg, yq
    xg, y = _norm_of_saved(eps, kind, recipe, x, norm_scale)
    return xg, _per_tensor(y, recipe.forward, recipe)


def _fp8_norm_project_bwd(eps, kind, w_dtypes, recipe, residuals, douts, dout_amaxes=None):
    xg, norm_scale, y_amax, w_saved = residuals
    dtype = douts[0].dtype
    xg = _in_backward(xg, douts)
    norm = lambda a, s=None: norm_fp32(a, s, eps, kind).astype(dtype)
    mode = _fused_backward_mode(recipe)
    if mode is not None:  # dy first, then one kernel reads the saved groups once
        dy, dy_operands = _input_grads(w_saved, douts, recipe, dout_amaxes)
        extras = () if norm_scale is None else (norm_scale,)
        yq, (dx,), _, dscales = _operand_and_grads((xg,), dy, norm, extras, y_amax, recipe,
                                                   mode, whole_rows=True)  # fmt: skip
        dscale = dscales[0] if dscales else None
        return dx, dscale, _weight_grads(yq, dy_operands, w_dtypes, recipe)
    y, norm_vjp = jax.vjp(norm, dequantize(xg, dtype), norm_scale)
    yq = _backward_x(y, y_amax, recipe)
    dy, dws = _project_backward(yq, w_saved, douts, w_dtypes, recipe, dout_amaxes)
    dx, dscale = norm_vjp(dy)
    dscale = None if norm_scale is None else dscale.astype(norm_scale.dtype)
    return dx.astype(douts[0].dtype), dscale, dws


_fp8_norm_project.defvjp(_fp8_norm_project_fwd, _fp8_norm_project_bwd)


def fp8_swiglu_project(
    gate: jax.Array, up: jax.Array, kernel: jax.Array, recipe: Fp8Recipe = COAT
) -> jax.Array:
    """``(silu(gate) * up) @ W`` with ``gate``, ``up`` saved as FP8 groups.

    Args:
      gate, up: ``(..., f)``; ``f`` must be a multiple of ``recipe.saved_group``.
      kernel: down-projection weight ``(f, h)``.
      recipe: the FP8 recipe.
    """
    if gate.shape != up.shape:
        raise ValueError(f"fp8_swiglu_project: gate {gate.shape} and up {up.shape} differ")
    _check_project(gate, (kernel,))
    _check_groups(gate, "fp8_swiglu_project: gate", recipe)
    return _fp8_swiglu_project(jnp.dtype(kernel.dtype), recipe, gate, up, kernel)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fp8_swiglu_project(w_dtype, recipe, gate, up, kernel):
    return _fp8_swiglu_project_fwd(w_dtype, recipe, gate, up, kernel)[0]


def _fp8_swiglu_project_fwd(w_dtype, recipe, gate, up, kernel):
    del w_dtype
    dtype = gate.dtype
    mode = _fused_mode(recipe)
    if mode is not None:
        fn = lambda g, u: swiglu_fp32(g, u).astype(dtype)
        (out,), (gq, uq), h_amax, w_saved = _fused_forward((gate, up), fn, (), (kernel,), False,
                                                           recipe, mode)  # fmt: skip
        return out, (gq, uq, h_amax, w_saved)
    gq, uq = _save_groups(gate, recipe), _save_groups(up, recipe)
    h = swiglu_fp32(dequantize(gq, dtype), dequantize(uq, dtype)).astype(dtype)
    (out,), (hq, w_saved) = _project_forward(h, (kernel,), dtype, recipe)
    return out, (gq, uq, _amax(hq), w_saved)


def _fp8_swiglu_project_bwd(w_dtype, recipe, residuals, dout):
    return _swiglu_project_grads(w_dtype, recipe, residuals, dout)[:3]


def _swiglu_project_grads(w_dtype, recipe, residuals, dout):
    """``(dgate, dup, dW, (max |dgate|, max |dup|) or None)``: SwiGLU-project's backward.

    With the fused backward (:func:`_fused_backward_mode`) the down projection's input
    gradient ``dh`` comes first, then one kernel reads the saved groups once and writes ``h``'s
    FP8 codes for the weight gradient, both input gradients and their maxima
    (:mod:`pallas_kernels.fused_backward`); else XLA's ops, without the maxima."""
    gq, uq, h_amax, w_saved = residuals
    dtype = dout.dtype
    gq, uq = _in_backward((gq, uq), dout)
    swiglu = lambda g, u: swiglu_fp32(g, u).astype(dtype)
    mode = _fused_backward_mode(recipe)
    if mode is None:
        h, swiglu_vjp = jax.vjp(swiglu, dequantize(gq, dtype), dequantize(uq, dtype))
        hq = _backward_x(h, h_amax, recipe)
        dh, (dw,) = _project_backward(hq, w_saved, (dout,), (w_dtype,), recipe)
        dgate, dup = swiglu_vjp(dh)
        return dgate.astype(dtype), dup.astype(dtype), dw, None
    dh, dout_operands = _input_grads(w_saved, (dout,), recipe)
    hq, (dgate, dup), maxima, _ = _operand_and_grads((gq, uq), dh, swiglu, (), h_amax, recipe,
                                                     mode)  # fmt: skip
    return dgate, dup, _weight_grads(hq, dout_operands, (w_dtype,), recipe)[0], maxima


def _fused_backward_mode(recipe: Fp8Recipe) -> str | None:
    """``"pallas"`` / ``"interpret"`` where SwiGLU's and the norm-project ops' backwards run
    :mod:`pallas_kernels.fused_backward` (per-tensor scaling), else ``None``."""
    if recipe.scaling != "tensor":
        return None
    mode = dispatch.resolve(recipe.fused_backward, "fused_backward")
    return None if mode == "reference" else mode


def _operand_and_grads(saved, dy, fn, extras, y_amax, recipe: Fp8Recipe, mode: str,
                       whole_rows: bool = False):  # fmt: skip
    """:func:`pallas_kernels.fused_backward.operand_and_grads` of saved groups ``(..., c)``, the
    output gradient ``dy`` and vectors ``extras (c,)``; under a multi-device mesh on every
    device's shard (as :func:`_save_and_operand`): the gradients' maxima the ``pmax`` of the
    shards', the extras' gradients the ``psum`` over the row shards."""
    lead, cols = dy.shape[:-1], dy.shape[-1]
    group = saved[0].data.shape[-1]
    dy2 = dy.reshape(-1, cols)
    kwargs = dict(operand_fmt=recipe.forward, whole_rows=whole_rows, interpret=mode == "interpret")
    mesh = dispatch.multi_device_mesh()
    n_rows, n = dy2.shape[0], len(saved)
    codes = tuple(q.data.reshape(n_rows, cols) for q in saved)
    maxima = tuple(q.amax.reshape(n_rows, -1) for q in saved)

    def local(codes, maxima, dy, extras, **reductions):
        qs = tuple(QuantizedArray(c.reshape(c.shape[0], -1, group), m, None, c.shape[-1])
                   for c, m in zip(codes, maxima, strict=True))  # fmt: skip
        yq, grads, grad_maxima, extra_grads = fused_backward.operand_and_grads(
            qs, dy, fn, extras, operand_amax=y_amax, **reductions, **kwargs)
        return yq.data, grads, grad_maxima, extra_grads

    if mesh is None:
        y_codes, grads, grad_maxima, extra_grads = local(codes, maxima, dy2, extras)
    else:
        tile, vector = _shard_specs(mesh, n_rows, cols, whole_rows, recipe)
        P = jax.sharding.PartitionSpec
        row_axes = tile[0]
        reductions = dict(amax_of=lambda m: jax.lax.pmax(m, mesh.axis_names),
                          sum_of=lambda s: jax.lax.psum(s, row_axes) if row_axes else s)
        y_codes, grads, grad_maxima, extra_grads = jax.shard_map(
            lambda c, m, d, e: local(c, m, d, e, **reductions), mesh=mesh,
            in_specs=((tile,) * n, (tile,) * n, tile, (vector,) * len(extras)),
            out_specs=(tile, (tile,) * n, (P(),) * n, (vector,) * len(extras)), check_vma=False,
        )(codes, maxima, dy2, tuple(extras))  # fmt: skip
    grads = tuple(g.reshape(*lead, cols) for g in grads)
    return QuantizedArray(y_codes.reshape(*lead, cols), y_amax), grads, grad_maxima, extra_grads


_fp8_swiglu_project.defvjp(_fp8_swiglu_project_fwd, _fp8_swiglu_project_bwd)


# --------------------------------------------------------------------------------------------
# fp8_mlp: COAT's pre-norm SwiGLU MLP as one op, SwiGLU's saved groups written by the GEMMs.


def fp8_mlp(
    x: jax.Array,
    norm_scale: jax.Array | None,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    eps: float = 1e-6,
    recipe: Fp8Recipe = COAT,
    kind: str = "rms",
) -> jax.Array:
    r"""``(silu(norm(x) @ W_g) * (norm(x) @ W_u)) @ W_d``, COAT's MLP, in ``x.dtype``.

    Unfused this is :func:`fp8_norm_project` (gate and up, written in BF16) and then
    :func:`fp8_swiglu_project`, which reads them back to save them as FP8 1x16 groups. Fused
    (``recipe.fused_mlp``, :func:`_fused_mlp_mode`) the gate and up GEMMs quantize their fp32
    products straight into those groups in the kernel's epilogue
    (:func:`pallas_kernels.fp8_matmul.fp8_matmul_quantize_1x16`):

    .. math::
        g_q = Q_{1\times16}(s_y s_g\, y_q W_{g,q}), \quad
        u_q = Q_{1\times16}(s_y s_u\, y_q W_{u,q}), \quad
        h = \mathrm{silu}(Q^{-1}(g_q)) \cdot Q^{-1}(u_q)

    and neither ``g`` nor ``u`` is written in BF16. The groups are then what the unfused op
    saves up to one rounding: they quantize the fp32 product, not its BF16 copy. What is saved
    for backward, and the backward itself, are those of the two ops.

    Args:
      x: residual stream ``(..., h)``; ``h`` a multiple of ``recipe.saved_group``.
      norm_scale: RMSNorm weight ``(h,)``; ``None`` for ``kind="layer"``.
      w_gate, w_up: ``(h, f)``; ``f`` a multiple of ``recipe.saved_group``.
      w_down: ``(f, h)``.
      eps, kind: the norm's (:func:`fp8_norm_project`).
      recipe: the FP8 recipe.
    """
    if w_gate.shape != w_up.shape:
        raise ValueError(f"fp8_mlp: w_gate {w_gate.shape} and w_up {w_up.shape} differ")
    _check_project(x, (w_gate, w_up))
    _check_groups(x, "fp8_mlp: x", recipe)
    _check_groups(w_gate, "fp8_mlp: w_gate", recipe)
    if w_down.ndim != 2 or w_down.shape[0] != w_gate.shape[1]:
        raise ValueError(f"fp8_mlp: w_down {w_down.shape} does not take w_gate {w_gate.shape}")
    if _fused_mlp_mode(recipe) is None:
        gate, up = fp8_norm_project(x, norm_scale, (w_gate, w_up), eps, recipe, kind)
        return fp8_swiglu_project(gate, up, w_down, recipe)
    kernels = (w_gate, w_up, w_down)
    return _fp8_mlp(eps, kind, _dtypes(kernels), recipe, x, norm_scale, kernels)


def _fused_mlp_mode(recipe: Fp8Recipe) -> str | None:
    """``"pallas"`` / ``"interpret"`` where :func:`fp8_mlp` runs fused, else ``None``: per-tensor
    FP8 forward GEMMs, saved groups the kernel writes (E4M3, 1x16)."""
    per_tensor = recipe.scaling == "tensor" and recipe.forward_gemm == "fp8"
    if not per_tensor or (recipe.saved_format, recipe.saved_group) != ("e4m3", fp8_matmul.GROUP):
        return None
    mode = dispatch.resolve(recipe.fused_mlp, "fused_mlp")
    return None if mode == "reference" else mode


def _gemm_groups(yq: QuantizedArray, wq: QuantizedArray, recipe: Fp8Recipe, mode: str):
    """``y @ W`` of per-tensor FP8 operands as FP8 1x16 groups of the fp32 product (the kernel's
    epilogue; ``"interpret"``: its jnp reference), shaped as :func:`_save_groups` saves. Under a
    multi-device mesh on every device's shard: its tokens' rows (``data x fsdp``) times the
    weight gathered along ``K``, its ``tensor`` slice of ``N`` where that holds whole groups
    (:func:`_shard_specs`); no reduction."""
    lead, n = yq.data.shape[:-1], wq.data.shape[1]
    y2 = _matrix(yq.data)

    def local(y, w_t, y_scale, w_scale):  # w_t = W^T: the kernel's K-major (N, K)
        if mode == "pallas":
            q = fp8_matmul.fp8_matmul_quantize_1x16(y, w_t, y_scale, w_scale,
                                                    autotune=recipe.gemm_autotune)  # fmt: skip
        else:
            q = fp8_matmul.fp8_matmul_quantize_1x16_reference(y, w_t, y_scale, w_scale)
        return q.data, q.amax

    args = (y2, wq.data.T, yq.scale, wq.scale)
    mesh = dispatch.multi_device_mesh()
    if mesh is None:
        codes, amax = local(*args)
    else:
        (rows, col), _ = _shard_specs(mesh, y2.shape[0], n, False, recipe)
        P = jax.sharding.PartitionSpec
        codes, amax = jax.shard_map(
            local, mesh=mesh, in_specs=(P(rows, None), P(col, None), P(), P()),
            out_specs=(P(rows, col, None), P(rows, col)), check_vma=False,
        )(*args)  # fmt: skip
    groups = n // fp8_matmul.GROUP
    return QuantizedArray(codes.reshape(*lead, groups, fp8_matmul.GROUP),
                          amax.reshape(*lead, groups), None, n)  # fmt: skip


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _fp8_mlp(eps, kind, w_dtypes, recipe, x, norm_scale, kernels):
    return _fp8_mlp_fwd(eps, kind, w_dtypes, recipe, x, norm_scale, kernels)[0]


def _fp8_mlp_fwd(eps, kind, w_dtypes, recipe, x, norm_scale, kernels):
    del w_dtypes
    dtype, mode = x.dtype, _fused_mlp_mode(recipe)
    w_gate, w_up, w_down = kernels
    xg, yq = _norm_operand(eps, kind, recipe, x, norm_scale)
    wqs = tuple(_per_tensor(w, recipe.forward, recipe) for w in (w_gate, w_up))
    gq, uq = (_gemm_groups(yq, wq, recipe, mode) for wq in wqs)
    h = swiglu_fp32(dequantize(gq, dtype), dequantize(uq, dtype)).astype(dtype)
    (h,), (h_amax,) = _materialized((h,))
    hq = _per_tensor(h, recipe.forward, recipe, h_amax)
    (out,), (_, w_down_saved) = _project_quantized(hq, (w_down,), dtype, recipe)
    norm_residuals = (xg, norm_scale, yq.amax, _saved_weights((w_gate, w_up), wqs, recipe))
    return out, (norm_residuals, (gq, uq, hq.amax, w_down_saved))


def _fp8_mlp_bwd(eps, kind, w_dtypes, recipe, residuals, dout):
    norm_residuals, swiglu_residuals = residuals
    dgate, dup, dw_down, amaxes = _swiglu_project_grads(w_dtypes[2], recipe, swiglu_residuals,
                                                        dout)  # fmt: skip
    douts = (dgate, dup)
    if amaxes is None:
        douts, amaxes = _materialized(douts)
    dx, dscale, (dw_gate, dw_up) = _fp8_norm_project_bwd(eps, kind, w_dtypes[:2], recipe,
                                                         norm_residuals, douts, amaxes)  # fmt: skip
    return dx, dscale, (dw_gate, dw_up, dw_down)


def _materialized(arrays):
    """``(arrays, their max |x| over finite elements)``, the arrays kept in their own dtype
    between XLA's fusions (an optimization barrier), their maxima taken before it.

    XLA (``xla_allow_excess_precision``, on by default) drops a BF16 rounding that is read back
    as fp32 and writes the fp32 value instead: SwiGLU's output ``h`` and its gradients ``dgate``
    / ``dup`` went to memory in fp32 and the quantizing fusions read them back (a 2-layer 7B
    profile: SwiGLU's backward 0.34 ms and each E5M2 quantize 0.265 ms a layer, 0.26 and 0.198
    with that option off; docs/results.md). Behind the barrier they are written in BF16, and
    their maxima, which the per-tensor scales need first, join the fusion that writes them
    instead of another pass over them."""
    amaxes = tuple(finite_amax(a) for a in arrays)
    return jax.lax.optimization_barrier((tuple(arrays), amaxes))


_fp8_mlp.defvjp(_fp8_mlp_fwd, _fp8_mlp_bwd)


# --------------------------------------------------------------------------------------------
# Input checks (shapes are static: these run at trace time, before any work).


def _amax(x_saved):
    """The per-tensor ``amax`` the COAT ops save to requantize their recomputed GEMM input
    exactly; ``None`` with finer scaling (backward quantizes it along the tokens afresh)."""
    return None if x_saved.per_group else x_saved.amax


def _check_project(x, kernels):
    if not kernels:
        raise ValueError("projection needs at least one kernel")
    for w in kernels:
        if w.ndim != 2 or w.shape[0] != x.shape[-1]:
            raise ValueError(
                f"projection: x has last axis {x.shape[-1]} but a kernel has shape {w.shape}"
            )


def _check_groups(x, what, recipe: Fp8Recipe):
    if x.shape[-1] % recipe.saved_group:
        raise ValueError(
            f"{what} last axis {x.shape[-1]} is not a multiple of the FP8 group size "
            f"{recipe.saved_group}"
        )
