"""coat_jax.tools.gemm_error: the tap's operands, the metrics, the CLI and its bad input."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coat_jax.core.quant import dequantize, quantize
from coat_jax.models.llama import Llama, LlamaConfig, loss_fn
from coat_jax.models.policy import Fp32Policy
from coat_jax.ops import plain, scaled_gemm
from coat_jax.tools import gemm_error

CONFIG = LlamaConfig(
    vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, precision="fp32"
)


def _model(seed, config=CONFIG, batch=3, seq=10):
    """``(graph, params, tokens)``: ``Llama(config)`` with random params drawn in numpy (no
    eager init to wait for) and random tokens ``(batch, seq + 1)``."""
    graph, abstract = nnx.split(nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)

    def draw(leaf):
        if len(leaf.shape) == 1:  # norm weights
            return jnp.asarray(1 + 0.1 * rng.standard_normal(leaf.shape), jnp.float32)
        return jnp.asarray(rng.standard_normal(leaf.shape) / np.sqrt(leaf.shape[0]), jnp.float32)

    tokens = rng.integers(0, config.vocab_size, (batch, seq + 1))
    return graph, jax.tree.map(draw, abstract), jnp.asarray(tokens, jnp.int32)


@dataclasses.dataclass(frozen=True)
class _ProbePolicy(Fp32Policy):
    """The fp32 policy with ``delta`` added to ``project`` / ``swiglu_project``'s output:
    ``d loss / d delta`` is that projection's output gradient, by plain autodiff."""

    delta: jax.Array | None = None

    def project(self, x, kernel):
        return super().project(x, kernel) + self.delta

    def swiglu_project(self, gate, up, kernel):
        return super().swiglu_project(gate, up, kernel) + self.delta


PROBES = ((0, "attention", "wo"), (1, "mlp", "w_down"))


def _reference(graph, params, tokens):
    """``(loss, (param grads, dy of each of PROBES))`` of the plain fp32 model by
    ``jax.value_and_grad``; a probe's ``dy`` is the gradient of a zero added to its output."""

    def loss(params, deltas):
        model = nnx.merge(graph, params)
        for (block, part, _), delta in zip(PROBES, deltas, strict=True):
            getattr(model.blocks[block], part).policy = _ProbePolicy(delta=delta)
        return loss_fn(model, tokens)

    zero = jnp.zeros((tokens.shape[0], tokens.shape[1] - 1, CONFIG.dim), jnp.float32)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, [zero] * len(PROBES))


def test_tap_captures_the_fp32_models_operands():
    graph, params, tokens = _model(int(np.random.default_rng().integers(1 << 30)))
    loss, captured = gemm_error.measure_model(CONFIG, params, tokens)
    names = [f"block{i}.{p}" for i in range(CONFIG.n_layers) for p in gemm_error.PROJECTIONS]
    assert list(captured) == names
    # Tolerance: both sides are the same fp32 math at full precision in another order of
    # operations: 1e-5 relative for the loss, 1e-4 (and 1e-6 of the largest entry) for the rest.
    ref_loss, (grads, probe_dys) = _reference(graph, params, tokens)
    assert loss == pytest.approx(float(ref_loss), rel=1e-5)
    close = lambda a, b: np.testing.assert_allclose(
        a, b, rtol=1e-4, atol=1e-6 * float(np.abs(b).max())
    )
    for name in names:
        block, proj = name.split(".")
        part = "attention" if proj in ("wq", "wk", "wv", "wo") else "mlp"
        w = params["blocks"][int(block[5:])][part][proj].get_value()
        x, w_seen, dy = (np.asarray(captured[name][k]) for k in ("x", "w", "dy"))
        np.testing.assert_array_equal(w_seen, w)
        assert x.shape == (tokens.size - tokens.shape[0], w.shape[0])
        assert dy.shape == (x.shape[0], w.shape[1])
        # dW = x^T dy is jax.grad's gradient of the kernel.
        g = grads["blocks"][int(block[5:])][part][proj].get_value()
        close(x.T @ dy.astype(np.float64), g)
    # block0.wq's x: the RMSNorm of the embedded tokens.
    embed = params["embed"].get_value()[tokens[:, :-1]]
    scale = params["blocks"][0]["attention"]["norm"].get_value()
    x0 = plain.norm(embed, scale, CONFIG.norm_eps).reshape(-1, CONFIG.dim)
    close(np.asarray(captured["block0.wq"]["x"]), np.asarray(x0))
    # dy of an output projection: jax.vjp of the loss in that output.
    for (block, _, proj), dy in zip(PROBES, probe_dys, strict=True):
        close(np.asarray(captured[f"block{block}.{proj}"]["dy"]), dy.reshape(-1, CONFIG.dim))


def _rel(approx, exact) -> float:
    approx, exact = np.asarray(approx, np.float64), np.asarray(exact, np.float64)
    return float(np.linalg.norm(approx - exact) / np.linalg.norm(exact))


