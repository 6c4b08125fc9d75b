"""bench/gemm.py's --configs: a JSON list of GEMM configs for a sweep, each checked for its
variant before anything is compiled; bad items are one clear error."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import gemm  # noqa: E402

from pallas_kernels import fp8_matmul as fm  # noqa: E402


def test_parse_configs_builds_checked_pairs():
    text = """[{"tile_m": 64, "tile_k": 256, "max_concurrent_steps": 3, "wg_split": "m",
                "epi_tile_n": 32, "cluster": "n"},
               {"variant": "per_tensor", "cluster": "m"}]"""
    pairs = gemm.parse_configs(text)
    assert pairs == [
        ("block_scaled", fm.GemmConfig(64, 128, 256, 3, "m", epi_tile_n=32, cluster="n")),
        ("per_tensor", fm.GemmConfig(cluster="m")),
    ]
    names = list(gemm.variants(extra_configs=pairs))
    assert "Pallas block_scaled cfg0" in names and "Pallas per_tensor cfg1" in names


@pytest.mark.parametrize(
    ("text", "error", "match"),
    [
        ('[{"variant": "quantize"}]', ValueError, "variant 'quantize'"),
        ('[{"tile_n": 256}]', ValueError, "block scaling"),  # block-scaled needs tile_n 128
        ('[{"cluster": "k"}]', ValueError, "cluster"),
        ('[{"tiles": 2}]', TypeError, "tiles"),
    ],
)
def test_parse_configs_refuses_bad_items(text, error, match):
    with pytest.raises(error, match=match):
        gemm.parse_configs(text)


def test_bad_configs_option_is_one_line(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["gemm.py", "--configs", '[{"cluster": "k"}]'])
    with pytest.raises(SystemExit, match="--configs: .*cluster"):
        gemm.main()


def test_table_ratios_use_the_columns_that_were_timed():
    rows = [
        {"M": 8, "K": 16, "N": 32, "XLA cuBLASLt FP8, (N, K) weight": {"TFLOPs": 1000.0},
         "Pallas per-tensor": {"TFLOPs": 1500.0}, "Pallas block-scaled": {"TFLOPs": 1300.0}},
        {"M": 8, "K": 16, "N": 64, "XLA cuBLASLt FP8, (N, K) weight": {"TFLOPs": 1000.0},
         "Pallas per-tensor": {"error": "no"}, "Pallas block-scaled": {"TFLOPs": 1200.0}},
    ]  # fmt: skip
    names = ["XLA cuBLASLt FP8, (N, K) weight", "Pallas per-tensor", "Pallas block-scaled"]
    header, _, first, second = gemm.format_table(rows, names).splitlines()
    # no fused-1x16 column was timed: its ratio is left out; cuBLASLt's (N, K) column stands in
    assert header.endswith("| Pallas/cuBLASLt | block/cuBLASLt | block/per-tensor |")
    assert first == "| 8x16x32 | 1000 | 1500 | 1300 | 1.50 | 1.30 | 0.87 |"
    assert second == "| 8x16x64 | 1000 | err | 1200 |  | 1.20 |  |"
