"""OLMo v1 as configurations of the Llama code: the presets and config files, every precision
policy with the weightless LayerNorm and QKV clipping, generation's decode path, and Hugging
Face ``OlmoForCausalLM`` import/export against ``transformers`` itself (CPU torch, no download).

Stated tolerances against transformers' fp32 logits: our import computing in fp32 (``bf16``
policy, ``compute_dtype=float32``) within 1e-4 max abs (only summation order differs; logits
are O(1) here); the ``coat`` policy within 0.25 relative L2 (FP8 E4M3 GEMMs and activations, as
in ``test_hf_llama``); an fp32 export reloaded by transformers within 1e-4 max abs.
"""

import dataclasses
import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from child_env import child_env
from flax import nnx

from coat_jax.models import hf_llama, llama
from coat_jax.training import configs, planner
from coat_jax.training.run import assemble

try:
    import safetensors  # noqa: F401
    import torch
    import transformers
except ImportError:
    torch = transformers = None
needs_transformers = pytest.mark.skipif(torch is None, reason="needs torch, transformers")

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = dataclasses.replace(llama.PRESETS["tiny"], norm="layer", tie_embeddings=True)


def build(precision="coat", **overrides):
    return llama.Llama(dataclasses.replace(TINY, precision=precision, **overrides),
                       rngs=nnx.Rngs(0))  # fmt: skip


# --------------------------------------------------------------------------------------------
# Presets, config files and config checks


def test_presets_have_the_published_shapes_and_parameter_counts():
    """OLMo-1B 1.18B and OLMo-7B 6.89B parameters (arXiv 2402.00838; the HF checkpoints'
    counts), and the abstract models hold exactly that many, with no norm weights."""
    counts = {"olmo_1b": 1_176_764_416, "olmo_7b": 6_888_095_744}
    for name, n in counts.items():
        config = llama.PRESETS[name]
        assert config.num_params() == n and config.norm == "layer" and config.clip_qkv is None
        abstract = nnx.state(nnx.eval_shape(lambda c=config: llama.Llama(c, rngs=nnx.Rngs(0))))
        assert sum(x.size for x in jax.tree.leaves(abstract)) == n
        assert not [p for p, _ in nnx.to_flat_state(abstract) if "norm" in p[-1]]
    assert llama.PRESETS["olmo_1b"].tie_embeddings and not llama.PRESETS["olmo_7b"].tie_embeddings


@pytest.mark.parametrize("name", ["olmo_1b", "olmo_7b"])
def test_config_files_load_validate_and_name_the_preset(name):
    config = configs.load_file(str(ROOT / "configs" / f"{name}.py"))
    configs.validate(config)
    preset = llama.PRESETS[name]
    assert configs.llama_config(config) == dataclasses.replace(preset, n_kv_heads=preset.n_heads)
    assert (config.seq_len, config.model.norm) == (2048, "layer")


