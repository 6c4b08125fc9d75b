"""Llama (RoPE, GQA, SwiGLU, RMSNorm, tied or untied head) as a Flax NNX model, and OLMo v1 as
a configuration of it (``norm="layer"``: LayerNorm without weight or bias; ``clip_qkv``).

The precision policy (``"fp32"``, ``"bf16"``, ``"fp8_linear"``, ``"coat"``) is a config field;
embedding, final norm, LM head and the loss stay BF16/fp32 in every policy (fp32 in ``"fp32"``).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from coat_jax.core.recipe import Fp8Recipe
from coat_jax.models.nn import Block
from coat_jax.models.policy import get_policy
from coat_jax.ops import plain
from coat_jax.ops.loss import chunked_cross_entropy
from coat_jax.ops.sharding import constrain

__all__ = ["PRESETS", "KVCache", "Llama", "LlamaConfig", "init_cache", "loss_fn"]


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Sizes and precision of a Llama model.

    Attributes:
      vocab_size, dim, n_layers, n_heads: the usual sizes.
      n_kv_heads: key/value heads (GQA); ``None`` means ``n_heads``.
      ffn_dim: SwiGLU MLP width.
      rope_theta: RoPE base.
      rope_scaling: ``"none"``, ``"linear"`` or ``"llama3"`` (see
        :class:`~coat_jax.ops.plain.RopeScaling`), with ``rope_factor``, ``rope_low_freq_factor``,
        ``rope_high_freq_factor`` and ``rope_original_max_len`` (Hugging Face's
        ``original_max_position_embeddings``); the last three matter for ``"llama3"`` only.
      norm_eps: the norms' epsilon.
      norm: ``"rms"`` (RMSNorm with a weight, Llama) or ``"layer"`` (LayerNorm without weight or
        bias, OLMo v1), for the pre-norms and the final norm.
      clip_qkv: ``None``, or ``c > 0``: the query, key and value projections are clamped to
        ``[-c, c]`` (OLMo's ``clip_qkv``).
      tie_embeddings: use the embedding matrix as the LM head.
      precision: ``"fp32"`` | ``"bf16"`` | ``"fp8_linear"`` | ``"coat"``.
      fp8: the FP8 recipe of the FP8 precisions (formats, group size, GEMM backend).
      matmul_precision: ``None`` (the policy's: ``"highest"`` for ``"fp32"``, JAX's default
        otherwise) or a ``jax.default_matmul_precision`` value the model is traced under, e.g.
        ``"BF16_BF16_F32_X3"`` for an fp32 reference at a third of BF16's GEMM speed on a GPU
        (three BF16 passes, about 16 bits of mantissa, against ``"highest"``'s CUDA-core fp32).
      loss_chunk: ``0`` (the loss reads the whole logits) or positions per chunk of the
        chunked cross-entropy (:func:`loss_fn`; :mod:`coat_jax.ops.loss`): the step never holds
        more than ``batch x loss_chunk`` fp32 logits and their gradient. Same loss up to the
        order of fp32 sums.
      recompute_attention: backward recomputes each block's pre-norm, q/k/v projections, RoPE
        and attention from the block input instead of saving q, k, v (:mod:`coat_jax.models.nn`):
        the same gradients, 32% (CPU) to ~40% (GPU, cuDNN) less saved activations with COAT on
        Llama-2-7B, about a tenth more block FLOPs.
    """

    vocab_size: int = 32000
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    ffn_dim: int = 11008
    rope_theta: float = 10000.0
    rope_scaling: str = "none"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    norm_eps: float = 1e-5
    norm: str = "rms"
    clip_qkv: float | None = None
    tie_embeddings: bool = False
    precision: str = "coat"
    fp8: Fp8Recipe = Fp8Recipe()
    matmul_precision: str | None = None
    loss_chunk: int = 0
    recompute_attention: bool = False

    def __post_init__(self):
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "ffn_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}")
        kv = self.kv_heads
        if self.dim % self.n_heads or self.n_heads % kv or (self.dim // self.n_heads) % 2:
            raise ValueError(
                f"LlamaConfig: dim {self.dim}, n_heads {self.n_heads}, n_kv_heads {kv} need "
                "dim % n_heads == 0, n_heads % n_kv_heads == 0 and an even head dim"
            )
        if self.rope_scaling not in ("none", "linear", "llama3"):
            raise ValueError(
                f"LlamaConfig.rope_scaling={self.rope_scaling!r}: expected 'none', 'linear' "
                "or 'llama3'"
            )
        if self.norm not in plain.NORMS:
            raise ValueError(f"LlamaConfig.norm={self.norm!r}: expected one of {plain.NORMS}")
        c = self.clip_qkv
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or c <= 0):
            raise ValueError(f"LlamaConfig.clip_qkv must be None or a number > 0, got {c!r}")
        chunk = self.loss_chunk
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
            raise ValueError(f"LlamaConfig.loss_chunk must be an int >= 0, got {chunk!r}")
        if not isinstance(self.recompute_attention, bool):
            raise ValueError(
                f"LlamaConfig.recompute_attention must be a bool, got {self.recompute_attention!r}"
            )
        self.rope()  # raises on bad scaling factors
        get_policy(self.precision)  # raises on an unknown name
        if self.matmul_precision is not None:
            if self.precision not in ("fp32", "bf16"):
                raise ValueError(
                    f"LlamaConfig.matmul_precision applies to precision 'fp32' or 'bf16', not "
                    f"{self.precision!r} (its FP8 dots set their own)"
                )
            try:
                with jax.default_matmul_precision(self.matmul_precision):
                    pass
            except (ValueError, TypeError):
                raise ValueError(
                    f"LlamaConfig.matmul_precision={self.matmul_precision!r}: not a "
                    "jax.default_matmul_precision value ('highest', 'BF16_BF16_F32_X3', ...)"
                ) from None
        if not isinstance(self.fp8, Fp8Recipe):
            raise ValueError(f"LlamaConfig.fp8 must be an Fp8Recipe, got {self.fp8!r}")
        if self.precision == "coat":
            for name in ("dim", "ffn_dim"):
                if getattr(self, name) % self.fp8.saved_group:
                    raise ValueError(
                        f"LlamaConfig.{name}={getattr(self, name)} must be a multiple of "
                        f"{self.fp8.saved_group} (the FP8 group size) for precision='coat'"
                    )

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def policy(self):
        """The precision policy (:mod:`coat_jax.models.policy`) with this config's recipe and
        matmul precision."""
        policy = get_policy(self.precision, self.fp8)
        if self.matmul_precision is None:
            return policy
        return dataclasses.replace(policy, matmul_precision=self.matmul_precision)

    def rope(self) -> plain.RopeScaling | None:
        """The RoPE frequency scaling, ``None`` for plain RoPE."""
        if self.rope_scaling == "none":
            return None
        try:
            return plain.RopeScaling(
                self.rope_scaling,
                float(self.rope_factor),
                float(self.rope_low_freq_factor),
                float(self.rope_high_freq_factor),
                int(self.rope_original_max_len),
            )
        except ValueError as e:
            raise ValueError(f"LlamaConfig: {e}") from None

    @property
    def family(self) -> str:
        """``"OLMo"`` for the non-parametric layer norm (OLMo v1), else ``"Llama"``."""
        return "OLMo" if self.norm == "layer" else "Llama"

    def num_params(self) -> int:
        kv = self.kv_heads * self.head_dim
        norm = self.dim if self.norm == "rms" else 0  # the weightless LayerNorm has none
        block = self.dim * (2 * self.dim + 2 * kv) + 3 * self.dim * self.ffn_dim + 2 * norm
        head = 0 if self.tie_embeddings else self.dim * self.vocab_size
        return self.vocab_size * self.dim + self.n_layers * block + norm + head


