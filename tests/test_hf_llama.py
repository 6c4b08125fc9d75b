"""Hugging Face Llama import/export against `transformers` itself (CPU torch, no download).

Each variant is a tiny random ``LlamaForCausalLM`` built from a config, with every weight
(norm scales included) randomised so that a swapped or mis-transposed tensor shows. Stated
tolerances, relative L2 error of the logits against transformers in fp32:

* ``bf16`` policy computing in fp32: < 1e-4 (the mapping itself; only summation order differs),
* ``bf16`` policy computing in BF16 (training's default): < 3e-2,
* ``coat`` policy (FP8 E4M3 GEMMs and activations): < 0.25. Measured 0.15 on these random
  weights, where the FP8-GEMM-only ``fp8_linear`` policy measures 0.12: each per-tensor E4M3
  GEMM adds ~5% RMS noise that compounds through the blocks (as in ``test_llama``'s gradient
  check); the import itself is exact (the first bound).
* export in fp32, reloaded by transformers: < 1e-5; exported in BF16: < 3e-2.
"""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from child_env import child_env

from coat_jax.models import hf_llama
from coat_jax.ops import sharding

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from hf_util import save_random, torch_logits  # noqa: E402

VOCAB, SEQ = 128, 24
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
)
VARIANTS = {
    "mha": {},
    "gqa": dict(num_key_value_heads=2, rope_theta=500000.0),
    "tied": dict(tie_word_embeddings=True),
    "llama3_rope": dict(
        num_key_value_heads=2,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=32,
        ),
    ),
    "linear_rope": dict(rope_scaling=dict(rope_type="linear", factor=4.0)),
}


def make_hf_model(path, seed=0, **overrides):
    """A random transformers Llama saved to ``path``; returns the (fp32, eval) model."""
    config = transformers.LlamaConfig(**{**BASE, **overrides})
    return save_random(transformers.LlamaForCausalLM(config), path, seed)


def rel_err(a, b):
    return float(np.linalg.norm(np.asarray(a) - b) / np.linalg.norm(b))


@pytest.fixture(scope="module", params=list(VARIANTS))
def hf_model(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    model = make_hf_model(path, **VARIANTS[request.param])
    tokens = np.random.default_rng(1).integers(0, VOCAB, (2, SEQ))
    return request.param, path, model, tokens, torch_logits(model, tokens)


def test_import_matches_transformers_logits(hf_model):
    name, path, _, tokens, ref = hf_model
    tokens = jnp.asarray(tokens, jnp.int32)
    fp32 = hf_llama.load_model(path, precision="fp32")  # full-precision dots (no TF32 on a GPU)
    bf16 = hf_llama.load_model(path, precision="bf16")
    coat = hf_llama.load_model(path, precision="coat")
    assert bf16.config.tie_embeddings == (name == "tied")
    err = {
        "fp32": rel_err(fp32(tokens), ref),
        "bf16": rel_err(bf16(tokens), ref),
        "coat": rel_err(coat(tokens), ref),
    }
    print(name, "logits relative error vs transformers fp32:", err)
    assert err["fp32"] < 1e-4
    assert err["bf16"] < 3e-2
    assert err["coat"] < 0.25


def test_export_reloads_in_transformers(hf_model, tmp_path):
    name, path, _, tokens, ref = hf_model
    config, _, params = hf_llama.load_params(path)
    out = tmp_path / "out"
    files = hf_llama.save_pretrained(params, config, str(out), dtype="float32")
    assert "model.safetensors" in files and "config.json" in files
    reloaded = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert rel_err(torch_logits(reloaded, tokens), ref) < 1e-5
    assert hf_llama.read_config(str(out)) == config  # config.json round trip


def test_sharded_bf16_export_and_sharded_import(tmp_path):
    make_hf_model(tmp_path / "src", **VARIANTS["gqa"])
    tokens = np.random.default_rng(2).integers(0, VOCAB, (2, SEQ))
    config, _, params = hf_llama.load_params(str(tmp_path / "src"))
    shutil.copyfile(tmp_path / "src/config.json", tmp_path / "tokenizer.json")  # any file
    out = str(tmp_path / "out")
    files = hf_llama.save_pretrained(
        params, config, out, max_shard_bytes=100_000, tokenizer_from=str(tmp_path)
    )
    assert "model.safetensors.index.json" in files and "tokenizer.json" in files
    assert len([f for f in files if f.endswith(".safetensors")]) > 2
    reloaded = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    exact = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.float32)
    ref = torch_logits(exact, tokens)
    assert rel_err(torch_logits(reloaded, tokens), ref) < 3e-2  # bf16 weights
    # Sharded folder back in, placed with explicit shardings: same weights as the bf16 export.
    mesh = sharding.make_mesh()
    specs = sharding.shardings(mesh, sharding.param_specs(mesh, params))
    _, _, again = hf_llama.load_params(out, shardings=specs)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(params), strict=True):
        assert a.dtype == jnp.float32 and isinstance(a.sharding, jax.sharding.NamedSharding)
        np.testing.assert_allclose(a, b.astype(jnp.bfloat16).astype(jnp.float32))