def test_norm_and_clip_keys_from_the_command_line():
    """``--config.model.norm=layer`` and ``--config.model.clip_qkv=8.0`` reach the model; bad
    values name their field."""
    tiny = str(ROOT / "configs" / "llama_tiny.py")
    config = configs.load_file(tiny, {"model.norm": "layer", "model.clip_qkv": 8.0})
    configs.validate(config)
    model = configs.llama_config(config)
    assert (model.norm, model.clip_qkv) == ("layer", 8.0)
    bad = {"model.norm": ("batch", "config.model: LlamaConfig.norm='batch'"),
           "model.clip_qkv": (-1.0, "config.model: LlamaConfig.clip_qkv")}  # fmt: skip
    for key, (value, match) in bad.items():
        with pytest.raises(ValueError, match=match):
            configs.validate(configs.load_file(tiny, {key: value}))


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(norm="batch"), r"LlamaConfig.norm='batch': expected one of \('rms', 'layer'\)"),
        (dict(clip_qkv=0.0), "LlamaConfig.clip_qkv must be None or a number > 0, got 0.0"),
        (dict(clip_qkv=True), "LlamaConfig.clip_qkv must be None or a number > 0, got True"),
    ],
)
def test_bad_config_raises(overrides, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(TINY, **overrides)


def test_memory_plan_of_a_tiny_olmo():
    """The dry run's plan (train step compiled, activations from the abstract residuals) works
    for the LayerNorm model, and COAT saves less than BF16 there too."""

    def plan(precision):
        config = configs.load_file(
            str(ROOT / "configs" / "llama_tiny.py"),
            {"model.norm": "layer", "model.clip_qkv": 4.0, "precision": precision},
        )
        configs.validate(config)
        return planner.memory_plan(assemble(config))

    coat, bf16 = plan("coat"), plan("bf16")
    assert 0 < coat["activations_estimate"] < bf16["activations_estimate"]
    assert coat["compiled_total"] > 0


# --------------------------------------------------------------------------------------------
# The model in every policy


@pytest.mark.parametrize("clip", [None, 0.5])
@pytest.mark.parametrize("precision", ["bf16", "fp8_linear", "coat"])
def test_forward_close_to_fp32_and_grads_finite(precision, clip):
    """Logits within 3% (BF16) / 25% (FP8 policies) relative L2 of fp32 math; finite fp32
    gradients for every parameter, and no norm parameters."""
    model = build(precision, clip_qkv=clip)
    tokens = jax.random.randint(jax.random.key(0), (2, 17), 0, TINY.vocab_size)
    ref = build("bf16", clip_qkv=clip)(tokens, compute_dtype=jnp.float32)
    logits = model(tokens)
    err = float(jnp.linalg.norm(logits - ref) / jnp.linalg.norm(ref))
    assert err < (0.03 if precision == "bf16" else 0.25), err
    grads = nnx.grad(llama.loss_fn)(model, tokens)
    leaves = jax.tree.leaves(grads)
    assert all(np.isfinite(np.asarray(g)).all() and g.dtype == jnp.float32 for g in leaves)
    assert len(leaves) == 1 + 7 * TINY.n_layers  # embedding (tied) + 7 matrices a block


def test_clip_qkv_clamps_and_its_gradient_is_torchs():
    """With a tiny limit every projection saturates: the attention output no longer depends on
    the input, so the q/k/v weights get no gradient (torch's clamp passes none outside)."""
    model = build("bf16", clip_qkv=1e-3)
    block = model.blocks[0].attention
    x = jax.random.normal(jax.random.key(1), (1, 8, TINY.dim)).astype(jnp.bfloat16) * 10
    positions = jnp.arange(8)[None]
    q, k, v = block._qkv(x, positions)
    assert float(jnp.abs(v).max()) <= 1e-3 * (1 + 2**-7)
    graph, params = nnx.split(block)
    loss = lambda p: nnx.merge(graph, p)(x, positions).astype(jnp.float32).sum()
    grads = jax.grad(loss)(params)
    inside = (jnp.abs(x.astype(jnp.float32) @ block.wv[...]) <= 1e-3).mean()
    assert float(inside) < 0.01  # nearly everything clipped
    assert float(jnp.abs(grads["wv"][...]).max()) < 0.05 * float(jnp.abs(grads["wo"][...]).max())


@pytest.mark.slow
def test_every_policy_trains_a_tiny_olmo():
    """60 AdamW steps on the stdlib corpus: BF16 drops by more than 1.5 nats; the FP8 policies
    end within 3% of BF16's loss (as ``test_llama`` asks of the Llama)."""
    from coat_jax.tools import quant_error

    curves = {}
    for p in ("bf16", "fp8_linear", "coat"):
        config = dataclasses.replace(TINY, precision=p, clip_qkv=4.0)
        curves[p] = quant_error.train_llama(optax.adamw(3e-3, weight_decay=0.0), 60, config,
                                            seed=1)[0]  # fmt: skip
    final = {p: float(c[-10:].mean()) for p, c in curves.items()}
    print("tiny OLMo final loss per policy:", final)
    assert final["bf16"] < curves["bf16"][0] - 1.5
    for p in ("fp8_linear", "coat"):
        assert abs(final[p] / final["bf16"] - 1) < 0.03


@pytest.mark.parametrize("precision", ["bf16", "coat"])
def test_decode_matches_the_full_forward(precision):
    """Prompt then token by token through the KV cache: the same logits as one forward pass
    (same norm kind, clipping and final norm on both paths), within 2e-4 in fp32 math; COAT's
    per-tensor FP8 scales follow the tokens of each call, so there within 25% relative L2."""
    model = build(precision, clip_qkv=0.5)
    tokens = jax.random.randint(jax.random.key(2), (2, 12), 0, TINY.vocab_size)
    full = model(tokens, compute_dtype=jnp.float32)
    cache = llama.init_cache(model.config, 2, 16, jnp.float32)
    first, cache = model.decode(tokens[:, :8], cache, compute_dtype=jnp.float32)
    steps = [first]
    for i in range(8, 12):
        logits, cache = model.decode(tokens[:, i : i + 1], cache, compute_dtype=jnp.float32)
        steps.append(logits)
    steps = jnp.concatenate(steps, axis=1)
    if precision == "bf16":
        np.testing.assert_allclose(steps, full, atol=2e-4, rtol=0)
    else:
        assert float(jnp.linalg.norm(steps - full) / jnp.linalg.norm(full)) < 0.25


# --------------------------------------------------------------------------------------------
# Hugging Face OlmoForCausalLM in and out

VOCAB, SEQ = 256, 24
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=64, eos_token_id=2)  # fmt: skip
VARIANTS = {
    "untied": {},
    "tied": dict(tie_word_embeddings=True),
    "clip": dict(clip_qkv=0.5),
    "tied_clip_gqa": dict(tie_word_embeddings=True, clip_qkv=0.3, num_key_value_heads=2),
}


