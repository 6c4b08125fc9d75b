r"""Per-GEMM FP8 quantization error of a trained model: which operand drives the gap.

For one batch, every projection ``y = x W`` of every block (``block3.wq`` ... ``block3.w_down``;
``x (T, K)`` the GEMM's actual input: the normed residual stream, the attention output, or
``silu(gate) * up``) is run in fp32 and its three GEMMs are redone in FP8 with each recipe:

==========  ===========================  ==========================================
GEMM        output                       operands (contracted axis last)
==========  ===========================  ==========================================
forward     ``y = x W``                  ``x (T, K)``, ``W^T (N, K)``
dgrad       ``dx = dy W^T``              ``dy (T, N)``, ``W (K, N)``
wgrad       ``dW = x^T dy``              ``x^T (K, T)``, ``dy^T (N, T)``
==========  ===========================  ==========================================

as :mod:`coat_jax.ops.flow` quantizes them: per tensor with
:func:`coat_jax.core.quant.quantize`, per row or block with
:func:`coat_jax.ops.scaled_gemm.quantize_operand` (``x``, ``dy`` and both wgrad operands as
activations, ``W`` as a weight), ``x`` and ``W`` in ``forward_format``, ``dy`` in
``grad_format``. With :math:`\hat A` the dequantized FP8 operand and :math:`C = a b^\top` a
GEMM of operands ``a``, ``b``, the metrics are

* operand error :math:`\|\hat A - A\|_F / \|A\|_F` of each of the six operands,
* output error :math:`\|\tilde C - C\|_F / \|C\|_F` of each GEMM with both operands in FP8
  (``all``: the library's FP8 GEMM, :func:`coat_jax.ops.flow.fp8_gemm` or
  :func:`coat_jax.ops.scaled_gemm.scaled_matmul`), and with one operand alone in FP8
  (:math:`\hat a b^\top` or :math:`a \hat b^\top` in fp32): the attribution.

Layers are pooled as :math:`\sqrt{\sum_l \|E_l\|_F^2 / \sum_l \|C_l\|_F^2}` (the relative
error of the layers side by side). The operand whose one-alone output error is larger
**dominates** a GEMM.

The fp32 operands come from a :class:`RecordingPolicy` (the ``fp32`` policy whose projections
are :func:`tap` s): a tap's backward sees ``(x, W, dy)`` and returns ``measure(x, W, dy)`` as
the cotangent of a zero "sink" input, so one ``jax.grad`` with respect to the sinks returns
every layer's measurement (pure and jittable, no callback). The measurement is the operands
themselves, measured layer by layer afterwards (one compile per operand shape), or with
``--in_backward`` the metrics (no operand kept past its layer; one compile per layer).

Usage::

  python -m coat_jax.tools.gemm_error --from runs/llama [--batch_size 8] [--seq_len 128]
  python -m coat_jax.tools.gemm_error --train_steps 300 --json out.json --plot out.png

``--from`` reads a ``train.py`` workdir (the config saved with its latest checkpoint, and that
checkpoint's params) and measures a batch of the run's eval data; ``--train_steps N`` first
trains the tiny Llama in fp32 (:func:`coat_jax.tools.quant_error.train_llama`) on the
``"stdlib"`` bytes. ``--recipes`` picks recipes by ``SCALING-FORWARD-GRAD`` name.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from coat_jax.core.quant import dequantize, quantize
from coat_jax.core.recipe import SCALINGS, Fp8Recipe
from coat_jax.models.llama import Llama, LlamaConfig, loss_fn
from coat_jax.models.policy import Fp32Policy
from coat_jax.ops import flow, plain, scaled_gemm

__all__ = [
    "DEFAULT_RECIPES",
    "GEMMS",
    "RecordingPolicy",
    "Recorder",
    "capture_operands",
    "gemm_metrics",
    "markdown",
    "measure_model",
    "model_metrics",
    "parse_recipes",
    "plot",
    "summarize",
    "tap",
]

GEMMS = {"forward": ("x", "w"), "dgrad": ("dy", "w"), "wgrad": ("x", "dy")}
"""Each GEMM's two operands, in the order ``C = a b^T``."""