RECIPES = gemm_error.parse_recipes("tensor-e4m3-e5m2,block-e4m3-e4m3")


def _errors(x, w, dy) -> dict:
    metrics = gemm_error.gemm_metrics(x, w, dy, RECIPES)
    return gemm_error.layer_errors(metrics, [name for name, _ in RECIPES])


def _operands(rng, t=256, k=320, n=80):
    """``x (t, k)`` with channels of scales 0.1 to 3, ``W (k, n)``, ``dy (t, n)`` ~ 1e-3."""
    x = rng.standard_normal((t, k)) * rng.uniform(0.1, 3.0, k)
    w = rng.standard_normal((k, n)) / np.sqrt(k)
    dy = rng.standard_normal((t, n)) * 1e-3
    return tuple(jnp.asarray(a, jnp.float32) for a in (x, w, dy))


@functools.partial(jax.jit, static_argnums=1)
def _deq_tensor(a, fmt):
    return dequantize(quantize(a, fmt), jnp.float32)


@functools.partial(jax.jit, static_argnums=1)
def _deq_block(a, role):
    q = scaled_gemm.quantize_operand(a, quantize(a[:1, :1], "e4m3").fmt, "block", role)
    return scaled_gemm.dequantize_operand(q)


def test_metrics_match_a_direct_computation():
    x, w, dy = _operands(np.random.default_rng())
    errors = _errors(x, w, dy)
    f64 = lambda a: np.asarray(a, np.float64)
    x64, w64, dy64 = f64(x), f64(w), f64(dy)
    # The metrics differ from these only by fp32 rounding (~1e-6 of C): 1e-3 relative.
    approx = lambda value: pytest.approx(value, rel=1e-3)

    tensor = errors["tensor-e4m3-e5m2"]
    xt, wt, dyt = (
        f64(_deq_tensor(x, "e4m3")),
        f64(_deq_tensor(w, "e4m3")),
        f64(_deq_tensor(dy, "e5m2")),
    )
    assert tensor["operand"]["forward"]["x"] == approx(_rel(xt, x64))
    assert tensor["operand"]["dgrad"]["dy"] == approx(_rel(dyt, dy64))
    assert tensor["operand"]["wgrad"]["x"] == approx(_rel(xt, x64))  # per tensor: x^T is x
    assert tensor["output"]["forward"]["all"] == approx(_rel(xt @ wt, x64 @ w64))
    assert tensor["output"]["forward"]["w"] == approx(_rel(x64 @ wt, x64 @ w64))
    assert tensor["output"]["dgrad"]["dy"] == approx(_rel(dyt @ w64.T, dy64 @ w64.T))
    assert tensor["output"]["wgrad"]["all"] == approx(_rel(xt.T @ dyt, x64.T @ dy64))

    block = errors["block-e4m3-e4m3"]
    xb, wb, dyb = (
        f64(_deq_block(x, "activation")),
        f64(_deq_block(w.T, "weight")),
        f64(_deq_block(dy, "activation")),
    )
    w_dgrad, xtb = f64(_deq_block(w, "weight")), f64(_deq_block(x.T, "activation"))
    assert block["operand"]["forward"]["w"] == approx(_rel(wb, w64.T))
    assert block["operand"]["dgrad"]["w"] == approx(_rel(w_dgrad, w64))
    assert block["operand"]["wgrad"]["dy"] == approx(_rel(_deq_block(dy.T, "activation"), dy64.T))
    assert block["output"]["forward"]["all"] == approx(_rel(xb @ wb.T, x64 @ w64))
    assert block["output"]["dgrad"]["all"] == approx(_rel(dyb @ w_dgrad.T, dy64 @ w64.T))
    assert block["output"]["wgrad"]["x"] == approx(_rel(xtb @ dy64, x64.T @ dy64))


def test_outlier_column_costs_per_tensor_scaling_more_than_blocks():
    rng = np.random.default_rng()
    x, w, dy = _operands(rng)
    # One hidden channel 1000x the rest (LLM activation outliers): per tensor, its scale
    # flushes every other entry towards the subnormals; blocks (1x128 tiles per row) keep the
    # other tiles' scales, and the outlier is its row's tile maximum, which quantizes exactly.
    x = x.at[:, int(rng.integers(x.shape[1]))].multiply(1000.0)
    errors = _errors(x, w, dy)
    tensor, block = errors["tensor-e4m3-e5m2"], errors["block-e4m3-e4m3"]  # both x in E4M3
    assert tensor["operand"]["forward"]["x"] > 2 * block["operand"]["forward"]["x"]
    assert tensor["output"]["forward"]["x"] > block["output"]["forward"]["x"]


