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
    assert json.loads(out.read_text())["rows"] == result["rows"]
    assert len(result["rows"]) == len(quant_error.CONFIGS)
    for row in result["rows"]:
        for key in ("mse_m_over_sqrt_v", "rel_mse_m", "rel_mse_v"):
            assert np.isfinite(row[key]) and row[key] > 0
    rows = {(r["m_format"], r["v_format"], r["expansion"]): r for r in result["rows"]}
    # E4M3 has one more mantissa bit than E5M2: lower error on m without expansion.
    assert rows[("e4m3", "e4m3", False)]["rel_mse_m"] < rows[("e5m2", "e5m2", False)]["rel_mse_m"]


def test_quant_error_rejects_bad_arguments():
    with pytest.raises(SystemExit):
        quant_error.main(["--steps", "0"])
