"""Text generation from a Llama with a KV cache: greedy or sampled, batched, streamed.

:func:`generate` left-pads prompts of different lengths into one batch, fills the cache with
all of them in one jitted call (the prefill, which also samples each row's first new token),
then runs one jitted step per new token (:meth:`coat_jax.models.llama.Llama.decode` of the last
token, then sampling). The steps are called from a Python loop rather than a
``lax.while_loop``: each token reaches the host as it is made, so a caller can stream it (a
callback), and rows stop at their EOS on the host. The host never waits for a step it could
overlap: step ``i + 1`` is dispatched before token ``i`` is read, so the device computes while
the host prints (at most one step runs past the batch's end). Both programs are compiled ahead
of the first token, so :class:`Generated`'s timings hold no compilation.

Generation runs the ``"bf16"`` precision policy only: the FP8 policies' per-tensor scales
depend on the tokens of each call, so cached one-token steps would not compute what the full
forward computes. :func:`inference_graph` gives any trained params a ``"bf16"`` model.

:func:`read_source` opens a coat-jax run (its workdir) or a Hugging Face folder through the
same reader fine-tuning's ``init_from`` uses (:mod:`coat_jax.training.finetune`): model config,
tokenizer, EOS ids and context length, checked before any weight is read;
:meth:`Source.load` then reads the weights (a run's latest checkpoint's params only).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from coat_jax.models import hf_llama
from coat_jax.models.llama import Llama, LlamaConfig, init_cache
from coat_jax.ops.sharding import constrain
from coat_jax.training import configs, data, finetune

__all__ = [
    "Generated",
    "Sampling",
    "Source",
    "check_lengths",
    "check_seed",
    "eval_sampler",
    "generate",
    "inference_graph",
    "read_source",
    "sample_logits",
]


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is picked from the logits.

    Attributes:
      temperature: 0 picks the most likely token (greedy; ``top_k`` and ``top_p`` then change
        nothing); above 0 the logits are divided by it and a token is drawn.
      top_k: draw only among the ``top_k`` most likely tokens (0: all).
      top_p: draw only among the most likely tokens whose probabilities sum to ``top_p``
        (nucleus sampling; the most likely token is always kept; 1: all).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        t, k, p = self.temperature, self.top_k, self.top_p
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < float("inf"):
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {t!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {k!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {p!r}")


def sample_logits(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """The next token of each row: ``logits (B, V)`` (fp32) -> int32 ``(B,)``.

    With ``temperature > 0``: logits / temperature, then top-k, then top-p keep the candidates
    (the others get ``-inf``), and one token per row is drawn with ``key``.
    """
    if sampling.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    # max first, so a tiny temperature cannot overflow every logit to inf (or, below fp32's
    # smallest normal, divide by 0): the largest stays 0 and the others go to -inf
    logits = logits.astype(jnp.float32)
    divisor = max(sampling.temperature, float(np.finfo(np.float32).tiny))
    logits = (logits - logits.max(axis=-1, keepdims=True)) / divisor
    if sampling.top_k and sampling.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampling.top_p < 1:
        ranked = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(ranked, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # the mass of the tokens ranked above
        cutoff = jnp.min(jnp.where(before < sampling.top_p, ranked, jnp.inf), -1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def inference_graph(config: LlamaConfig) -> nnx.GraphDef:
    """The ``nnx.GraphDef`` of a ``"bf16"``-policy :class:`Llama` of ``config``'s shape: with
    ``nnx.merge(graph, params)``, a model to generate from with params trained under any
    policy (the policies share one parameter tree)."""
    config = dataclasses.replace(config, precision="bf16")
    return nnx.graphdef(nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0))))


@dataclasses.dataclass(frozen=True)
class Generated:
    """What :func:`generate` made.

    Attributes:
      tokens: the new token ids of each prompt, in order; a row that stopped at an EOS id ends
        with it.
      prompt_tokens: the prompts' tokens, summed.
      compile_s: seconds compiling the prefill and the step (0 when cached).
      prefill_s: seconds from the prefill's start to the first tokens on the host.
      decode_s: seconds from there to the last token on the host.
    """

    tokens: list[list[int]]
    prompt_tokens: int
    compile_s: float
    prefill_s: float
    decode_s: float

    @property
    def new_tokens(self) -> int:
        return sum(len(row) for row in self.tokens)

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of generation (prefill and steps; compilation excluded)."""
        return self.new_tokens / max(self.prefill_s + self.decode_s, 1e-9)


