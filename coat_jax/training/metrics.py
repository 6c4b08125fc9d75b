"""Run metrics: the JSONL log, loss plots, and model FLOP utilisation.

* :class:`MetricsWriter` appends one JSON object a line to ``<workdir>/metrics.jsonl``;
  :func:`plot_metrics` draws train / eval loss from those records (the trainer's ``loss.png``,
  and bench/fidelity.py's curves through :func:`loss_points` / :func:`save_loss_figure`).
* :func:`mfu` = :func:`flops_per_token` x tokens/s over the devices' :func:`peak_flops`: the
  one formula ``train.py`` and every benchmark report.
"""

from __future__ import annotations

import json
import math
import os

import jax

from coat_jax.models.llama import LlamaConfig

__all__ = [
    "MetricsWriter",
    "flops_per_token",
    "loss_points",
    "mfu",
    "peak_flops",
    "plot_metrics",
    "save_loss_figure",
]

# Dense BF16 peak TFLOP/s per device (datasheet), for MFU when config.peak_tflops is 0.
_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "L40S": 362.0}


def flops_per_token(config: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 x (non-embedding params + LM head) + attention (12 L T d)."""
    n = config.num_params() - config.vocab_size * config.dim
    if config.tie_embeddings:
        n += config.vocab_size * config.dim
    return 6.0 * n + 12.0 * config.n_layers * seq_len * config.dim


def peak_flops(override_tflops: float = 0.0) -> float | None:
    """Peak FLOP/s of one device: the override, else by device kind; ``None`` if unknown."""
    if override_tflops > 0:
        return override_tflops * 1e12
    kind = jax.devices()[0].device_kind
    for name, tflops in _PEAK_TFLOPS.items():
        if name in kind:
            return tflops * 1e12
    return None


def mfu(config: LlamaConfig, seq_len: int, tokens_per_s: float, devices: int,
        override_tflops: float = 0.0) -> float | None:  # fmt: skip
    """Model FLOP utilisation per device: ``flops_per_token x tokens/s`` over ``devices`` times
    one device's peak (:func:`peak_flops`); ``None`` where the peak is unknown."""
    peak = peak_flops(override_tflops)
    if not peak:
        return None
    return flops_per_token(config, seq_len) * tokens_per_s / (peak * devices)


class MetricsWriter:
    """Appends one JSON object per line to ``<workdir>/metrics.jsonl``."""

    def __init__(self, workdir: str):
        self.path = os.path.join(workdir, "metrics.jsonl")

    def write(self, record: dict) -> None:
        clean = {k: v if isinstance(v, (int, str)) else float(v) for k, v in record.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(clean) + "\n")

    def read(self) -> list[dict]:
        if not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            return [json.loads(line) for line in f if line.strip()]


def loss_points(records: list[dict], key: str) -> tuple | None:
    """``(steps, values)`` of the metrics ``records`` that hold a finite ``key``, else ``None``."""
    points = [(r["step"], r[key]) for r in records if key in r and math.isfinite(r[key])]
    return tuple(zip(*points, strict=True)) if points else None


def plot_metrics(records: list[dict], path: str) -> None:
    """Train and eval loss against step, written to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, style in (("train_loss", "-"), ("eval_loss", "o-")):
        if points := loss_points(records, key):
            ax.plot(*points, style, label=key.replace("_", " "))
    save_loss_figure(fig, [ax], path, "loss (nats/token)")


def save_loss_figure(fig, axes, path: str, ylabel: str) -> None:
    """Labels, grid and legend on each loss-curve axis of ``fig``; writes it to ``path`` (PNG)
    and closes it (the trainer's plot and bench/fidelity.py's)."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # no curve yet (stopped before the first log)
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
