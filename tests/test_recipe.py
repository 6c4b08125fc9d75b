"""coat_jax.core.recipe: the FP8 recipe, checked at construction; the XLA options it and the
precision policies give a train step."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coat_jax.core.recipe import Fp8Recipe
from coat_jax.models.llama import PRESETS, Llama
from coat_jax.models.policy import get_policy
from coat_jax.training.optimizer import make_optimizer
from coat_jax.training.step import make_train_step


def test_default_recipe_is_coats():
    r = Fp8Recipe()
    formats = (r.forward.name, r.grad.name, r.saved.name)
    assert formats == ("e4m3", "e5m2", "e4m3") and r.saved_group == 16
    assert r.gemm == "xla" and hash(r) == hash(Fp8Recipe())  # a static argument of FP8 ops


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"forward_format": "e3m4"}, "Fp8Recipe.forward_format: unknown FP8 format"),
        ({"saved_group": 0}, "Fp8Recipe.saved_group must be a positive int"),
        ({"saved_group": True}, "Fp8Recipe.saved_group must be a positive int"),
        ({"gemm": "cublas"}, "Fp8Recipe.gemm='cublas'"),
        ({"triton_gemm": "no"}, "Fp8Recipe.triton_gemm must be a bool"),
        ({"saved_weights": "bf16"}, "Fp8Recipe.saved_weights='bf16'"),
        ({"gemm_product": "f16"}, "Fp8Recipe.gemm_product='f16'"),
        ({"pow2_scales": 1}, "Fp8Recipe.pow2_scales must be a bool"),
        ({"pow2_scales": True, "scaling": "block"}, "pow2_scales rounds per-tensor scales"),
    ],
)
def test_bad_recipes_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Fp8Recipe(**kwargs)


def test_policies_carry_the_recipe():
    recipe = Fp8Recipe(gemm="auto")
    assert get_policy("coat", recipe).recipe is recipe
    assert get_policy("coat").recipe == Fp8Recipe()
    config = dataclasses.replace(PRESETS["tiny"], fp8=recipe)
    assert config.policy().recipe is recipe and config.policy().name == "coat"


def test_fp8_policies_compile_gemms_without_triton_on_a_gpu(monkeypatch):
    """FP8 steps on a GPU ask XLA for cuBLASLt GEMMs only (unless the recipe allows Triton);
    BF16 and other backends keep the defaults; the option reaches jax.jit (a GPU-only XLA
    option compiles on the CPU too)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert get_policy("coat").compiler_options() is None
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    want = {"xla_gpu_enable_triton_gemm": False}
    assert get_policy("coat").compiler_options() == want
    assert get_policy("fp8_linear").compiler_options() == want
    assert get_policy("bf16").compiler_options() is None
    assert get_policy("coat", Fp8Recipe(triton_gemm=True)).compiler_options() is None
    monkeypatch.undo()
    graph, params = nnx.split(Llama(PRESETS["tiny"], rngs=nnx.Rngs(0)))
    optimizer = make_optimizer(_optimizer_config(), 100).tx
    step = make_train_step(graph, optimizer, compiler_options=want)
    batch = jnp.zeros((1, 2, 65), jnp.int32)
    _, _, metrics = step(params, optimizer.init(params), batch)
    assert np.isfinite(float(metrics["loss"]))


def _optimizer_config():
    from coat_jax.training.configs import base_config

    return base_config().optimizer
