"""README's Python examples run as written."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.slow
def test_readme_python_blocks_run():
    # the two API sections; "Using fp8_adamw in your code" runs in tests/test_flax_idioms.py
    sections = re.split(r"^## ", README.read_text(), flags=re.M)
    chosen = [
        s for s in sections if s.startswith(("The optimizer in 20", "The FP8 precision flow"))
    ]
    blocks = [b for s in chosen for b in re.findall(r"```python\n(.*?)```", s, flags=re.S)]
    assert blocks, "README lost its API example"
    namespaces = []
    for block in blocks:
        namespaces.append({})
        exec(compile(block, str(README), "exec"), namespaces[-1])
    optimizer, flow = namespaces
    adam = optimizer["state"][1][0]
    assert str(adam.mu["w"].dtype) == "float8_e4m3fn" and adam.mu["w"].shape == (4096, 4096)
    assert adam.mu["norm"].dtype == "float32" and adam.mu_amax["w"].shape == (4096, 32)
    assert flow["loss"] > 0 and flow["config"].precision == "coat"
    assert flow["model"].blocks[0].mlp.policy.recipe == flow["config"].fp8