def make_hf_olmo(path, seed=0, **overrides):
    """A random transformers OLMo saved to ``path``; returns the (fp32, eval) model."""
    from hf_util import save_random

    config = transformers.OlmoConfig(**{**BASE, **overrides})
    return save_random(transformers.OlmoForCausalLM(config), path, seed)


def torch_logits(model, tokens):
    from hf_util import torch_logits

    return torch_logits(model, tokens)


@pytest.fixture(scope="module", params=list(VARIANTS))
def hf_olmo(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    model = make_hf_olmo(path, **VARIANTS[request.param])
    tokens = np.random.default_rng(1).integers(0, VOCAB, (2, SEQ))
    return request.param, path, tokens, torch_logits(model, tokens)


@needs_transformers
def test_import_matches_transformers_logits(hf_olmo):
    name, path, tokens, ref = hf_olmo
    config = hf_llama.read_config(path, "bf16")
    overrides = VARIANTS[name]
    assert (config.norm, config.norm_eps) == ("layer", 1e-5)
    assert config.clip_qkv == overrides.get("clip_qkv")
    assert config.tie_embeddings == overrides.get("tie_word_embeddings", False)
    tokens = jnp.asarray(tokens, jnp.int32)
    with jax.default_matmul_precision("highest"):  # fp32 GEMMs on a GPU too (not TF32)
        ours = hf_llama.load_model(path, precision="bf16")(tokens, compute_dtype=jnp.float32)
    coat = hf_llama.load_model(path, precision="coat")(tokens)
    diff = float(np.abs(np.asarray(ours) - ref).max())
    coat_err = float(np.linalg.norm(np.asarray(coat) - ref) / np.linalg.norm(ref))
    print(f"{name}: max |logit diff| vs transformers fp32 {diff:.2e}; coat rel. L2 {coat_err:.3f}")
    assert diff < 1e-4
    assert coat_err < 0.25


@needs_transformers
def test_export_reloads_in_transformers(hf_olmo, tmp_path):
    name, path, tokens, ref = hf_olmo
    config, _, params = hf_llama.load_params(path)
    out = tmp_path / "out"
    base = json.loads((pathlib.Path(path) / "config.json").read_text())
    files = hf_llama.save_pretrained(params, config, str(out), dtype="float32", base_config=base)
    assert {"model.safetensors", "config.json"} <= set(files)
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == ["OlmoForCausalLM"] and "rms_norm_eps" not in written
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(reloaded).__name__ == "OlmoForCausalLM"
    diff = float(np.abs(torch_logits(reloaded, tokens) - ref).max())
    print(f"{name}: exported, reloaded: max |logit diff| {diff:.2e}")
    assert diff < 1e-4
    assert hf_llama.read_config(str(out)) == config  # config.json round trip


# Bad folders and unexportable configs: one-line errors naming the file and key.


@pytest.fixture(scope="module")
def good_olmo(tmp_path_factory):
    path = tmp_path_factory.mktemp("good_olmo")
    make_hf_olmo(path, **VARIANTS["clip"])
    return path


def broken_copy(good, tmp_path, edit_config):
    path = tmp_path / "model"
    shutil.copytree(good, path)
    config = json.loads((path / "config.json").read_text())
    edit_config(config)
    (path / "config.json").write_text(json.dumps(config))
    return path


def olmo2(c):
    c.update(architectures=["Olmo2ForCausalLM"], model_type="olmo2")


def gpt2_without_architectures(c):
    del c["architectures"]
    c.update(model_type="gpt2")


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (olmo2, r"config.json: model_type: 'olmo2' is not supported \(OLMo 2's norms"),
        (lambda c: c.update(clip_qkv=-1.0), "config.json: clip_qkv: must be null or a number > 0"),
        (lambda c: c.update(attention_bias=True), "config.json: attention_bias: True is not"),
        (lambda c: c.update(architectures=["GPTNeoXForCausalLM"]),
         r"architectures: \['GPTNeoXForCausalLM'\] is not supported; expected "
         r"\['LlamaForCausalLM'\] or \['OlmoForCausalLM'\]"),
        (gpt2_without_architectures,
         r"architectures: missing \(and model_type 'gpt2' is not one of \['llama', 'olmo'\]\)"),
    ],
)  # fmt: skip
@needs_transformers
def test_bad_config(good_olmo, tmp_path, edit, match):
    path = broken_copy(good_olmo, tmp_path, edit)
    with pytest.raises(ValueError, match=match):
        hf_llama.load_params(str(path))