OPERAND_LABELS = {
    ("forward", "x"): "x", ("forward", "w"): "W", ("dgrad", "dy"): "dy",
    ("dgrad", "w"): "W", ("wgrad", "x"): "x^T", ("wgrad", "dy"): "dy^T",
}  # fmt: skip
OUTPUT_LABELS = {"forward": "y", "dgrad": "dx", "wgrad": "dW"}

_ROLES = {  # (GEMM, operand) -> (scaled_gemm role, recipe format attribute)
    ("forward", "x"): ("activation", "forward"),
    ("forward", "w"): ("weight", "forward"),
    ("dgrad", "dy"): ("activation", "grad"),
    ("dgrad", "w"): ("weight", "forward"),
    ("wgrad", "x"): ("activation", "forward"),
    ("wgrad", "dy"): ("activation", "grad"),
}

DEFAULT_RECIPES = (
    "tensor-e4m3-e5m2",  # COAT's (and the policies') default
    "tensor-e4m3-e4m3",
    "row-e4m3-e4m3",
    "row-e4m3-e5m2",
    "block-e4m3-e4m3",
    "block-e4m3-e5m2",
)
PROJECTIONS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
SEQ_LEN, BATCH_SIZE = 64, 16  # --train_steps' defaults (coat_jax.tools.quant_error's)

_HIGHEST = jax.lax.Precision.HIGHEST


# --------------------------------------------------------------------------------------------
# Recipes


def parse_recipes(names) -> tuple[tuple[str, Fp8Recipe], ...]:
    """``(name, Fp8Recipe)`` of each ``SCALING-FORWARD-GRAD`` name (``"block-e4m3-e5m2"``:
    ``scaling="block"``, ``forward_format="e4m3"``, ``grad_format="e5m2"``); ``names`` is a
    list or a comma-separated string.

    Raises:
      ValueError: an empty list, or a name that is not a recipe (one line, naming it).
    """
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    if not names:
        raise ValueError("no recipe: expected names like 'tensor-e4m3-e5m2'")
    recipes = []
    for name in names:
        parts = name.split("-")
        try:
            if len(parts) != 3 or parts[0] not in SCALINGS:
                raise ValueError(f"scaling must be one of {SCALINGS}")
            recipe = Fp8Recipe(forward_format=parts[1], grad_format=parts[2], scaling=parts[0])
        except ValueError as e:
            raise ValueError(
                f"unknown recipe {name!r}: expected SCALING-FORWARD-GRAD such as "
                f"'block-e4m3-e5m2' ({e})"
            ) from None
        recipes.append((name, recipe))
    return tuple(recipes)


# --------------------------------------------------------------------------------------------
# The metrics of one projection


def gemm_operands(x: jax.Array, w: jax.Array, dy: jax.Array) -> dict:
    """The operands ``(a, b)`` of the three GEMMs of ``y = x W`` (``x (T, K)``, ``W (K, N)``,
    ``dy (T, N)``), each with its contracted axis last so that the GEMM is ``C = a b^T``:
    forward ``(x, W^T)``, dgrad ``(dy, W)``, wgrad ``(x^T, dy^T)``."""
    return {"forward": (x, w.T), "dgrad": (dy, w), "wgrad": (x.T, dy.T)}


def quantize_as(a: jax.Array, recipe: Fp8Recipe, gemm: str, operand: str):
    """Operand ``a`` of ``gemm`` quantized as :mod:`coat_jax.ops.flow` does with ``recipe``."""
    role, fmt = _ROLES[(gemm, operand)]
    fmt = getattr(recipe, fmt)
    if recipe.scaling == "tensor":
        return quantize(a, fmt)
    return scaled_gemm.quantize_operand(a, fmt, recipe.scaling, role)


