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