PRESETS = {
    "tiny": LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176),
    "llama2_7b": LlamaConfig(),
    "llama2_13b": LlamaConfig(dim=5120, n_layers=40, n_heads=40, ffn_dim=13824),
    "llama3_8b": LlamaConfig(vocab_size=128256, n_kv_heads=8, ffn_dim=14336, rope_theta=500000.0),
    # OLMo v1 (arXiv 2402.00838), from allenai/OLMo configs/official/OLMo-{1B,7B}.yaml: 50280
    # tokens in 50304 embedding rows, context 2048, RoPE theta 10000, LayerNorm without weight
    # or bias (eps 1e-5), no clipping; SwiGLU width = their MLP hidden size / 2 (16384, 22016).
    # transformers' OlmoConfig defaults are the 7B's.
    "olmo_1b": LlamaConfig(
        vocab_size=50304,
        dim=2048,
        n_layers=16,
        n_heads=16,
        ffn_dim=8192,
        norm="layer",
        tie_embeddings=True,
    ),
    "olmo_7b": LlamaConfig(
        vocab_size=50304, dim=4096, n_layers=32, n_heads=32, ffn_dim=11008, norm="layer"
    ),
}


def make_block(config: LlamaConfig, policy, param_dtype, rngs: nnx.Rngs) -> Block:
    """One decoder block of ``config``'s model."""
    return Block(
        config.dim,
        config.n_heads,
        config.kv_heads,
        config.ffn_dim,
        policy=policy,
        rope_theta=config.rope_theta,
        rope_scaling=config.rope(),
        norm_eps=config.norm_eps,
        norm=config.norm,
        clip_qkv=config.clip_qkv,
        recompute_attention=config.recompute_attention,
        param_dtype=param_dtype,
        rngs=rngs,
    )