def fp8_product(qa, qb, recipe: Fp8Recipe) -> jax.Array:
    """``a b^T`` (fp32) of two operands from :func:`quantize_as`, by the library's FP8 GEMM."""
    if recipe.scaling == "tensor":
        return flow.fp8_gemm(qa, qb, (1, 1), jnp.float32, recipe)
    return scaled_gemm.scaled_matmul(qa, qb)


def _dequantized(q) -> jax.Array:
    if q.per_group:
        return scaled_gemm.dequantize_operand(q)
    return dequantize(q, jnp.float32)


def _squares(approx: jax.Array, exact: jax.Array) -> jax.Array:
    """``[||approx - exact||_F^2, ||exact||_F^2]`` (fp32): a relative error, poolable."""
    return jnp.stack([jnp.sum(jnp.square(approx - exact)), jnp.sum(jnp.square(exact))])


def _nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a b^T`` in fp32 at full precision."""
    return jnp.dot(a, b.T, precision=_HIGHEST, preferred_element_type=jnp.float32)


def recipe_metrics(x: jax.Array, w: jax.Array, dy: jax.Array, recipe: Fp8Recipe) -> dict:
    """One recipe's squared errors of projection ``(x, W, dy)``:
    ``{"operand": {gemm: {op: s}}, "output": {gemm: {"all" | op: s}}}``, each ``s`` a pair
    ``[||error||_F^2, ||exact||_F^2]`` (:func:`_squares`; module docstring for the math)."""
    operand, output = {}, {}
    for gemm, (a, b) in gemm_operands(x, w, dy).items():
        names = GEMMS[gemm]
        exact = _nt(a, b)
        qa, qb = (quantize_as(m, recipe, gemm, n) for m, n in zip((a, b), names, strict=True))
        da, db = _dequantized(qa), _dequantized(qb)
        operand[gemm] = {names[0]: _squares(da, a), names[1]: _squares(db, b)}
        output[gemm] = {
            "all": _squares(fp8_product(qa, qb, recipe), exact),
            names[0]: _squares(_nt(da, b), exact),
            names[1]: _squares(_nt(a, db), exact),
        }
    return {"operand": operand, "output": output}


@functools.partial(jax.jit, static_argnames="recipes")
def gemm_metrics(x, w, dy, recipes: tuple[tuple[str, Fp8Recipe], ...]) -> dict:
    """:func:`recipe_metrics` of each ``(name, recipe)`` (:func:`parse_recipes`), by name
    (fp32 operands; jitted, compiled once per shape and recipes)."""
    x, w, dy = (jnp.asarray(a, jnp.float32) for a in (x, w, dy))
    return {name: recipe_metrics(x, w, dy, recipe) for name, recipe in recipes}


def capture_operands(x, w, dy) -> dict:
    """The operands themselves, ``{"x": x, "w": W, "dy": dy}`` (a ``measure`` for tests)."""
    return {"x": x, "w": w, "dy": dy}


def relative(squares) -> float:
    """``sqrt(sum error^2 / sum exact^2)`` of one or more :func:`_squares` pairs (0 for an
    exact 0)."""
    e, r = np.sum(np.reshape(np.asarray(squares, np.float64), (-1, 2)), axis=0)
    return float(np.sqrt(e / r)) if r > 0 else 0.0


# --------------------------------------------------------------------------------------------
# The tap: y = x W whose backward measures (x, W, dy)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def tap(measure, x: jax.Array, w: jax.Array, sink) -> jax.Array:
    """``y = x W`` (``x (T, K)``, ``W (K, N)``, fp32, full precision) whose backward returns
    ``measure(x, W, dy)`` as the cotangent of ``sink`` (zeros shaped like that result).

    The VJP is the exact one for ``x`` and ``W`` (``dx = dy W^T``, ``dW = x^T dy``), so the
    model's gradients are those of the plain fp32 model; ``jax.grad`` with respect to ``sink``
    is the measurement."""
    del measure, sink
    return jnp.dot(x, w, precision=_HIGHEST, preferred_element_type=jnp.float32)


def _tap_fwd(measure, x, w, sink):
    return tap(measure, x, w, sink), (x, w)


def _tap_bwd(measure, residuals, dy):
    x, w = residuals
    dx = jnp.dot(dy, w.T, precision=_HIGHEST, preferred_element_type=jnp.float32)
    dw = jnp.dot(x.T, dy, precision=_HIGHEST, preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), dw.astype(w.dtype), measure(x, w, dy)


tap.defvjp(_tap_fwd, _tap_bwd)


class Recorder:
    """The trace-time link between a model's :class:`RecordingPolicy` s and the sinks.

    Outside :meth:`feeding` (or fed ``None``) a tap records its sink's shape in
    :attr:`templates` and computes a plain ``x W``: trace the model once that way
    (``jax.eval_shape``), then differentiate with respect to :meth:`zero_sinks` fed in.
    """

    def __init__(self, measure):
        self.measure = measure
        self.templates: dict = {}
        self._sinks = None

    @contextlib.contextmanager
    def feeding(self, sinks):
        """Taps read their sink from ``sinks`` (``{name: tree}``) inside this context."""
        previous, self._sinks = self._sinks, sinks
        try:
            yield
        finally:
            self._sinks = previous

    def zero_sinks(self) -> dict:
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self.templates)

    def project(self, name: str, x: jax.Array, w: jax.Array) -> jax.Array:
        """``x W`` for ``x (..., K)`` through :func:`tap` (fp32), the sink of ``name``."""
        x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
        w = w.astype(jnp.float32)
        if self._sinks is None:
            spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
            self.templates[name] = jax.eval_shape(
                self.measure, spec(*x2.shape), spec(*w.shape), spec(x2.shape[0], w.shape[1])
            )
            y = jnp.dot(x2, w, precision=_HIGHEST)
        else:
            y = tap(self.measure, x2, w, self._sinks[name])
        return y.reshape(*x.shape[:-1], w.shape[1])


@dataclasses.dataclass(frozen=True)
class RecordingPolicy(Fp32Policy):
    """The ``fp32`` policy whose projections go through ``recorder`` (:meth:`Recorder.project`).

    One instance per attention or MLP layer: ``prefix`` (``"block3"``) names its projections,
    ``norm_names`` those of ``norm_project`` (``("wq", "wk", "wv")``) and ``project_name`` the
    one of ``project`` / ``swiglu_project`` (``"wo"``, ``"w_down"``). Norm and SwiGLU are
    :mod:`coat_jax.ops.plain`'s, in fp32; the tapped operand is their output.
    """

    recorder: Recorder | None = None
    prefix: str = ""
    norm_names: tuple[str, ...] = ()
    project_name: str = ""

    def _project(self, name, x, kernel):
        return self.recorder.project(f"{self.prefix}.{name}", x, kernel)

    def norm_project(self, x, norm_scale, kernels, eps, kind="rms"):
        if len(kernels) != len(self.norm_names):
            raise ValueError(f"{self.prefix}: {len(kernels)} kernels for {self.norm_names}")
        y = plain.norm(x, norm_scale, eps, kind)
        return tuple(self._project(n, y, w) for n, w in zip(self.norm_names, kernels, strict=True))

    def project(self, x, kernel):
        return self._project(self.project_name, x, kernel)

    def swiglu_project(self, gate, up, kernel):
        return self._project(self.project_name, plain.swiglu(gate, up), kernel)


def recording_model(config: LlamaConfig, params: nnx.State, recorder: Recorder):
    """``(graph, params)`` of ``Llama(config)`` in ``fp32`` with ``params``, each attention
    and MLP layer's policy a :class:`RecordingPolicy` of ``recorder``."""
    config = dataclasses.replace(config, precision="fp32")
    graph, _ = nnx.split(nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0))))
    model = nnx.merge(graph, params)
    for i, block in enumerate(model.blocks):
        block.attention.policy = RecordingPolicy(
            recorder=recorder, prefix=f"block{i}", norm_names=PROJECTIONS[:3], project_name="wo"
        )
        block.mlp.policy = RecordingPolicy(
            recorder=recorder, prefix=f"block{i}", norm_names=PROJECTIONS[4:6],
            project_name="w_down",
        )  # fmt: skip
    return nnx.split(model)


