"""bench/host_dispatch.py: a CPU smoke run on the tiny config, and its argument check."""

import json
import pathlib

import jax
import pytest

from coat_jax.training.run import assemble

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import host_dispatch

    return host_dispatch


def test_smoke(bench, tmp_path):
    """One policy (each row compiles the step once more; the suite is over its time target)."""
    out = tmp_path / "dispatch.json"
    rows = bench.main(["--config", str(BENCH.parent / "configs" / "llama.py"), "--set",
                       "batch_size=2", "--set", "seq_len=32", "--policies", "coat+fp8_adamw",
                       "--warmup", "1", "--steps", "2", "--flat", "--loop_steps", "3",
                       "--json", str(out)])  # fmt: skip
    report = json.loads(out.read_text())
    policies = [r["policy"] for r in report["rows"]]
    assert policies == ["coat+fp8_adamw", "coat+fp8_adamw (flat arrays)"]
    for r in rows:
        assert 0 < r["dispatch_ms"] <= r["step_ms"]
        assert r["loop_ms"] > 0
    # the FP8 optimizer keeps codes, amax and k per moment: more arrays than adamw's two (its
    # count from bf16's abstract state: no compile), and both calls carry every array
    bf16 = assemble(bench.load_config(str(BENCH.parent / "configs" / "llama.py"),
                                      ["precision=bf16", "optimizer.name=adamw"]))  # fmt: skip
    assert rows[0]["state_leaves"] == rows[1]["state_leaves"] > len(
        jax.tree.leaves(bf16.abstract_state())
    )


def test_bad_policy_is_one_line(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--policies", "coat"])
    assert "--policies" in capsys.readouterr().err
