"""bench/host_dispatch.py: a CPU smoke run on the tiny config, and its argument check."""

import json
import pathlib

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import host_dispatch

    return host_dispatch


def test_smoke(bench, tmp_path):
    out = tmp_path / "dispatch.json"
    rows = bench.main(["--config", str(BENCH.parent / "configs" / "llama.py"), "--set",
                       "batch_size=2", "--set", "seq_len=32", "--policies",
                       "coat+fp8_adamw,bf16+adamw", "--warmup", "1", "--steps", "2",
                       "--json", str(out)])  # fmt: skip
    report = json.loads(out.read_text())
    assert [r["policy"] for r in report["rows"]] == ["coat+fp8_adamw", "bf16+adamw"]
    for r in rows:
        assert 0 < r["dispatch_ms"] <= r["step_ms"]
        assert r["state_leaves"] > 10
    # the FP8 optimizer keeps codes, amax and k per moment: more arrays than adamw's two
    assert rows[0]["state_leaves"] > rows[1]["state_leaves"]


def test_bad_policy_is_one_line(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--policies", "coat"])
    assert "--policies" in capsys.readouterr().err