def measure_model(config: LlamaConfig, params: nnx.State, tokens, mask=None,
                  measure=capture_operands):  # fmt: skip
    """``(loss, {layer: measure(x, W, dy)})`` of one batch ``tokens (B, T+1)`` (``mask``:
    :func:`coat_jax.models.llama.loss_fn`'s) on the fp32 model, layers in the model's order.
    One jitted ``jax.value_and_grad`` with respect to the taps' sinks (:class:`Recorder`)."""
    recorder = Recorder(measure)
    graph, params = recording_model(config, params, recorder)

    def loss(params, sinks, tokens, mask):
        with recorder.feeding(sinks):
            return loss_fn(nnx.merge(graph, params), tokens, mask)

    jax.eval_shape(loss, params, None, tokens, mask)  # fills recorder.templates
    names = list(recorder.templates)
    value, measured = jax.jit(jax.value_and_grad(loss, argnums=1))(
        params, recorder.zero_sinks(), tokens, mask
    )
    return float(value), {name: measured[name] for name in names}


def model_metrics(config, params, tokens, mask, recipes, in_backward: bool = False):
    """``(loss, {layer: gemm_metrics})`` of one batch (:func:`measure_model`).

    By default the operands of all layers are captured (:func:`capture_operands`), then
    measured layer by layer with one compiled :func:`gemm_metrics` per operand shape: the
    compile does not grow with depth, the memory holds every layer's ``x``, ``W`` and ``dy``.
    ``in_backward`` measures inside each tap's backward instead: only the metrics leave the
    model's gradient (memory of one training step), one inlined copy per layer to compile.
    """
    if in_backward:
        measure = functools.partial(gemm_metrics, recipes=recipes)
        return measure_model(config, params, tokens, mask, measure)
    loss, captured = measure_model(config, params, tokens, mask, capture_operands)
    metrics = {}
    for name in list(captured):
        operands = captured.pop(name)  # each layer's operands freed once measured
        metrics[name] = gemm_metrics(operands["x"], operands["w"], operands["dy"], recipes)
    return loss, metrics


