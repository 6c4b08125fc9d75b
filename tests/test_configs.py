"""coat_jax.training.configs: shipped configs, overrides, validation, the FP8 recipe keys."""

import pathlib

import numpy as np
import pytest

from coat_jax.core.recipe import Fp8Recipe
from coat_jax.training import configs
from coat_jax.training.optimizer import make_optimizer
from pallas_kernels.dispatch import hopper_gpu

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_config(name, overrides=None):
    return configs.load_file(str(ROOT / "configs" / f"{name}.py"), overrides)


@pytest.mark.parametrize(
    "name",
    ["llama", "llama_tiny", "llama_114m", "llama2_7b", "llama2_13b", "llama3_8b", "llama_finetune"],
)
def test_shipped_configs_validate(name):
    config = load_config(name)
    configs.validate(config)
    with pytest.raises(AttributeError):
        config.no_such_key = 1  # locked: typos cannot slip in
    assert configs.llama_config(config).num_params() > 0


def test_decay_steps_lets_a_run_in_chunks_follow_one_schedule():
    config = load_config("llama_tiny")
    whole = make_optimizer(config.optimizer, 40).schedule
    config.optimizer.decay_steps = 40
    chunk = make_optimizer(config.optimizer, 10).schedule  # a first chunk of 10 steps
    default = make_optimizer(load_config("llama_tiny").optimizer, 10).schedule
    steps = np.arange(10)
    np.testing.assert_array_equal(chunk(steps), whole(steps))
    assert float(default(9)) != float(whole(9))  # without it the cosine ends at the chunk


def test_config_overrides_from_strings():
    """The benches' --set KEY=VALUE: literals parse as Python values, the rest as strings;
    dotted keys reach nested fields; a missing '=' is an error naming the item."""
    overrides = configs.parse_overrides(["optimizer.lr=1e-3", "precision=coat", "mesh.fsdp=-1"])
    assert overrides == {"optimizer.lr": 1e-3, "precision": "coat", "mesh.fsdp": -1}
    config = load_config("llama_tiny", overrides)
    assert (config.optimizer.lr, config.precision, config.mesh.fsdp) == (1e-3, "coat", -1)
    with pytest.raises(ValueError, match="'precision': expected KEY=VALUE"):
        configs.parse_overrides(["precision"])


def test_fp8_keys_make_the_models_recipe():
    """config.fp8 is the model's Fp8Recipe, field for field; the default is COAT's."""
    config = load_config("llama_tiny")
    assert configs.llama_config(config).fp8 == Fp8Recipe()
    config.fp8.update(grad_format="e4m3", gemm="auto", saved_group=32)
    config.model.update(dim=64, ffn_dim=192)
    model = configs.llama_config(config)
    assert model.fp8 == Fp8Recipe(grad_format="e4m3", gemm="auto", saved_group=32)
    assert model.policy().recipe is model.fp8


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("fp8.grad_format", "e3m4", "config.fp8: Fp8Recipe.grad_format: unknown FP8 format"),
        ("fp8.gemm", "cublas", "config.fp8: Fp8Recipe.gemm='cublas'"),
        ("fp8.saved_group", 0, "config.fp8: Fp8Recipe.saved_group"),
        ("fp8.saved_group", 48, "config.model: LlamaConfig.dim=64 must be a multiple of 48"),
        ("batch_size", -2, "config.batch_size must be a positive int"),
        ("memory_limit_gb", -1.0, "config.memory_limit_gb"),
        ("fp8.fused_quantize", "triton", "config.fp8: Fp8Recipe.fused_quantize='triton'"),
        ("optimizer.master_weights", "fp16", "config.optimizer.master_weights='fp16'"),
        ("model.loss_chunk", -1, "LlamaConfig.loss_chunk must be an int >= 0"),
        ("model.recompute_attention", None, "LlamaConfig.recompute_attention must be a bool"),
    ],
)
def test_bad_values_name_their_key(key, value, match):
    config = load_config("llama_tiny")
    configs.apply_overrides(config, {key: value})
    with pytest.raises(ValueError, match=match):
        configs.validate(config)


def test_batch_size_minus_one_asks_for_the_largest_batch():
    config = load_config("llama_tiny", {"batch_size": -1, "grad_accum": 3})
    configs.validate(config)  # no multiple of grad_accum to check yet


@pytest.mark.parametrize(
    "key", ["gemm", "fused_quantize", "fused_mlp", "fused_backward", "grad_transpose"]
)
def test_pallas_off_a_hopper_gpu_is_refused_before_the_step(key):
    config = load_config("llama_tiny", {f"fp8.{key}": "pallas"})
    if hopper_gpu():
        pytest.skip("a Hopper GPU runs the Pallas kernels")
    with pytest.raises(ValueError, match=f"config.fp8.{key}='pallas' needs a Hopper GPU"):
        configs.validate(config)