# --------------------------------------------------------------------------------------------
# Bad folders: one-line errors naming the file and key, before any tensor is read.


@pytest.fixture(scope="module")
def good_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("good")
    make_hf_model(path, **VARIANTS["gqa"])
    return path


def broken_copy(good_folder, tmp_path, edit_config=None):
    path = tmp_path / "model"
    shutil.copytree(good_folder, path)
    if edit_config:
        config = json.loads((path / "config.json").read_text())
        edit_config(config)
        (path / "config.json").write_text(json.dumps(config))
    return path


def resave(path, edit):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", {"format": "pt"})


def test_missing_config(good_folder, tmp_path):
    path = broken_copy(good_folder, tmp_path)
    os.remove(path / "config.json")
    with pytest.raises(FileNotFoundError, match=r"model/config.json: not found"):
        hf_llama.load_params(str(path))


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda c: c.update(architectures=["MistralForCausalLM"]), "config.json: architectures"),
        (lambda c: c.pop("hidden_size"), "config.json: hidden_size: missing"),
        (lambda c: c.update(hidden_act="gelu"), "config.json: hidden_act: 'gelu'"),
        (lambda c: c.update(attention_bias=True), "config.json: attention_bias"),
        (lambda c: c.update(head_dim=32), "config.json: head_dim: 32"),
        (
            lambda c: c.update(rope_scaling=dict(rope_type="yarn", factor=2.0)),
            "config.json: rope_scaling.rope_type: 'yarn' is not supported",
        ),
        (
            lambda c: c.update(rope_parameters=dict(rope_type="dynamic", factor=2.0)),
            "config.json: rope_parameters.rope_type: 'dynamic' is not supported",
        ),
    ],
)
def test_bad_config(good_folder, tmp_path, edit, match):
    path = broken_copy(good_folder, tmp_path, edit)
    with pytest.raises(ValueError, match=match):
        hf_llama.load_params(str(path))


def test_wrong_tensor_shape(good_folder, tmp_path):
    path = broken_copy(good_folder, tmp_path)
    name = "model.layers.1.self_attn.k_proj.weight"
    resave(path, lambda t: t.update({name: np.zeros((64, 64), np.float32)}))
    with pytest.raises(ValueError, match=rf"model.safetensors: {name}: shape \(64, 64\)"):
        hf_llama.load_params(str(path))


def test_missing_and_unexpected_tensors(good_folder, tmp_path):
    path = broken_copy(good_folder, tmp_path)
    resave(path, lambda t: t.pop("model.norm.weight"))
    with pytest.raises(ValueError, match=r"model.safetensors: model.norm.weight: missing"):
        hf_llama.load_params(str(path))
    resave(path, lambda t: t.update({"model.norm.weight": np.ones(64, np.float32),
                                     "model.norm.bias": np.ones(64, np.float32)}))  # fmt: skip
    with pytest.raises(ValueError, match=r"model.safetensors: model.norm.bias: unexpected"):
        hf_llama.load_params(str(path))


def test_missing_weights_file_and_shard(good_folder, tmp_path):
    path = broken_copy(good_folder, tmp_path)
    os.remove(path / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor"):
        hf_llama.load_params(str(path))
    index = {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match=r"index.json: weight_map.model.norm.weight"):
        hf_llama.load_params(str(path))


# --------------------------------------------------------------------------------------------
# End to end: HF folder -> train.py (init_from, its tokenizer, response-only loss) -> export.

WORDS = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(40)] + ["Q:", "A:"]