# --------------------------------------------------------------------------------------------
# Report

SAME = 1.1
"""One-alone output errors within this ratio: no operand dominates (``x≈W``)."""


def layer_errors(metrics: dict, recipes) -> dict:
    """Relative errors of one layer's (or pooled) :func:`gemm_metrics` squares, in the order
    of ``recipes`` (names) and :data:`GEMMS`."""
    return {
        r: {
            "operand": {
                g: {op: relative(metrics[r]["operand"][g][op]) for op in ops}
                for g, ops in GEMMS.items()
            },
            "output": {
                g: {k: relative(metrics[r]["output"][g][k]) for k in ("all", *ops)}
                for g, ops in GEMMS.items()
            },
        }  # fmt: skip
        for r in recipes
    }


def pool(layers: list[dict]) -> dict:
    """The squares of several layers summed leaf by leaf (:func:`relative` then pools)."""
    return jax.tree.map(lambda *s: np.sum([np.asarray(a, np.float64) for a in s], axis=0), *layers)


def dominant(errors: dict, gemm: str) -> str:
    """The operand of ``gemm`` whose one-alone output error is larger (``errors``: one
    recipe's), its label; both labels joined by ``≈`` within a ratio :data:`SAME`."""
    (a, b), out = GEMMS[gemm], errors["output"][gemm]
    if max(out[a], out[b]) <= SAME * min(out[a], out[b]):
        return f"{OPERAND_LABELS[(gemm, a)]}≈{OPERAND_LABELS[(gemm, b)]}"
    return OPERAND_LABELS[(gemm, a if out[a] > out[b] else b)]


