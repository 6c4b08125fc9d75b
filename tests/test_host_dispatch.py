"""bench/host_dispatch.py: a CPU smoke run on the tiny config, and its argument check."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
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


def test_the_flat_step_computes_the_same_step(bench):
    """``--flat``'s rows time the trainer's own step: after two steps from the same state, the
    flat call's arrays equal the NNX call's bit for bit (it is one computation)."""
    sets = ["batch_size=2", "seq_len=32"]
    run = assemble(bench.load_config(str(BENCH.parent / "configs" / "llama.py"), sets))
    with jax.set_mesh(run.placement.mesh):
        batch = bench.random_batch(run, seed=1)
        state = run.create()
        leaves, treedef = jax.tree.flatten(state)
        leaves = [jnp.copy(x) for x in leaves]  # the NNX call donates the originals
        for _ in range(2):
            *state, m_nnx = run.train_step(*state, batch)
        step = bench.flat_step(run.train_step, treedef, run.model.policy().compiler_options())
        for _ in range(2):
            leaves, m_flat = step(leaves, batch)
    for a, b in zip(jax.tree.leaves(state), leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(m_nnx["loss"]) == float(m_flat["loss"])


def test_bad_policy_is_one_line(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--policies", "coat"])
    assert "--policies" in capsys.readouterr().err
