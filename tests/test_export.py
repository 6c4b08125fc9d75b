"""Exporting never loses what a folder held: ``export_hf.check_out`` refuses destinations that
would (the run itself, its base model, another run, a non-empty folder without --overwrite),
and ``hf_llama.save_pretrained`` writes beside the destination first, so a failed write leaves
it as it was and a finished one replaces the earlier weights in one piece."""

import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coat_jax.models import hf_llama
from coat_jax.models.llama import Llama, LlamaConfig
from coat_jax.tools import export_hf

pytest.importorskip("safetensors")

CONFIG = LlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, ffn_dim=64, precision="bf16")


def params(seed=0):
    return nnx.state(Llama(CONFIG, param_dtype=jnp.float32, rngs=nnx.Rngs(seed)), nnx.Param)


def listing(folder):
    return sorted(os.listdir(folder))


def read_weights(folder):
    st = pytest.importorskip("safetensors.numpy")
    merged = {}
    for file in listing(folder):
        if file.endswith(".safetensors"):
            merged.update(st.load_file(os.path.join(folder, file)))
    return merged


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda run, base, tmp: run, "inside the run's own folder"),
        (lambda run, base, tmp: run / "hf", "inside the run's own folder"),
        (lambda run, base, tmp: base, "the folder the run started from"),
        (lambda run, base, tmp: tmp / "other_run", r"a train.py run \(checkpoints/\)"),
        (lambda run, base, tmp: tmp / "a_file", "exists and is not a folder"),
        (lambda run, base, tmp: tmp / "full", r"not empty \(notes.md\); pass --overwrite"),
    ],
    ids=["run", "in_run", "init_from", "other_run", "file", "non_empty"],
)
def test_check_out_refuses_what_would_lose_files(tmp_path, make, match):
    run, base = tmp_path / "run", tmp_path / "base"
    for folder in (run / "checkpoints", base, tmp_path / "other_run" / "checkpoints",
                   tmp_path / "full"):  # fmt: skip
        folder.mkdir(parents=True)
    (tmp_path / "a_file").write_text("")
    (tmp_path / "full" / "notes.md").write_text("mine")
    out = make(run, base, tmp_path)
    with pytest.raises(ValueError, match=match) as e:
        export_hf.check_out(str(out), str(run), str(base), overwrite=False)
    assert "\n" not in str(e.value)


def test_check_out_takes_new_empty_and_overwritten_folders(tmp_path):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "empty").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "config.json").write_text("{}")
    run = str(tmp_path / "run")
    for out, overwrite in (("new", False), ("empty", False), ("full", True)):
        export_hf.check_out(str(tmp_path / out), run, "", overwrite)


def test_a_new_export_replaces_an_earlier_one_whole(tmp_path):
    """Over an earlier sharded export: the new single file replaces the shards and the index,
    config.json is rewritten, other files stay, no staging folder is left."""
    out = tmp_path / "out"
    files = hf_llama.save_pretrained(params(0), CONFIG, str(out), max_shard_bytes=4_000)
    assert hf_llama.INDEX in files and len(files) > 3
    (out / "README.md").write_text("mine")
    files = hf_llama.save_pretrained(params(1), CONFIG, str(out), dtype="float32")
    assert listing(out) == sorted([*files, "README.md"])
    assert files == [hf_llama.SINGLE, hf_llama.CONFIG]
    expected = read_weights_of(params(1), tmp_path / "fresh")
    for name, value in read_weights(out).items():
        np.testing.assert_array_equal(value, expected[name])
    assert listing(tmp_path) == ["fresh", "out"]


def read_weights_of(state, folder):
    hf_llama.save_pretrained(state, CONFIG, str(folder), dtype="float32")
    return read_weights(folder)


def test_a_failed_write_leaves_the_folder_as_it_was(tmp_path, monkeypatch):
    out = tmp_path / "out"
    hf_llama.save_pretrained(params(0), CONFIG, str(out))
    before = {f: (out / f).read_bytes() for f in listing(out)}

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(hf_llama, "_write_folder", fail)
    with pytest.raises(OSError, match="disk full"):
        hf_llama.save_pretrained(params(1), CONFIG, str(out))
    assert {f: (out / f).read_bytes() for f in listing(out)} == before
    assert listing(tmp_path) == ["out"]  # the staging folder is gone
    with pytest.raises(OSError, match="disk full"):
        hf_llama.save_pretrained(params(1), CONFIG, str(tmp_path / "new"))
    assert listing(tmp_path) == ["out"]
