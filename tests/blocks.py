"""The tests' measure of a Llama block's saved activations (``coat_jax.training.residuals``)."""

import jax
import jax.numpy as jnp
from flax import nnx

from coat_jax.core.recipe import Fp8Recipe
from coat_jax.models import nn
from coat_jax.models.policy import get_policy
from coat_jax.training import residuals


def coat_block_saved_bytes(recipe: Fp8Recipe, h: int = 64, t: int = 16, ffn: int = 192) -> float:
    """Bytes a COAT block (hidden ``h``, 4 heads, MLP ``ffn``) with ``recipe`` saves for
    backward per example of ``t`` tokens."""
    block = nn.Block(h, 4, 4, ffn, policy=get_policy("coat", recipe), rngs=nnx.Rngs(0))
    graph, params = nnx.split(block)

    def f(x, params):
        return nnx.merge(graph, params)(x, jnp.broadcast_to(jnp.arange(t), x.shape[:2]))

    args = lambda b: (jax.random.normal(jax.random.key(b), (b, t, h), jnp.bfloat16), params)
    return residuals.activation_bytes_per_example(args, f)
