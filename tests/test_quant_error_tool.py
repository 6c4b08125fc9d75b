import json

import numpy as np
import pytest

from coat_jax.tools import quant_error


@pytest.mark.slow
def test_quant_error_report(tmp_path, capsys):
    out = tmp_path / "table1.json"
    result = quant_error.main(["--steps", "30", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "| E4M3 | E4M3 | yes |" in printed and "Expansion lowers" in printed
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert len(result["rows"]) == len(quant_error.CONFIGS)
    # The tiny Llama's matrices: embedding, head and 2 blocks of 4 attention + 3 MLP matrices.
    c = quant_error.TINY_LLAMA
    kv = c.dim // c.n_heads * c.kv_heads
    block = 2 * c.dim * c.dim + 2 * c.dim * kv + 3 * c.dim * c.ffn_dim
    assert result["matrix_params"] == 2 * c.vocab_size * c.dim + c.n_layers * block
    assert result["final_loss"] < np.log(256) - 1.0  # 30 AdamW steps learn the byte statistics
    for row in result["rows"]:
        for key in ("mse_m_over_sqrt_v", "rel_mse_m", "rel_mse_v"):
            assert np.isfinite(row[key]) and row[key] > 0
    rows = {(r["m_format"], r["v_format"], r["expansion"]): r for r in result["rows"]}
    # E4M3 has one more mantissa bit than E5M2: lower error on m without expansion.
    assert rows[("e4m3", "e4m3", False)]["rel_mse_m"] < rows[("e5m2", "e5m2", False)]["rel_mse_m"]
    # Expansion lowers every error of every format pair, and no v flushes to zero with it.
    for m_fmt, v_fmt in {(m, v) for m, v, _ in quant_error.CONFIGS}:
        plain, expanded = rows[(m_fmt, v_fmt, False)], rows[(m_fmt, v_fmt, True)]
        for key in ("mse_m_over_sqrt_v", "rel_mse_m", "rel_mse_v"):
            assert expanded[key] < plain[key], (m_fmt, v_fmt, key)
        assert expanded["zeroed_v_fraction"] == 0
    gain = result["expansion_gain_e4m3"]
    assert gain > 1.5
    assert gain == pytest.approx(
        rows[("e4m3", "e4m3", False)]["mse_m_over_sqrt_v"]
        / rows[("e4m3", "e4m3", True)]["mse_m_over_sqrt_v"]
    )


def test_quant_error_rejects_bad_arguments():
    with pytest.raises(SystemExit):
        quant_error.main(["--steps", "0"])
    with pytest.raises(SystemExit):
        quant_error.main(["--group-size", "0"])