def write_tokenizer(path):
    """A word-level tokenizer.json (+ tokenizer_config.json naming the eos) for ``WORDS``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))


def write_pairs(path, n=64):
    """Records "Q: a b" -> "A: b a": the response is learnable from the prompt."""
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.integers(0, 40, 2)
            f.write(json.dumps({"prompt": f"Q: w{a} w{b}", "response": f"A: w{b} w{a}"}) + "\n")


@pytest.mark.slow
def test_finetune_end_to_end(tmp_path):
    import subprocess
    import sys

    from coat_jax.tools import export_hf
    from coat_jax.training.checkpoint import Checkpointer

    pytest.importorskip("tokenizers")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    hf_dir, run, out = tmp_path / "hf", tmp_path / "run", tmp_path / "out"
    original = make_hf_model(hf_dir, **VARIANTS["gqa"])
    write_tokenizer(hf_dir)
    write_pairs(tmp_path / "pairs.jsonl")
    cmd = [sys.executable, os.path.join(root, "train.py"),
           "--config", os.path.join(root, "configs/llama_finetune.py"),
           f"--config.init_from={hf_dir}", f"--config.data.source={tmp_path / 'pairs.jsonl'}",
           f"--config.workdir={run}", "--config.steps=12", "--config.seq_len=8",
           "--config.batch_size=16", "--config.log_interval=4", "--config.eval_interval=12",
           "--config.checkpoint_interval=12", "--config.optimizer.lr=3e-3",
           "--config.optimizer.warmup_steps=2", "--config.progress=False"]  # fmt: skip
    env = child_env()
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_config = json.loads((run / "config.json").read_text())
    assert run_config["data"]["tokenizer"] == str(hf_dir / "tokenizer.json")
    assert run_config["model"]["n_kv_heads"] == 2 and run_config["model"]["rope_theta"] == 5e5
    lines = (run / "metrics.jsonl").read_text().splitlines()
    losses = [json.loads(line)["train_loss"] for line in lines]
    print("fine-tuning losses:", losses)
    assert np.isfinite(losses).all() and losses[-1] < losses[0]

    # The run started from the HF weights: it moved them, but not far.
    files = export_hf.export(str(run), str(out), dtype="float32")
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(files)
    exported = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    flat = lambda model: torch.cat([p.detach().flatten() for p in model.parameters()])
    before, after = flat(original), flat(exported)
    change = float((after - before).norm() / before.norm())
    print("relative weight change:", change)
    assert 0 < change < 0.5
    assert json.loads((out / "config.json").read_text())["bos_token_id"] == 1  # base kept

    # transformers' logits of the export equal ours from the checkpoint.
    config = hf_llama.read_config(str(out), "fp32")
    ckpt = Checkpointer(str(run / "checkpoints"))
    abstract = hf_llama.load_params(str(out), config)[2]
    params = ckpt.restore_params(12, abstract)
    ckpt.close()
    ours = hf_llama.nnx.merge(hf_llama.load_params(str(out), config)[1], params)
    tokens = np.random.default_rng(3).integers(0, VOCAB, (2, SEQ))
    ref = torch_logits(exported, tokens)
    assert rel_err(ours(jnp.asarray(tokens)), ref) < 1e-4

    # A coat-jax run is a valid init_from too: same model, params from its latest checkpoint.
    from coat_jax.training import finetune
    from coat_jax.training.configs import base_config

    c = base_config()
    c.init_from = str(run)
    c.model.dim = 32  # replaced by the run's, and said so
    assert "dim: 32 -> 64" in finetune.resolve_init_from(c)
    assert c.model.dim == 64 and c.data.tokenizer == str(hf_dir / "tokenizer.json")
    again = finetune.initial_params(c, abstract)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)


def test_corrupt_weights_file(good_folder, tmp_path):
    path = broken_copy(good_folder, tmp_path)
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ValueError, match=r"model.safetensors: not a readable safetensors file"):
        hf_llama.load_params(str(path))
