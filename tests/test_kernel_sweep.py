"""bench/kernel_sweep.py runs end to end on tiny sizes (interpret mode off a GPU)."""

import importlib.util
import json
import pathlib
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"


def test_sweep_smoke(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location("kernel_sweep", BENCH / "kernel_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "kernel_sweep", sweep)
    spec.loader.exec_module(sweep)
    out = tmp_path / "sweep.json"
    argv = ["--rows", "16", "--cols", "256", "--iters", "1", "--inner", "1"]
    sweep.main([*argv, "--max-candidates", "2", "--json", str(out)])
    report = json.loads(out.read_text())
    assert set(report["kernels"]) == {
        "adam_step (moments, expansion)",
        "adam_update (full AdamW, expansion)",
        "quantize per-group 1x16 fp32",
        "quantize per-group 1x128 fp32",
        "quantize + transpose bf16 -> e5m2",
    }
    for name, kernel in report["kernels"].items():
        assert len(kernel["candidates"]) == 2, name
        errors = [c["error"] for c in kernel["candidates"] if "error" in c]
        assert not errors, (name, errors)  # every candidate ran
        assert kernel["best"]["ms"] == min(c["ms"] for c in kernel["candidates"]) > 0
        assert kernel["best"]["GBps"] == pytest.approx(kernel["bytes"] / kernel["best"]["ms"] / 1e6)
