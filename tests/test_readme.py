"""README's Python examples run as written."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.slow
def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README lost its API example"
    namespaces = []
    for block in blocks:
        namespaces.append({})
        exec(compile(block, str(README), "exec"), namespaces[-1])
    optimizer, flow = namespaces
    assert str(optimizer["state"][1][0].mu["w"].data.dtype) == "float8_e4m3fn"
    assert optimizer["state"][1][0].mu["norm"].dtype == "float32"
    assert flow["loss"] > 0 and flow["config"].precision == "coat"
    assert flow["model"].blocks[0].mlp.policy.recipe == flow["config"].fp8
