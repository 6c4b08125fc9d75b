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
from coat_jax.training import finetune

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


# --------------------------------------------------------------------------------------------
# A run fine-tuned from another run: what the export takes from the Hugging Face folder the
# chain began with.


def make_run(path, init_from="", tokenizer="bytes", seed=0):
    """A train.py workdir with one checkpoint of ``params(seed)`` and its config.json."""
    from coat_jax.training import configs
    from coat_jax.training.checkpoint import Checkpointer

    c = configs.base_config()
    c.model.update(vocab_size=CONFIG.vocab_size, dim=CONFIG.dim, n_layers=CONFIG.n_layers,
                   n_heads=CONFIG.n_heads, n_kv_heads=CONFIG.n_heads,
                   ffn_dim=CONFIG.ffn_dim)  # fmt: skip
    c.precision, c.init_from, c.data.tokenizer = "bf16", str(init_from), str(tokenizer)
    ckpt = Checkpointer(str(path / "checkpoints"))
    ckpt.save(1, params(seed), {"unused": jnp.zeros(1)}, {"step": 1})
    ckpt.wait()
    ckpt.close()
    (path / "config.json").write_text(c.to_json())
    return path


def test_export_of_a_chain_of_runs_keeps_the_hf_base(tmp_path):
    """run2 started from run1, which started from the Hugging Face folder ``base`` and read its
    tokenizer as a folder: the export keeps base's config.json keys and generation_config.json
    and copies the tokenizer; writing over base is refused even with --overwrite."""
    import json

    from coat_jax.training import data

    base = tmp_path / "base"
    hf_llama.save_pretrained(params(), CONFIG, str(base),
                             tokenizer_files=data.ByteTokenizer.hf_files(),
                             base_config={"bos_token_id": 7, "eos_token_id": 9,
                                          "max_position_embeddings": 96})  # fmt: skip
    (base / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 10]}))
    run1 = make_run(tmp_path / "run1", init_from=base, tokenizer=base)
    run2 = make_run(tmp_path / "run2", init_from=run1, tokenizer=base, seed=1)
    assert finetune.base_folder(str(run2)) == str(base)
    assert finetune.base_folder(str(run2 / "checkpoints")) == str(base)
    logged = []
    files = export_hf.export(str(run2), str(tmp_path / "out"), log=logged.append)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (written["bos_token_id"], written["eos_token_id"]) == (7, 9)
    assert written["max_position_embeddings"] == 96 and "optimizer" not in written
    assert {"tokenizer.json", "generation_config.json"} <= set(files)
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert generation == {"eos_token_id": [9, 10]}
    ours = read_weights(tmp_path / "out")  # run2's weights (bf16), not run1's or base's
    for name, value in read_weights_of(params(1), tmp_path / "expected").items():
        np.testing.assert_array_equal(ours[name], value.astype(ours[name].dtype))
    assert not logged
    with pytest.raises(ValueError, match="the folder the run started from"):
        export_hf.check_out(str(base), str(run2), str(run1), overwrite=True)

    # The base and the tokenizer gone: exported without them, and said so.
    os.rename(base, tmp_path / "moved")
    files = export_hf.export(str(run2), str(tmp_path / "out2"), log=logged.append)
    assert "tokenizer.json" not in files and "generation_config.json" not in files
    assert any("is gone: config.json keeps none of its keys" in line for line in logged)
    assert any("tokenizer" in line and "is gone; no tokenizer written" in line for line in logged)


def test_base_folder_ends_at_a_loop_or_a_scratch_run(tmp_path):
    import json

    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b", init_from=tmp_path / "a")
    assert finetune.base_folder(str(b)) == ""  # a trained from scratch
    config = json.loads((a / "config.json").read_text())
    config["init_from"] = str(b)
    (a / "config.json").write_text(json.dumps(config))
    assert finetune.base_folder(str(b)) == ""
    assert finetune.base_folder(str(tmp_path / "hf")) == str(tmp_path / "hf")  # not a run
