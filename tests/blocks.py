"""Shared test helpers: a Llama block's saved activations (``coat_jax.training.residuals``),
and COAT's MLP on a mesh of 8 virtual CPU devices (in a subprocess)."""

import subprocess
import sys
import textwrap

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


MESH_MLP = textwrap.dedent(
    """
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp, numpy as np
    from coat_jax.core.recipe import Fp8Recipe
    from coat_jax.ops import flow, sharding

    P = jax.sharding.PartitionSpec
    mesh = sharding.make_mesh(2, 2, 2)  # data x fsdp x tensor
    k = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(k[0], (8, 16, 128)).astype(jnp.bfloat16)
    scale = (1 + 0.1 * jax.random.normal(k[1], (128,))).astype(jnp.bfloat16)
    wg, wu = (jax.random.normal(kk, (128, 256)) * 0.1 for kk in k[2:4])
    wd = jax.random.normal(k[4], (256, 128)) * 0.06
    cot = jax.random.normal(k[5], (8, 16, 128)).astype(jnp.bfloat16)

    def run(recipe, on_mesh):
        # [loss, every gradient] of fp8_mlp: on one device, or with the tokens split over
        # data x fsdp and the weights over fsdp x tensor
        loss = lambda *a: jnp.sum(flow.fp8_mlp(*a, 1e-5, recipe).astype(jnp.float32) * cot)
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
        if not on_mesh:
            return jax.tree.leaves(step(x, scale, wg, wu, wd))
        specs = (P(("data", "fsdp")), P(), P("fsdp", "tensor"), P("fsdp", "tensor"),
                 P("tensor", "fsdp"))
        with jax.set_mesh(mesh):
            return jax.tree.leaves(step(*(
                jax.device_put(a, jax.sharding.NamedSharding(mesh, s))
                for a, s in zip((x, scale, wg, wu, wd), specs))))

    def assert_close(got, want, tol=2.0**-8):
        # each leaf within tol of want's (relative Frobenius)
        for a, b in zip(got, want, strict=True):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            assert np.linalg.norm(a - b) <= tol * np.linalg.norm(b), a.shape
    """
)
"""A script's head: ``run(recipe, on_mesh)`` of ``fp8_mlp`` on a 2x2x2 mesh (8 virtual CPU
devices) or one device, and ``assert_close``; a test appends its checks and prints OK."""


def run_on_8_devices(script: str) -> None:
    """Runs ``script`` in a fresh interpreter (XLA's device count is set before jax loads)
    and asserts it printed OK."""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr[-3000:]