def check_seed(seed) -> None:
    """Raises ValueError (one line) unless ``seed`` is an int that ``jax.random.key`` takes
    (64 bits, signed)."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an int, got {seed!r}")
    if not -(2**63) <= int(seed) < 2**63:
        raise ValueError(f"seed must fit 64 bits (signed), got {seed}")


def check_lengths(prompts: Sequence[Sequence[int]], max_new_tokens: int, max_len=None) -> None:
    """Raises ValueError (one line, naming the lengths) unless every prompt holds at least one
    token and the longest prompt plus ``max_new_tokens`` fits ``max_len`` cache slots."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if not prompts:
        raise ValueError("no prompts")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} has no tokens")
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    n = len(prompts[longest])
    if max_len is not None and n > max_len:
        raise ValueError(
            f"prompt {longest} has {n} tokens, more than the model's context of {max_len}"
        )
    if max_len is not None and n + max_new_tokens > max_len:
        raise ValueError(
            f"prompt {longest} has {n} tokens + max_new_tokens {max_new_tokens} = "
            f"{n + max_new_tokens}, more than the model's context of {max_len}"
        )


@functools.partial(jax.jit, static_argnames=("graph", "slots", "compute_dtype", "sampling"))
def _prefill(params, tokens, start, key, *, graph, slots, compute_dtype, sampling):
    """The prompts ``tokens (B, P)`` (left-padded; ``start``: each row's padding) into a new
    cache of ``slots``; returns each row's first new token and the cache."""
    model = nnx.merge(graph, params)
    cache = init_cache(model.config, tokens.shape[0], slots, compute_dtype, start)
    logits, cache = model.decode(tokens, cache, compute_dtype)
    token = sample_logits(logits[:, -1], jax.random.fold_in(key, 0), sampling)
    return constrain(token, (None,)), cache


@functools.partial(
    jax.jit, static_argnames=("graph", "compute_dtype", "sampling"), donate_argnames=("cache",)
)
def _step(params, cache, token, key, index, *, graph, compute_dtype, sampling):
    """Token ``index`` of each row, from the one before it (``token (B,)``) and the cache."""
    model = nnx.merge(graph, params)
    logits, cache = model.decode(token[:, None], cache, compute_dtype)
    token = sample_logits(logits[:, 0], jax.random.fold_in(key, index), sampling)
    return constrain(token, (None,)), cache