def summarize(measured: dict, recipes) -> dict:
    """The report of :func:`model_metrics`' metrics (``recipes``: the names, in order): per
    layer, per projection kind (pooled over blocks), over all layers, the worst layer of each
    GEMM and the dominant operand.

    Returns:
      ``{"layers": {layer: errors}, "kinds": {kind: errors}, "all": errors,
      "worst": {recipe: {gemm: [layer, error]}}, "dominant": {recipe: {gemm: label}}}``,
      ``errors`` being ``{recipe: {"operand": ..., "output": ...}}`` of relative errors.
    """
    host = {name: jax.device_get(m) for name, m in measured.items()}  # keeps the order
    by_kind = {}
    for name in host:
        by_kind.setdefault(name.rsplit(".", 1)[-1], []).append(host[name])
    layers = {name: layer_errors(m, recipes) for name, m in host.items()}
    total = layer_errors(pool(list(host.values())), recipes)
    worst = {
        r: {g: max(([n, e[r]["output"][g]["all"]] for n, e in layers.items()), key=lambda p: p[1])
            for g in GEMMS}
        for r in recipes
    }  # fmt: skip
    kinds = [k for k in PROJECTIONS if k in by_kind] + [k for k in by_kind if k not in PROJECTIONS]
    return {
        "layers": layers,
        "kinds": {k: layer_errors(pool(by_kind[k]), recipes) for k in kinds},
        "all": total,
        "worst": worst,
        "dominant": {r: {g: dominant(total[r], g) for g in GEMMS} for r in recipes},
    }


def _row(label: str, errors: dict) -> str:
    cells = []
    for g, ops in GEMMS.items():
        cells += [f"{errors['output'][g][op]:.3g}" for op in ops]
        cells.append(f"**{errors['output'][g]['all']:.3g}**")
    return f"| {label} | " + " | ".join(cells) + " |"


