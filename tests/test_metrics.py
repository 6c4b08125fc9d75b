"""coat_jax.training.metrics: MFU and FLOPs per token, the JSONL writer."""

import dataclasses

import pytest

from coat_jax.models.llama import PRESETS
from coat_jax.training import metrics


def test_mfu_is_model_flops_over_the_devices_peak():
    model = PRESETS["tiny"]
    per_token = metrics.flops_per_token(model, 64)
    got = metrics.mfu(model, 64, tokens_per_s=1000.0, devices=4, override_tflops=2.0)
    assert got == pytest.approx(per_token * 1000.0 / (2e12 * 4))
    assert metrics.mfu(model, 64, 1000.0, 1) is None  # a CPU: no known peak


def test_flops_per_token_matches_6n_rule():
    config = dataclasses.replace(PRESETS["tiny"], tie_embeddings=True)
    n = config.num_params()
    layers, dim = config.n_layers, config.dim
    assert metrics.flops_per_token(config, 1) == pytest.approx(6 * n + 12 * layers * dim, rel=1e-6)


def test_metrics_writer_round_trips_records(tmp_path):
    writer = metrics.MetricsWriter(str(tmp_path))
    assert writer.read() == []
    writer.write({"step": 1, "train_loss": 2.5, "note": "x"})
    writer.write({"step": 2, "train_loss": float("nan")})
    records = writer.read()
    assert records[0] == {"step": 1, "train_loss": 2.5, "note": "x"} and records[1]["step"] == 2
    assert metrics.loss_points(records, "train_loss") == ((1,), (2.5,))  # NaN left out
    metrics.plot_metrics(records, str(tmp_path / "loss.png"))
    assert (tmp_path / "loss.png").stat().st_size > 0
