"""bench/peak_buffers.py: XLA's live-range dump read back, on the CPU's compile of a tiny step."""

import json
import os
import subprocess
import sys

import pytest
from child_env import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import peak_buffers  # noqa: E402

LIVE_RANGE = """HloLiveRange (max 4):
  InstructionSequence:
    0:p.1
    1:fusion.2
    2:custom-call.3
    3:fusion.4
  BufferLiveRange:
    p.1{}:0-4
  Live ranges at 2 (peak):
    p.1{}: 4096 bytes (cumulative: 4096 bytes)
    custom-call.3{0}: 1024 bytes (cumulative: 5120 bytes)
  Stack trace breakdown for peak usage: 5 120 bytes
"""


def test_the_peak_section_is_parsed():
    live = peak_buffers.parse_live_ranges(LIVE_RANGE)
    assert live == {"peak_position": 2, "positions": 4,
                    "buffers": [("p.1", "{}", 4096), ("custom-call.3", "{0}", 1024)]}  # fmt: skip
    with pytest.raises(ValueError, match="no 'Live ranges at N"):
        peak_buffers.parse_live_ranges("HloLiveRange (max 0):\n")


@pytest.mark.slow
def test_a_tiny_steps_peak_is_named_buffer_by_buffer(tmp_path):
    out = tmp_path / "peak.json"
    subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "peak_buffers.py"), "--config",
         os.path.join(ROOT, "configs", "llama_tiny.py"), "--set", "batch_size=2", "--top", "5",
         "--dump_dir", str(tmp_path / "dump"), "--json", str(out)],
        check=True, cwd=ROOT, capture_output=True, text=True,
        env=child_env(JAX_PLATFORMS="cpu"),
    )  # fmt: skip
    report = json.loads(out.read_text())
    analysis = report["memory_analysis"]
    assert 0 < report["peak_bytes"] <= analysis["arguments"] + analysis["temp"]
    assert sum(report["by_kind"].values()) == report["peak_bytes"]
    assert 0 < report["peak_position"] < report["schedule_length"]
    assert len(report["largest"]) == 5 and all(r["opcode"] != "?" for r in report["largest"])
    assert report["largest"][0]["bytes"] >= report["largest"][-1]["bytes"]
    assert any(kind.startswith("argument") for kind in report["by_kind"])
    short = report["peak_bytes"] < peak_buffers.LIVE_RANGE_TRUST * analysis["total"]
    assert report["live_range_peak_short"] is short
