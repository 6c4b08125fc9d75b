"""bench/fp8_epilogue.py: the GEMM spellings agree on the CPU, the compiled-HLO summary finds
a cuBLASLt FP8 call and its output type, and bad shapes are one parser error."""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import fp8_epilogue  # noqa: E402

GPU_HLO = """
  %custom-call.1 = (f32[64,32]{1,0}, s8[4096]{0}) custom-call(%p0, %p1, %c, %c), custom_call_target="__cublas$lt$matmul$f8"
  %wrapped_convert = bf16[64,32]{1,0} fusion(%gte), kind=kLoop, calls=%wrapped_convert_computation
"""  # noqa: E501 (as XLA prints it)


def test_hlo_summary():
    info = fp8_epilogue.hlo_summary(GPU_HLO)
    assert info == {"cublaslt_f8": True, "gemm_out": "f32[64,32]", "fusions": ["bf16[64,32]"]}
    assert fp8_epilogue.hlo_summary("ROOT %d = f32[2]{0} dot(%a, %b)")["cublaslt_f8"] is False


def test_cpu_run_patterns_agree(tmp_path, capsys):
    out = tmp_path / "e.json"
    result = fp8_epilogue.main(["--shapes", "48x64x40", "--iters", "2", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["pattern"] for r in rows] == list(fp8_epilogue.PATTERNS) == [
        r["pattern"] for r in result["rows"]]  # fmt: skip
    # each spelling computes the same product: within a BF16 rounding or two of the fp64 one
    # (the BF16-scale spelling also rounds both scales to BF16)
    assert all(0 <= r["rel_error"] < 1e-2 for r in rows) and all(r["ms"] > 0 for r in rows)
    assert "nothing is rewritten here" in capsys.readouterr().out


@pytest.mark.parametrize("shapes", ["8x8", "8x0x8", "axbxc"])
def test_bad_shapes_are_a_parser_error(shapes, capsys):
    with pytest.raises(SystemExit):
        fp8_epilogue.main(["--shapes", shapes])
    assert "--shapes" in capsys.readouterr().err
