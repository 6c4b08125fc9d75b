"""bench/adam_ablation.py: its variants really replace the kernel's math and put it back, and the
script runs end to end on tiny sizes (interpret mode off a GPU)."""

import importlib.util
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import adam_step
from pallas_kernels.adam_step import AdamStepTuning

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def ablation(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location("adam_ablation", BENCH / "adam_ablation.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "adam_ablation", module)
    spec.loader.exec_module(module)
    return module


def test_a_variant_is_traced_while_patched_and_the_kernel_restored_after(ablation):
    _, make, _ = ablation.kernel_cases(16, 256, interpret=True)[ablation.CASE]
    codes = lambda out: np.asarray(out[1].data.view(jnp.uint8))
    run = lambda: codes(jax.tree.map(np.asarray, (lambda s, c: s(c))(*make(AdamStepTuning()))))
    before = codes(make(AdamStepTuning())[1])
    with ablation.patched(ablation.VARIANTS["io only"]):
        np.testing.assert_array_equal(run(), before)  # the moments passed through
    assert adam_step.moment_update is not ablation._io_only
    assert (run() != before).mean() > 0.1  # the real update again, not the cached variant


def test_ablation_smoke(ablation, tmp_path):
    out = tmp_path / "ablation.json"
    argv = ["--rows", "16", "--cols", "256", "--iters", "1", "--inner", "1", "--tunings", "8x4"]
    ablation.main([*argv, "--json", str(out)])
    report = json.loads(out.read_text())
    names = [r["variant"] for r in report["rows"]]
    assert names == [*ablation.VARIANTS, "tiles only (no per-group arrays)",
                     "optax.adamw (XLA, fp32 m, v)"]  # fmt: skip
    assert all(r["ms"] > 0 and "error" not in r for r in report["rows"])
    with pytest.raises(SystemExit):
        ablation.main(["--variants", "shipped,fast"])
