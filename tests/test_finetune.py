"""``config.init_from`` (:mod:`coat_jax.training.finetune`): what a Hugging Face folder or a
run decides of the new run's config, and what it leaves to the run (its compute options, a
resume's own config, the tokenizer it must name when the folder has none)."""

import json

import pytest

from coat_jax.training import configs, finetune

HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 64,
             "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}  # fmt: skip


def hf_folder(path, tokenizer=True):
    """A Hugging Face folder as far as resolve_init_from reads one: config.json, and a
    tokenizer.json (contents unread here) when ``tokenizer``."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(HF_CONFIG))
    if tokenizer:
        (path / "tokenizer.json").write_text("{}")
    return path


def config(init_from, **overrides):
    c = configs.base_config()
    c.init_from = str(init_from)
    return configs.apply_overrides(c, overrides)


def test_the_weights_decide_the_model_and_the_run_its_compute(tmp_path):
    """Shape keys come from the folder; loss_chunk, recompute_attention and matmul_precision
    (configs.COMPUTE_ONLY_MODEL_KEYS) stay what this run set: the memory options a large
    vocabulary's fine-tune needs were reset to the base config's."""
    c = config(hf_folder(tmp_path / "hf"), **{"model.loss_chunk": 16, "model.dim": 32,
                                             "model.recompute_attention": True,
                                             "model.matmul_precision": "highest"})  # fmt: skip
    changed = finetune.resolve_init_from(c)
    assert "dim: 32 -> 64" in changed and not any("loss_chunk" in line for line in changed)
    assert (c.model.dim, c.model.n_kv_heads, c.model.ffn_dim) == (64, 2, 128)
    assert (c.model.loss_chunk, c.model.recompute_attention, c.model.matmul_precision) == (
        16, True, "highest")  # fmt: skip
    assert c.data.tokenizer == str(tmp_path / "hf" / "tokenizer.json")


def test_a_folder_without_tokenizer_needs_one_named(tmp_path):
    """Its ids are not UTF-8 bytes: "auto" refused in one line (the run trained on bytes,
    silently); a named tokenizer, or bytes asked for, is taken; generation reads such a
    folder as ids only (tokenizer_required=False)."""
    hf = hf_folder(tmp_path / "hf", tokenizer=False)
    with pytest.raises(ValueError, match=r"has no tokenizer.json: pass --config.data.tokenizer"):
        finetune.resolve_init_from(config(hf))
    for named in ("bytes", str(tmp_path / "tok.json")):
        c = config(hf, **{"data.tokenizer": named})
        finetune.resolve_init_from(c)
        assert c.data.tokenizer == named
    c = config(hf)
    finetune.resolve_init_from(c, tokenizer_required=False)
    assert c.data.tokenizer == "bytes"


def test_a_resume_reads_its_own_config_not_init_from(tmp_path):
    """A resumed fine-tune takes its model and tokenizer from the run's config.json, so the
    folder it started from may be gone; a workdir that started elsewhere, or a fresh start,
    reads init_from (and says it is missing)."""
    hf = hf_folder(tmp_path / "hf")
    workdir = tmp_path / "run"
    workdir.mkdir()
    first = config(hf, workdir=str(workdir))
    finetune.resolve_init_from(first)
    (workdir / "config.json").write_text(first.to_json())
    (hf / "config.json").unlink()
    (hf / "tokenizer.json").unlink()
    hf.rmdir()

    c = config(hf, workdir=str(workdir), resume=True, **{"model.loss_chunk": 8})
    changed = finetune.resolve_init_from(c)
    assert (c.model.dim, c.model.n_layers, c.model.loss_chunk) == (64, 2, 8)
    assert c.data.tokenizer == str(hf / "tokenizer.json") and any("dim: " in x for x in changed)
    assert configs.resume_changes(json.loads(first.to_json()), c)[0] == []  # nothing refused
    for fresh in (config(hf, workdir=str(workdir)),  # not a resume
                  config(tmp_path / "other", workdir=str(workdir), resume=True)):  # fmt: skip
        with pytest.raises(FileNotFoundError, match="no such folder"):
            finetune.resolve_init_from(fresh)
    with pytest.raises(FileNotFoundError, match=r"hf'?: no such folder \(the weights to start"):
        finetune.initial_params(c, None)  # a resume with no checkpoint yet starts from them


def test_trained_context_of_a_hugging_face_folder(tmp_path):
    """train.py warns when seq_len is past it: max_position_embeddings of an HF folder's
    config.json, None for a run, a folder without it, no init_from, or a bad value."""
    hf = hf_folder(tmp_path / "hf")
    assert finetune.trained_context(config(hf)) is None  # not in HF_CONFIG
    (hf / "config.json").write_text(json.dumps(HF_CONFIG | {"max_position_embeddings": 256}))
    assert finetune.trained_context(config(hf)) == 256
    (hf / "config.json").write_text(json.dumps(HF_CONFIG | {"max_position_embeddings": "x"}))
    assert finetune.trained_context(config(hf)) is None
    (hf / "checkpoints").mkdir()  # a coat-jax run: its own seq_len, no HF context
    assert finetune.trained_context(config(hf)) is None
    assert finetune.trained_context(config("")) is None
    assert finetune.trained_context(config(tmp_path / "gone")) is None