@needs_transformers
def test_model_type_alone_is_enough_and_norm_weights_are_unexpected(good_olmo, tmp_path):
    from safetensors.numpy import load_file, save_file

    path = broken_copy(good_olmo, tmp_path, lambda c: c.pop("architectures"))
    assert hf_llama.read_config(str(path)).norm == "layer"
    tensors = load_file(path / "model.safetensors")
    tensors["model.norm.weight"] = np.ones(64, np.float32)
    save_file(tensors, path / "model.safetensors", {"format": "pt"})
    with pytest.raises(ValueError, match="model.norm.weight: unexpected tensor for a "
                                         "OlmoForCausalLM"):  # fmt: skip
        hf_llama.load_params(str(path))


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(norm_eps=1e-6), "LlamaConfig.norm_eps=1e-06: transformers' OLMo LayerNorm has eps"),
        (dict(norm="rms", clip_qkv=8.0), "LlamaConfig.clip_qkv=8.0: transformers' Llama has no"),
    ],
)
def test_unexportable_configs_raise_before_writing(tmp_path, overrides, match):
    config = dataclasses.replace(TINY, **overrides)
    params = nnx.state(llama.Llama(config, rngs=nnx.Rngs(0)), nnx.Param)
    with pytest.raises(ValueError, match=match):
        hf_llama.save_pretrained(params, config, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


@needs_transformers
@pytest.mark.slow
def test_train_from_an_olmo_folder_and_export(good_olmo, tmp_path):
    """``train.py --config.init_from=<OLMo folder>`` (two steps on the byte corpus), then
    ``export_hf``: transformers reloads an ``OlmoForCausalLM`` whose fp32 logits are ours from
    the checkpoint within 1e-4."""
    import subprocess
    import sys

    from coat_jax.tools import export_hf
    from coat_jax.training.checkpoint import Checkpointer
    from coat_jax.training.generate import read_source

    run, out = tmp_path / "run", tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs/llama_tiny.py"),
           f"--config.init_from={good_olmo}", "--config.data.tokenizer=bytes",  # it has none
           f"--config.workdir={run}", "--config.steps=2",
           "--config.seq_len=16", "--config.batch_size=4", "--config.optimizer.warmup_steps=0",
           "--config.checkpoint_interval=2", "--config.eval_interval=2",
           "--config.log_interval=1"]  # fmt: skip
    # the CPU: a GPU is held by this pytest process (train.py would preallocate beside it)
    env = child_env(JAX_PLATFORMS="cpu")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    saved = json.loads((run / "config.json").read_text())["model"]
    assert (saved["norm"], saved["clip_qkv"]) == ("layer", 0.5)
    files = export_hf.export(str(run), str(out), dtype="float32")
    # the run read UTF-8 bytes (the OLMo folder has none; asked for): the export says so
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(files)
    text = "def f(x):\n    return x  # héllo"
    tokenizer = read_source(str(out)).tokenizer
    assert tokenizer.encode(text).tolist() == list(text.encode()) and tokenizer.decode(
        tokenizer.encode(text)) == text  # fmt: skip
    exported = transformers.OlmoForCausalLM.from_pretrained(out, dtype=torch.float32)
    config, graph, abstract = hf_llama.load_params(str(out), hf_llama.read_config(str(out), "bf16"))
    ckpt = Checkpointer(str(run / "checkpoints"))
    params = ckpt.restore_params(2, abstract)
    ckpt.close()
    tokens = np.random.default_rng(3).integers(0, VOCAB, (2, SEQ))
    with jax.default_matmul_precision("highest"):  # fp32 GEMMs on a GPU too (not TF32)
        ours = nnx.merge(graph, params)(jnp.asarray(tokens), compute_dtype=jnp.float32)
    assert float(np.abs(np.asarray(ours) - torch_logits(exported, tokens)).max()) < 1e-4