def markdown(report: dict) -> str:
    """The printed report: per recipe, the GEMM output errors per projection kind (each
    operand alone in FP8, then all); the operand errors; the worst layers; last, one line
    naming each GEMM's dominant operand per recipe."""
    head = ["proj"]
    for g, ops in GEMMS.items():
        head += [f"{g}: {OPERAND_LABELS[(g, op)]}" for op in ops] + [f"{g}: {OUTPUT_LABELS[g]}"]
    lines = [
        "GEMM output relative error ||C~ - C||_F / ||C||_F vs fp32, with one operand alone in "
        "FP8, and (bold) all operands as the recipe quantizes them; blocks pooled."
    ]
    for recipe in report["all"]:
        lines += ["", f"### {recipe}", "", "| " + " | ".join(head) + " |",
                  "|" + "---|" * len(head)]  # fmt: skip
        lines += [_row(kind, e[recipe]) for kind, e in report["kinds"].items()]
        lines.append(_row("all", report["all"][recipe]))
    ops = [(g, op) for g, pair in GEMMS.items() for op in pair]
    lines += ["", "Operand relative error ||deq(q(A)) - A||_F / ||A||_F, all layers pooled.", "",
              "| recipe | " + " | ".join(f"{g}: {OPERAND_LABELS[k]}" for k in ops for g in k[:1])
              + " |", "|" + "---|" * (len(ops) + 1)]  # fmt: skip
    for recipe, e in report["all"].items():
        cells = [f"{e['operand'][g][op]:.3g}" for g, op in ops]
        lines.append(f"| {recipe} | " + " | ".join(cells) + " |")
    lines += ["", "Worst layer of each GEMM (all operands in FP8).", "",
              "| recipe | " + " | ".join(GEMMS) + " |",
              "|" + "---|" * (len(GEMMS) + 1)]  # fmt: skip
    for recipe, worst in report["worst"].items():
        cells = [f"{worst[g][0]} {worst[g][1]:.3g}" for g in GEMMS]
        lines.append(f"| {recipe} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Dominant operand (larger output error alone in FP8, all layers): " + "; ".join(
        f"{recipe}: " + ", ".join(f"{g} {label}" for g, label in d.items())
        for recipe, d in report["dominant"].items()
    ))  # fmt: skip
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """Per layer (x axis), the output error of each GEMM with each operand alone and all in
    FP8: one row of panels per GEMM, one column per recipe, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["layers"])
    recipes = list(report["all"])
    fig, axes = plt.subplots(len(GEMMS), len(recipes), squeeze=False, sharex=True,
                             sharey="row", figsize=(3.6 * len(recipes) + 1, 9))  # fmt: skip
    x = np.arange(len(names))
    step = max(1, len(names) // 28)
    for row, (g, ops) in enumerate(GEMMS.items()):
        for col, recipe in enumerate(recipes):
            ax = axes[row, col]
            out = lambda k, g=g, recipe=recipe: [report["layers"][n][recipe]["output"][g][k]
                                                 for n in names]  # fmt: skip
            for op, style in zip(ops, ("o--", "s:"), strict=True):
                ax.plot(x, out(op), style, ms=3, label=f"{OPERAND_LABELS[(g, op)]} alone")
            ax.plot(x, out("all"), "k-", lw=1.2, label="all")
            ax.set_yscale("log")
            ax.grid(alpha=0.3)
            ax.set_title(f"{recipe}: {g} {OUTPUT_LABELS[g]}", fontsize=9)
            if col == 0:
                ax.set_ylabel("relative error")
                ax.legend(fontsize=7)
            ax.set_xticks(x[::step], names[::step], rotation=90, fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# Where the params and the batch come from


def open_run(path: str):
    """``(config, model config, step, checkpointer)`` of the ``train.py`` workdir ``path`` (or
    its ``checkpoints`` folder) at its latest checkpoint; JSON and folder listings only.

    Raises:
      FileNotFoundError: no such folder, or no checkpoint in it.
    """
    from coat_jax.training import configs, finetune
    from coat_jax.training.checkpoint import Checkpointer

    folder, checkpoints = finetune.run_dirs(path)
    if not os.path.isdir(checkpoints):  # checked first: a Checkpointer would create it
        raise FileNotFoundError(f"{path}: no checkpoints/ folder (is --from a train.py workdir?)")
    ckpt = Checkpointer(checkpoints, async_save=False)
    step = ckpt.latest_step()
    if step is None:
        ckpt.close()
        raise FileNotFoundError(f"{checkpoints}: no checkpoint")
    c = ml_collections.ConfigDict(finetune.read_run_config(folder, ckpt, step))
    return c, configs.llama_config(c), step, ckpt


def load_run(path: str, batch_size: int | None, seq_len: int | None, split: str):
    """``(model config, params, tokens, mask, description)``: the latest checkpoint's params
    (the trainer's params-only restore) and batch 0 of ``split`` of the run's data."""
    from coat_jax.training import data

    c, model, step, ckpt = open_run(path)
    c.batch_size = batch_size or (c.batch_size if c.batch_size > 0 else BATCH_SIZE)  # -1: planner
    c.seq_len = seq_len or c.seq_len
    try:
        tokenizer = data.load_tokenizer(c.data.tokenizer)
        sampler = data.make_sampler(c, tokenizer)
        abstract = nnx.state(nnx.eval_shape(lambda: Llama(model, rngs=nnx.Rngs(0))))
        params = ckpt.restore_params(step, abstract)
    finally:
        ckpt.close()
    batch = sampler.batch(0, split)
    tokens, mask = batch if isinstance(batch, tuple) else (batch, None)
    source = f"{path} (step {step}, {c.data.source} {split} batch 0)"
    return model, params, tokens, mask, source


def train_tiny(steps: int, batch_size: int, seq_len: int, split: str, seed: int, lr: float):
    """The tiny Llama trained in fp32 with AdamW (:func:`coat_jax.tools.quant_error.train_llama`)
    and batch 0 of ``split`` of the ``"stdlib"`` bytes: ``(config, params, tokens, None, desc)``."""
    from coat_jax.tools import quant_error
    from coat_jax.training.data import BatchSampler

    config = dataclasses.replace(quant_error.TINY_LLAMA, precision="fp32")
    losses, params, _ = quant_error.train_llama(optax.adamw(lr), steps, config, seed)
    tokens = BatchSampler(quant_error.stdlib_tokens(), seq_len, batch_size, seed).batch(0, split)
    desc = f"tiny Llama, {steps} fp32 AdamW steps (train loss {losses[-1]:.3f}), stdlib {split}"
    return config, params, tokens, None, desc


# --------------------------------------------------------------------------------------------
# CLI


def _check(args) -> tuple:
    """The parsed recipes; raises ``ValueError`` (one line) on a bad argument."""
    for name in ("batch_size", "seq_len", "train_steps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name} must be positive, got {value}")
    if args.lr <= 0:
        raise ValueError(f"--lr must be positive, got {args.lr}")
    return parse_recipes(args.recipes)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--from", dest="source", help="a train.py workdir (latest checkpoint)")
    source.add_argument("--train_steps", type=int, help="train the tiny Llama in fp32 first")
    parser.add_argument("--batch_size", type=int, help=f"default: the run's ({BATCH_SIZE})")
    parser.add_argument("--seq_len", type=int, help=f"default: the run's ({SEQ_LEN})")
    parser.add_argument("--recipes", default=",".join(DEFAULT_RECIPES),
                        help="comma-separated SCALING-FORWARD-GRAD names")  # fmt: skip
    parser.add_argument("--split", default="eval", choices=["eval", "train"])
    parser.add_argument("--seed", type=int, default=0, help="--train_steps' init and data seed")
    parser.add_argument("--lr", type=float, default=3e-3, help="--train_steps' AdamW rate")
    parser.add_argument(
        "--in_backward",
        action="store_true",
        help="measure inside the backward (less memory, longer compile)",
    )
    parser.add_argument("--json", help="write the report to this JSON file")
    parser.add_argument("--plot", help="write the per-layer plot to this PNG")
    args = parser.parse_args(argv)
    try:
        recipes = _check(args)
        if args.source is not None:
            model, params, tokens, mask, desc = load_run(
                args.source, args.batch_size, args.seq_len, args.split
            )
        else:
            model, params, tokens, mask, desc = train_tiny(
                args.train_steps, args.batch_size or BATCH_SIZE, args.seq_len or SEQ_LEN,
                args.split, args.seed, args.lr,
            )  # fmt: skip
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"gemm_error: {e}") from None

    loss, measured = model_metrics(model, params, tokens, mask, recipes, args.in_backward)
    report = summarize(measured, [name for name, _ in recipes])
    print(
        f"FP8 GEMM error per layer: {desc}; {tokens.shape[0]}x{tokens.shape[1] - 1} tokens, "
        f"fp32 loss {loss:.4f}; Llama {model.n_layers}x{model.dim} (ffn {model.ffn_dim}).\n"
    )
    print(markdown(report))
    result = {
        "date": datetime.date.today().isoformat(),
        "jax": jax.__version__,
        "device": jax.devices()[0].device_kind,
        "source": desc,
        "model": {k: v for k, v in dataclasses.asdict(model).items() if k != "fp8"},
        "measured_in": "fp32",  # model["precision"]: what it was trained with
        "batch_size": int(tokens.shape[0]),
        "seq_len": int(tokens.shape[1] - 1),
        "loss": loss,
        "recipes": {name: dataclasses.asdict(r) for name, r in recipes},
        **report,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.plot:
        plot(report, args.plot)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