def generate(
    model: Llama,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_id: int | Sequence[int] | None = None,
    seed: int = 0,
    max_len: int | None = None,
    compute_dtype=jnp.bfloat16,
    on_token: Callable[[int, int], Any] | None = None,
) -> Generated:
    """New tokens for each prompt, from ``model`` (``"bf16"`` policy: :func:`inference_graph`).

    Args:
      model: the Llama.
      prompts: token ids of each prompt (lists of ints; lengths may differ).
      max_new_tokens: the most new tokens per prompt.
      temperature, top_k, top_p: how tokens are picked (:class:`Sampling`; default greedy).
      eos_id: an id or ids that end a row (included in its tokens); the batch stops when every
        row has ended.
      seed: the draws are a function of the seed, the prompts and the sampling settings.
      max_len: the model's context: the longest prompt plus ``max_new_tokens`` must fit (the
        cache holds that many slots); ``None``: no limit.
      compute_dtype: of activations and the cache (fp32 logits either way).
      on_token: called as ``on_token(row, token_id)`` for every new token as it reaches the host.

    Returns:
      :class:`Generated`: the tokens and the seconds spent.

    Raises:
      ValueError: bad settings, an empty prompt, a prompt that does not fit ``max_len``, an id
        outside the vocabulary, or a model of another precision (one line each, before
        anything compiles).
    """
    sampling = Sampling(temperature, top_k, top_p)
    config = model.config
    if config.precision != "bf16":
        raise ValueError(
            f"generate needs a precision='bf16' model, got {config.precision!r}: the FP8 "
            "policies' scales depend on each call's tokens (see inference_graph)"
        )
    check_lengths(prompts, max_new_tokens, max_len)
    check_seed(seed)
    for i, prompt in enumerate(prompts):
        bad = [t for t in prompt if not 0 <= int(t) < config.vocab_size]
        if bad:
            raise ValueError(f"prompt {i}: token id {bad[0]} outside the vocabulary "
                             f"[0, {config.vocab_size})")  # fmt: skip
    eos = {eos_id} if isinstance(eos_id, (int, np.integer)) else set(eos_id or ())
    width = max(len(p) for p in prompts)
    tokens = np.zeros((len(prompts), width), np.int32)
    for i, prompt in enumerate(prompts):
        tokens[i, width - len(prompt) :] = prompt
    start = np.asarray([width - len(p) for p in prompts], np.int32)
    graph, params = nnx.split(model)
    key = jax.random.key(seed)
    static = dict(graph=graph, compute_dtype=compute_dtype, sampling=sampling)

    began = time.perf_counter()
    prefill = _prefill.lower(params, tokens, start, key, slots=width + max_new_tokens, **static)
    prefill = prefill.compile()
    first, cache = prefill.out_info
    step = _step.lower(params, cache, first, key, jnp.int32(1), **static).compile()
    compile_s = time.perf_counter() - began

    began = time.perf_counter()
    pending, cache = prefill(params, tokens, start, key)
    out, done = [[] for _ in prompts], [False] * len(prompts)
    prefill_s = None
    for index in range(1, max_new_tokens + 1):
        following = None
        if index < max_new_tokens:  # dispatched before this token is read: the device runs on
            following, cache = step(params, cache, pending, key, jnp.int32(index))
        host = np.asarray(pending)
        if prefill_s is None:
            prefill_s = time.perf_counter() - began
        for row, token in enumerate(host.tolist()):
            if not done[row]:
                out[row].append(token)
                done[row] = token in eos
                if on_token is not None:
                    on_token(row, token)
        if all(done):
            break
        pending = following
    decode_s = time.perf_counter() - began - prefill_s
    prompt_tokens = sum(len(p) for p in prompts)
    return Generated(out, prompt_tokens, compile_s, prefill_s, decode_s)


# --------------------------------------------------------------------------------------------
# Reading a model to generate from


@dataclasses.dataclass(frozen=True)
class Source:
    """A model folder opened for generation, its weights not yet read (:func:`read_source`).

    Attributes:
      path: the folder.
      kind: ``"run"`` (a coat-jax workdir) or ``"hf"`` (a Hugging Face folder).
      config: a training config whose ``init_from`` is ``path`` (what
        :mod:`coat_jax.training.finetune` reads the weights with).
      model: the model config (``"bf16"`` precision).
      tokenizer: the model's tokenizer (:mod:`coat_jax.training.data`); ``None`` for a
        Hugging Face folder without ``tokenizer.json`` (token ids only).
      eos_ids: the ids that end a text (empty: none, as for the bytes tokenizer).
      max_len: the context: a run's ``seq_len``, a Hugging Face ``max_position_embeddings``.
    """

    path: str
    kind: str
    config: ml_collections.ConfigDict
    model: LlamaConfig
    tokenizer: Any
    eos_ids: tuple[int, ...]
    max_len: int

    def load(self, dtype=jnp.bfloat16) -> Llama:
        """The model with its weights (a run: its latest checkpoint's params) in ``dtype``."""
        abstract = nnx.eval_shape(lambda: Llama(self.model, param_dtype=dtype, rngs=nnx.Rngs(0)))
        graph, params_like = nnx.split(abstract)
        return nnx.merge(graph, finetune.initial_params(self.config, params_like))


def _json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            loaded = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    return loaded if isinstance(loaded, dict) else {}


def _folder_eos_ids(folder: str, hf: dict) -> tuple[int, ...]:
    """A Hugging Face folder's EOS ids: its ``generation_config.json`` ``eos_token_id``, else
    that of its ``config.json`` (``hf``, read by the caller)."""
    generation = _json(os.path.join(folder, "generation_config.json"))
    return _ids(generation.get("eos_token_id", hf.get("eos_token_id")))


def _ids(value) -> tuple[int, ...]:
    """An ``eos_token_id`` entry (an int, a list of ints or None) as a tuple."""
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, list) else [value]))