def test_tap_measures_in_its_backward():
    """``tap``'s VJP is ``x W``'s, and the sink's cotangent is ``measure(x, W, dy)``.

    The loss is linear in ``y = x W`` (``sum(y * c)``), so the ``dy`` that reaches the tap is
    exactly ``c``: the metrics quantize ``dy`` (they jump where a code flips), so the expected
    value must see the same ``dy`` bit for bit, not a float64 recomputation of it.
    """
    x, w, c = _operands(np.random.default_rng(), t=64, k=32, n=16)
    recipes = gemm_error.parse_recipes("row-e4m3-e5m2")
    measure = functools.partial(gemm_error.gemm_metrics, recipes=recipes)
    sink = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(measure, x, w, c))
    loss = lambda x, w, sink: jnp.sum(gemm_error.tap(measure, x, w, sink) * c)
    dx, dw, measured = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w, sink)
    x64, w64, c64 = (np.asarray(a, np.float64) for a in (x, w, c))
    np.testing.assert_allclose(dx, c64 @ w64.T, rtol=1e-4, atol=1e-8)
    np.testing.assert_allclose(dw, x64.T @ c64, rtol=1e-4, atol=1e-7)
    expected = measure(x, w, c)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4), measured, expected)


@pytest.mark.slow  # ~10 s: trains 5 steps first
def test_cli_writes_json_plot_and_table(tmp_path, capsys):
    out, png = tmp_path / "gemm.json", tmp_path / "gemm.png"
    result = gemm_error.main(["--train_steps", "5", "--batch_size", "4", "--seq_len", "32",
                              "--recipes", "tensor-e4m3-e5m2",
                              "--json", str(out), "--plot", str(png)])  # fmt: skip
    printed = capsys.readouterr().out.strip().splitlines()
    assert "### tensor-e4m3-e5m2" in printed
    assert sum(line.startswith("| all |") for line in printed) == 1
    assert printed[-1].startswith("Dominant operand") and "tensor-e4m3-e5m2: forward" in printed[-1]
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(result["layers"]) == 2 * len(gemm_error.PROJECTIONS)
    assert list(result["kinds"]) == list(gemm_error.PROJECTIONS)
    for recipe, errors in result["all"].items():
        for g, ops in gemm_error.GEMMS.items():
            out_err = errors["output"][g]
            assert all(0 < out_err[k] < 0.2 for k in ("all", *ops)), (recipe, g)
            assert out_err["all"] >= 0.5 * max(out_err[op] for op in ops)
    # E5M2 output gradients (2 mantissa bits, E4M3 has 3): about twice E4M3's rounding error.
    tensor = result["all"]["tensor-e4m3-e5m2"]["operand"]
    assert tensor["dgrad"]["dy"] > 1.5 * tensor["forward"]["x"]


def test_cli_from_a_run(tmp_path, capsys):
    from coat_jax.training import configs
    from coat_jax.training.checkpoint import Checkpointer

    c = configs.base_config()
    c.model.update(vocab_size=256, dim=32, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=32)
    _, params, _ = _model(0, configs.llama_config(c))
    ckpt = Checkpointer(str(tmp_path / "checkpoints"), async_save=False)
    ckpt.save(7, params, {"count": jnp.zeros((), jnp.int32)}, {"config": c.to_dict()})
    ckpt.close()
    result = gemm_error.main(["--from", str(tmp_path), "--batch_size", "2", "--seq_len", "16",
                              "--recipes", "row-e4m3-e4m3"])  # fmt: skip
    assert "(step 7, stdlib eval batch 0)" in capsys.readouterr().out
    assert list(result["layers"]) == [f"block0.{p}" for p in gemm_error.PROJECTIONS]
    assert result["batch_size"] == 2 and result["seq_len"] == 16


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--train_steps", "0"], "--train_steps must be positive"),
        (["--train_steps", "5", "--batch_size", "-1"], "--batch_size must be positive"),
        (["--train_steps", "5", "--seq_len", "0"], "--seq_len must be positive"),
        (["--train_steps", "5", "--recipes", "tensor-e4m3-e6m2"], "unknown recipe 'tensor-e4m3"),
        (["--train_steps", "5", "--recipes", "coat"], "unknown recipe 'coat'"),
        (["--train_steps", "5", "--recipes", ","], "no recipe"),
    ],
)
def test_cli_rejects_bad_arguments(argv, message):
    with pytest.raises(SystemExit, match=message) as e:
        gemm_error.main(argv)
    assert "\n" not in str(e.value)


def test_cli_rejects_a_folder_without_checkpoints(tmp_path):
    with pytest.raises(SystemExit, match="no checkpoints/ folder"):
        gemm_error.main(["--from", str(tmp_path)])
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(SystemExit, match="checkpoints: no checkpoint"):
        gemm_error.main(["--from", str(tmp_path)])
    with pytest.raises(ValueError, match="unknown recipe 'row'"):
        gemm_error.parse_recipes(["row"])