class Llama(nnx.Module):
    """Decoder-only Llama; ``model(tokens)`` returns fp32 logits ``(B, T, vocab)``."""

    def __init__(self, config: LlamaConfig, *, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = config
        policy = config.policy()
        self.embed = nnx.Param(
            jax.random.normal(rngs.params(), (config.vocab_size, config.dim), param_dtype) * 0.02,
            logical_axes=("vocab", "embed"),
        )
        self.blocks = nnx.List(
            [make_block(config, policy, param_dtype, rngs) for _ in range(config.n_layers)]
        )
        final_norm = None  # the weightless LayerNorm has no weight
        if config.norm == "rms":
            final_norm = nnx.Param(jnp.ones((config.dim,), param_dtype), logical_axes=("embed",))
        self.final_norm = nnx.data(final_norm)
        head = None
        if not config.tie_embeddings:
            w = jax.random.normal(rngs.params(), (config.dim, config.vocab_size), param_dtype)
            head = nnx.Param(w / jnp.sqrt(config.dim), logical_axes=("embed", "vocab"))
        self.lm_head = nnx.data(head)

    def __call__(self, tokens: jax.Array, compute_dtype=None) -> jax.Array:
        """fp32 logits of ``tokens (B, T)``; activations in ``compute_dtype`` (default: the
        policy's, BF16 but for ``precision="fp32"``)."""
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(
                f"Llama expects int tokens (batch, seq), got {tokens.dtype}{tokens.shape}"
            )
        policy = self.config.policy()
        with policy.precision_scope():
            return self._forward(tokens, compute_dtype or policy.compute_dtype)

    def _forward(self, tokens: jax.Array, compute_dtype) -> jax.Array:
        x = self._trunk(tokens, compute_dtype)
        return constrain(self._head(x, compute_dtype), ("batch", None, "vocab"))

    def _trunk(self, tokens: jax.Array, compute_dtype) -> jax.Array:
        """The last block's output ``(B, T, dim)`` of ``tokens``."""
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        hidden = ("batch", None, None)  # under a mesh: examples split, features whole
        # The table is gathered whole before the lookup, as FSDP gathers any weight before use
        # (XLA cannot partition a lookup into a table sharded along its features). The lookup
        # reads the table in fp32, also when the weights come in bf16 (``grad_dtype=bfloat16``),
        # so that its gradient sums repeated tokens in fp32: a bf16 scatter-add rounds every
        # repeat and, on a GPU, runs as compare-and-swap loops.
        table = constrain(self.embed[...].astype(jnp.float32), (None, None))
        x = constrain(table[tokens].astype(compute_dtype), hidden)
        for block in self.blocks:
            x = constrain(block(x, positions), hidden)
        return x

    def _final_norm(self, x: jax.Array) -> jax.Array:
        scale = None if self.final_norm is None else self.final_norm[...]
        return plain.norm(x, scale, self.config.norm_eps, self.config.norm)

    def _head_matrix(self) -> jax.Array:
        return self.embed[...].T if self.lm_head is None else self.lm_head[...]

    def _head(self, x: jax.Array, compute_dtype) -> jax.Array:
        """fp32 logits of the last block's output ``x``: the final norm, then the LM head."""
        head = self._head_matrix().astype(compute_dtype)
        return plain.head_logits(self._final_norm(x), head)

    def chunked_loss(
        self, inputs: jax.Array, targets: jax.Array, weights: jax.Array | None = None
    ) -> jax.Array:
        """Mean next-token cross-entropy of ``inputs (B, T)`` against ``targets (B, T)``
        (``weights``: a mask), with the logits computed ``config.loss_chunk`` positions at a
        time (:func:`coat_jax.ops.loss.chunked_cross_entropy`)."""
        chunk = self.config.loss_chunk
        if chunk <= 0:
            raise ValueError("Llama.chunked_loss needs config.loss_chunk > 0")
        policy = self.config.policy()
        compute_dtype = policy.compute_dtype
        with policy.precision_scope():
            x = self._final_norm(self._trunk(inputs, compute_dtype))
            head = self._head_matrix().astype(jnp.float32)  # its gradient sums chunks in fp32

            def logits(xc):
                out = plain.head_logits(xc, head.astype(compute_dtype))
                return constrain(out, ("batch", None, "vocab"))

            return chunked_cross_entropy(logits, x, targets, weights, chunk)

    def decode(self, tokens: jax.Array, cache: KVCache, compute_dtype=jnp.bfloat16):
        """Logits of ``tokens (B, T)`` placed in cache slots ``cache.length ..``, and the cache
        with their keys and values: ``(fp32 logits (B, T, vocab), cache)``. A prompt fills the
        cache in one call, then one token per call; with the ``bf16`` policy the logits equal
        :meth:`__call__`'s on the same (unpadded) sequence up to the compute dtype's rounding.
        The FP8 policies' per-tensor scales depend on each call's tokens, so their cached logits
        differ (generation runs ``bf16``: :mod:`coat_jax.training.generate`)."""
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(
                f"Llama.decode expects int tokens (batch, seq), got {tokens.dtype}{tokens.shape}"
            )
        x = self.embed[...].astype(compute_dtype)[tokens]
        ks, vs = [], []
        for block, k, v in zip(self.blocks, cache.k, cache.v, strict=True):
            x, k, v = block.decode(x, k, v, cache.length, cache.start)
            ks.append(k)
            vs.append(v)
        length = cache.length + tokens.shape[1]
        return self._head(x, compute_dtype), KVCache(tuple(ks), tuple(vs), length, cache.start)


class KVCache(NamedTuple):
    """Keys and values of every layer for generation (:meth:`Llama.decode`).

    Attributes:
      k, v: per layer, ``(batch, max_len, n_kv_heads, head_dim)``.
      length: int32 ``()``: slots filled, the same in every row (prompts are left-padded).
      start: int32 ``(batch,)``: each row's first real slot (its left padding); RoPE positions
        count from it, and no query sees a key before it.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    length: jax.Array
    start: jax.Array


def init_cache(config: LlamaConfig, batch: int, max_len: int, dtype=jnp.bfloat16, start=None):
    """An empty :class:`KVCache` of ``max_len`` slots; ``start`` (``(batch,)``, default 0) is
    each row's left padding."""
    shape = (batch, max_len, config.kv_heads, config.head_dim)
    zeros = tuple(jnp.zeros(shape, dtype) for _ in range(config.n_layers))
    start = jnp.zeros((batch,), jnp.int32) if start is None else jnp.asarray(start, jnp.int32)
    return KVCache(zeros, zeros, jnp.zeros((), jnp.int32), start)


def loss_fn(model: Llama, tokens: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Mean next-token cross-entropy (fp32) of ``tokens (B, T+1)``; ``mask (B, T)`` weights it.
    With ``model.config.loss_chunk`` the logits are never whole (:meth:`Llama.chunked_loss`)."""
    if model.config.loss_chunk:
        weights = None if mask is None else mask.astype(jnp.float32)
        return model.chunked_loss(tokens[:, :-1], tokens[:, 1:], weights)
    logits = model(tokens[:, :-1])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    if mask is None:
        return losses.mean()
    mask = mask.astype(jnp.float32)
    return (losses * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def _plain(tree):
    """Nested ``nnx.State`` as nested dicts (Variables kept), as ``nnx.split`` nests them."""
    if isinstance(tree, (nnx.State, dict)):
        return {k: _plain(v) for k, v in tree.items()}
    return tree


def init_params(
    config: LlamaConfig, seed: int, shardings=None, param_dtype=jnp.float32
) -> tuple[nnx.GraphDef, nnx.State]:
    """``nnx.split`` of a new :class:`Llama`, created piece by piece: one jitted init for the
    embedding, final norm and head, and one for a block, compiled once and run for every layer
    with its own key. With ``shardings`` (a tree like the state) each piece is computed directly
    in its shards. Compiling a whole-model init is slow on a GPU (hundreds of RNG kernels);
    this compiles a one-layer model and a block. Same distributions as
    ``Llama(config, rngs=nnx.Rngs(seed))``, not the same draws."""
    graph, abstract = nnx.split(nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0))))
    policy = config.policy()
    stem_config = dataclasses.replace(config, n_layers=1)  # its block is dropped

    def make_stem(key):
        model = Llama(stem_config, param_dtype=param_dtype, rngs=nnx.Rngs(key))
        return {k: _plain(v) for k, v in nnx.state(model).items() if k != "blocks"}

    make = lambda key: _plain(nnx.state(make_block(config, policy, param_dtype, nnx.Rngs(key))))
    stem_shardings = block_shardings = None
    if shardings is not None:
        stem_shardings = {k: _plain(v) for k, v in shardings.items() if k != "blocks"}
        block_shardings = _plain(shardings["blocks"][0])
    keys = jax.random.split(jax.random.key(seed), config.n_layers + 1)
    state = jax.jit(make_stem, out_shardings=stem_shardings)(keys[0])
    block = jax.jit(make, out_shardings=block_shardings)
    state["blocks"] = {i: block(keys[i + 1]) for i in range(config.n_layers)}
    params = nnx.State(state)
    if jax.tree.structure(params) != jax.tree.structure(abstract):
        raise AssertionError("init_params built a state unlike Llama's")  # a bug, not bad input
    return graph, params