def read_source(path: str, max_len: int | None = None) -> Source:
    """Opens ``path`` (a coat-jax run's workdir or its ``checkpoints`` folder, or a Hugging
    Face folder) for generation: JSON files and the tokenizer only.

    EOS ids: a Hugging Face folder's ``generation_config.json`` or ``config.json``
    ``eos_token_id``, else the tokenizer's. ``max_len`` overrides the context.

    Raises:
      FileNotFoundError, ValueError: one line, naming the folder or file: not a model folder,
        an unreadable config, a tokenizer with more ids than the embedding has rows, a
        ``max_len`` that is not a positive int. (A run without a checkpoint fails in
        :meth:`Source.load`.)
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no such folder")
    c = configs.base_config()
    c.init_from, c.precision = path, "bf16"
    try:
        finetune.resolve_init_from(c, tokenizer_required=False)  # ids only: see below
    except (FileNotFoundError, ValueError) as e:
        message = str(e).replace(f"config.init_from={path!r}: ", f"{path}: ")
        kind = FileNotFoundError if isinstance(e, FileNotFoundError) else ValueError
        raise kind(message) from None  # (JSONDecodeError & co. take more than a message)
    model = configs.llama_config(c)
    workdir = finetune.run_dirs(path)[0]  # a run's workdir, also when given its checkpoints
    tokenizer = data.load_tokenizer(c.data.tokenizer)
    if os.path.isdir(os.path.join(workdir, "checkpoints")):  # as finetune tells them apart
        kind, eos = "run", ()
        context = finetune.read_run_config(workdir).get("seq_len")
        base = finetune.base_folder(path)  # the Hugging Face folder its chain of runs began with
        if base and hf_llama.is_hf_folder(base):  # its EOS ids, as the run's export keeps them
            eos = _folder_eos_ids(base, _json(os.path.join(base, "config.json")))
    else:
        kind = "hf"
        if not os.path.isfile(os.path.join(path, "tokenizer.json")):
            tokenizer = None  # not the bytes fallback of fine-tuning: ids only
        hf = _json(os.path.join(path, "config.json"))
        context = hf.get("max_position_embeddings", 2048)
        eos = _folder_eos_ids(path, hf)
    if tokenizer is not None and tokenizer.vocab_size > model.vocab_size:
        raise ValueError(
            f"{path}: the tokenizer ({c.data.tokenizer}) has {tokenizer.vocab_size} ids, the "
            f"model's embedding only {model.vocab_size} rows"
        )
    if not eos and tokenizer is not None and tokenizer.eos_id is not None:
        eos = (tokenizer.eos_id,)
    context = context if max_len is None else max_len
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ValueError(f"{path}: the context length (max_len) must be a positive int, "
                         f"got {context!r}")  # fmt: skip
    return Source(path, kind, c, model, tokenizer, eos, context)


# --------------------------------------------------------------------------------------------
# Samples during training


def eval_sampler(run) -> Callable[[nnx.State, int], list[str]] | None:
    """What ``train.py`` prints at each eval when ``config.eval_samples`` is set:
    ``sample(params, step)`` -> ``eval_samples`` texts, each ``config.sample_prompt``
    continued by ``config.sample_tokens`` tokens drawn at ``config.sample_temperature``
    (seeded by ``config.seed`` and the step). ``None`` when ``eval_samples`` is 0.

    Raises:
      ValueError: the prompt and its tokens do not fit ``config.seq_len`` (checked here,
        before training).
    """
    c = run.config
    if not c.eval_samples:
        return None
    prompt = [int(t) for t in run.tokenizer.encode(c.sample_prompt)]
    try:
        check_lengths([prompt], c.sample_tokens, c.seq_len)
    except ValueError as e:
        raise ValueError(f"config.sample_prompt / sample_tokens: {e} (config.seq_len)") from None
    eos = () if run.tokenizer.eos_id is None else (run.tokenizer.eos_id,)
    graph = inference_graph(run.model)

    def sample(params, step: int) -> list[str]:
        made = generate(
            nnx.merge(graph, params),
            [prompt] * c.eval_samples,
            max_new_tokens=c.sample_tokens,
            temperature=c.sample_temperature,
            eos_id=eos,
            seed=c.seed + step,
            max_len=c.seq_len,
        )
        return [run.tokenizer.decode(prompt + row) for row in made.tokens]

    return sample
