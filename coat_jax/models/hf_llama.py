"""Hugging Face Llama and OLMo folders in and out: ``config.json`` + ``*.safetensors``.

Import (:func:`read_config`, :func:`load_params`, :func:`load_model`) reads a local folder as
written by ``transformers``' ``LlamaForCausalLM.save_pretrained`` (Llama 2, Llama 3 with GQA,
RoPE scaling ``linear`` or ``llama3``, tied or untied embeddings) or by
``OlmoForCausalLM.save_pretrained`` (OLMo v1, ``model_type`` ``"olmo"``: a :class:`LlamaConfig`
with ``norm="layer"``, eps 1e-5 and its ``clip_qkv``). It checks ``config.json`` and every
tensor's name, shape and dtype from the safetensors headers before reading any weight,
then streams one tensor at a time: each device reads only its shard of the (memory-mapped)
file and receives it already cast and transposed, so host memory never holds more than one
tensor's shard beyond the model itself. Export (:func:`save_pretrained`) writes the folder
back, one safetensors shard (``max_shard_bytes``) at a time.

Weight mapping (HF ``nn.Linear`` weights are ``(out, in)``; ours are ``(in, out)``)::

    HF tensor                                            ours                          op
    model.embed_tokens.weight            (V, d)          embed              (V, d)      =
    model.layers.{i}.input_layernorm.weight              blocks[i].attention.norm      =
    model.layers.{i}.self_attn.q_proj.weight (H*hd, d)   blocks[i].attention.wq        .T
    model.layers.{i}.self_attn.k_proj.weight (Hkv*hd, d) blocks[i].attention.wk        .T
    model.layers.{i}.self_attn.v_proj.weight (Hkv*hd, d) blocks[i].attention.wv        .T
    model.layers.{i}.self_attn.o_proj.weight (d, H*hd)   blocks[i].attention.wo        .T
    model.layers.{i}.post_attention_layernorm.weight     blocks[i].mlp.norm            =
    model.layers.{i}.mlp.gate_proj.weight    (f, d)      blocks[i].mlp.w_gate          .T
    model.layers.{i}.mlp.up_proj.weight      (f, d)      blocks[i].mlp.w_up            .T
    model.layers.{i}.mlp.down_proj.weight    (d, f)      blocks[i].mlp.w_down          .T
    model.norm.weight                    (d,)            final_norm                    =
    lm_head.weight                       (V, d)          lm_head            (d, V)     .T
                                                         (absent when tied: embed.T)

OLMo's tensors have the same names, without the three norm weights: its LayerNorms have none.
OLMo 2 (``model_type`` ``"olmo2"``: RMSNorm after attention and MLP, QK-norm) is refused.

No q/k permutation is needed: :func:`coat_jax.ops.plain.rope` rotates the two halves of each head
(HF's ``rotate_half``), the layout HF's Llama checkpoints are stored in. HF's
``rotary_emb.inv_freq`` buffers in old checkpoints are ignored (recomputed from the config).

Errors (a missing file, an unsupported architecture or setting, a missing, unexpected or
misshapen tensor) are one-line ``FileNotFoundError`` / ``ValueError`` naming the file and key.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid

import jax
import jax.numpy as jnp
import ml_dtypes  # also registers numpy's 'bfloat16', which safetensors' numpy reader needs
import numpy as np
from flax import nnx

from coat_jax.models.llama import Llama, LlamaConfig

__all__ = [
    "TOKENIZER_FILES",
    "config_from_hf",
    "config_to_hf",
    "is_hf_folder",
    "load_model",
    "load_params",
    "read_config",
    "save_pretrained",
    "tensor_names",
]

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_DTYPES = ("BF16", "F16", "F32")  # read; cast to the param dtype
_DROPPED = ("rope_parameters", "rope_scaling", "transformers_version")  # rewritten or stale
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads")  # fmt: skip
# model_type -> (architecture, config.json keys of the other model types, dropped on export)
_MODELS = {
    "llama": ("LlamaForCausalLM", ("clip_qkv",)),
    "olmo": ("OlmoForCausalLM", ("rms_norm_eps", "mlp_bias")),
}
_REFUSED = {"olmo2": "OLMo 2's norms after attention and MLP and its QK-norm are not implemented"}
OLMO_NORM_EPS = 1e-5  # transformers' OlmoLayerNorm: fixed, not in config.json


def _safetensors():
    try:
        import safetensors
        import safetensors.numpy
    except ImportError as e:
        raise ImportError(
            "Hugging Face import/export needs the 'safetensors' package: pip install 'coat-jax[hf]'"
        ) from e
    return safetensors


def _unbox(x):
    return x.get_value() if isinstance(x, nnx.Variable) else x


def _open(file: str):
    """``safe_open(file)`` (numpy), with a header error naming the file."""
    try:
        return _safetensors().safe_open(file, framework="numpy")
    except Exception as e:  # safetensors raises its own SafetensorError / OSError
        raise ValueError(f"{file}: not a readable safetensors file ({e})") from None


def is_hf_folder(path: str) -> bool:
    """Whether ``path`` is a folder with a ``config.json`` (a Hugging Face model folder)."""
    return os.path.isfile(os.path.join(path, CONFIG))


# --------------------------------------------------------------------------------------------
# config.json <-> LlamaConfig


def read_config(path: str, precision: str = "coat") -> LlamaConfig:
    """The :class:`LlamaConfig` of the HF folder ``path`` (only ``config.json`` is read)."""
    file = os.path.join(path, CONFIG)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: not a folder (expected a Hugging Face model folder)")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{file}: not found (a Hugging Face model folder needs it)")
    try:
        with open(file) as f:
            hf = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{file}: expected a JSON object")
    return config_from_hf(hf, precision, file)


def _model_type(hf: dict, bad) -> str:
    """``"llama"`` or ``"olmo"``: from ``architectures``, or ``model_type`` when it is absent."""
    arch, model_type = hf.get("architectures"), hf.get("model_type")
    if model_type in _REFUSED:
        raise bad("model_type", f"{model_type!r} is not supported ({_REFUSED[model_type]})")
    if arch is None:
        if model_type not in _MODELS:
            raise bad("architectures", f"missing (and model_type {model_type!r} is not one of "
                      f"{list(_MODELS)})")  # fmt: skip
        return model_type
    for kind, (name, _) in _MODELS.items():
        if arch == [name]:
            return kind
    expected = " or ".join(repr([name]) for name, _ in _MODELS.values())
    raise bad("architectures", f"{arch!r} is not supported; expected {expected}")


def config_from_hf(hf: dict, precision: str = "coat", file: str = CONFIG) -> LlamaConfig:
    """:class:`LlamaConfig` from a parsed ``config.json``; ``file`` names it in errors."""
    bad = lambda key, msg: ValueError(f"{file}: {key}: {msg}")
    model_type = _model_type(hf, bad)
    for key in _REQUIRED:
        if key not in hf:
            raise bad(key, "missing")
        if isinstance(hf[key], bool) or not isinstance(hf[key], int) or hf[key] <= 0:
            raise bad(key, f"must be a positive int, got {hf[key]!r}")
    dim, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    n_kv = hf.get("num_key_value_heads") or n_heads
    checks = {
        "hidden_act": (hf.get("hidden_act", "silu"), "silu"),
        "attention_bias": (hf.get("attention_bias", False), False),
        "mlp_bias": (hf.get("mlp_bias", False), False),
    }
    for key, (value, expected) in checks.items():
        if value != expected:
            raise bad(key, f"{value!r} is not supported; expected {expected!r}")
    if dim % n_heads:
        raise bad("hidden_size", f"{dim} is not a multiple of num_attention_heads {n_heads}")
    head_dim = hf.get("head_dim") or dim // n_heads
    if head_dim != dim // n_heads:
        raise bad("head_dim", f"{head_dim} != hidden_size / num_attention_heads "
                  f"({dim // n_heads}); only that head size is supported")  # fmt: skip
    rope = _rope_from_hf(hf, bad)
    if model_type == "olmo":
        clip = hf.get("clip_qkv")
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float))
                                 or clip <= 0):  # fmt: skip
            raise bad("clip_qkv", f"must be null or a number > 0, got {clip!r}")
        norm = dict(norm="layer", norm_eps=OLMO_NORM_EPS, clip_qkv=clip)
    else:
        norm = dict(norm="rms", norm_eps=float(hf.get("rms_norm_eps", 1e-6)))
    try:
        return LlamaConfig(
            vocab_size=hf["vocab_size"],
            dim=dim,
            n_layers=hf["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=n_kv,
            ffn_dim=hf["intermediate_size"],
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            precision=precision,
            **norm,
            **rope,
        )
    except ValueError as e:
        raise ValueError(f"{file}: {e}") from None


def _rope_from_hf(hf: dict, bad) -> dict:
    """RoPE fields from ``rope_theta`` + ``rope_scaling`` (transformers 4) or
    ``rope_parameters`` (transformers 5); like transformers 5, ``rope_scaling`` wins if set."""
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = hf.get(key) or {}
    if not isinstance(params, dict):
        raise bad(key, f"expected an object, got {params!r}")
    new_style = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    theta = params.get("rope_theta", hf.get("rope_theta", new_style.get("rope_theta", 1e4)))
    kind = params.get("rope_type", params.get("type", "default"))
    fields = dict(rope_theta=float(theta))
    if kind == "default":
        return fields
    if kind not in ("linear", "llama3"):
        raise bad(f"{key}.rope_type", f"{kind!r} is not supported; expected default, linear "
                  "or llama3")  # fmt: skip
    if "factor" not in params:
        raise bad(f"{key}.factor", "missing")
    fields.update(rope_scaling=kind, rope_factor=float(params["factor"]))
    if kind == "llama3":
        llama3 = {
            "rope_low_freq_factor": ("low_freq_factor", float),
            "rope_high_freq_factor": ("high_freq_factor", float),
            "rope_original_max_len": ("original_max_position_embeddings", int),
        }
        for ours, (theirs, cast) in llama3.items():
            if theirs not in params:
                raise bad(f"{key}.{theirs}", "missing")
            fields[ours] = cast(params[theirs])
    return fields


def _hf_model_type(config: LlamaConfig) -> str:
    """The transformers model type of ``config``'s architecture: ``"olmo"`` for the weightless
    LayerNorm, else ``"llama"``."""
    return "olmo" if config.norm == "layer" else "llama"


def _check_exportable(config: LlamaConfig) -> None:
    """Raises ValueError if transformers' model of ``config`` cannot express a setting."""
    if config.norm == "layer" and config.norm_eps != OLMO_NORM_EPS:
        raise ValueError(f"LlamaConfig.norm_eps={config.norm_eps}: transformers' OLMo "
                         f"LayerNorm has eps {OLMO_NORM_EPS} (not configurable)")  # fmt: skip
    if config.norm == "rms" and config.clip_qkv is not None:
        raise ValueError(f"LlamaConfig.clip_qkv={config.clip_qkv}: transformers' Llama has no "
                         "clip_qkv (OLMo's has: norm='layer')")  # fmt: skip


def config_to_hf(config: LlamaConfig, base: dict | None = None, dtype: str = "bfloat16") -> dict:
    """A ``config.json`` for ``config`` (an ``OlmoForCausalLM``'s if ``config.norm`` is
    ``"layer"``, else a ``LlamaForCausalLM``'s); other keys of ``base`` (token ids, context
    length) are kept. RoPE is written as ``rope_theta`` + ``rope_scaling``, which
    transformers 4 and 5 both read.

    Raises:
      ValueError: ``config`` has a setting transformers' model cannot express.
    """
    _check_exportable(config)
    model_type = _hf_model_type(config)
    arch, foreign = _MODELS[model_type]
    hf = {k: v for k, v in (base or {}).items() if k not in _DROPPED + foreign}
    hf.update(
        architectures=[arch],
        model_type=model_type,
        vocab_size=config.vocab_size,
        hidden_size=config.dim,
        intermediate_size=config.ffn_dim,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.kv_heads,
        head_dim=config.head_dim,
        hidden_act="silu",
        rope_theta=config.rope_theta,
        rope_scaling=None,
        tie_word_embeddings=config.tie_embeddings,
        attention_bias=False,
        torch_dtype=dtype,  # transformers 4's name
        dtype=dtype,  # transformers 5's
    )
    if model_type == "olmo":
        hf.update(clip_qkv=config.clip_qkv)
    else:
        hf.update(rms_norm_eps=config.norm_eps, mlp_bias=False)
    hf.setdefault("max_position_embeddings", 4096)
    if config.rope_scaling != "none":
        hf["rope_scaling"] = dict(rope_type=config.rope_scaling, factor=config.rope_factor)
    if config.rope_scaling == "llama3":
        hf["rope_scaling"].update(
            low_freq_factor=config.rope_low_freq_factor,
            high_freq_factor=config.rope_high_freq_factor,
            original_max_position_embeddings=config.rope_original_max_len,
        )
    return hf


# --------------------------------------------------------------------------------------------
# The weight mapping and the safetensors headers


def tensor_names(config: LlamaConfig) -> dict[tuple, tuple[str, tuple[int, ...], bool]]:
    """Our param path -> ``(HF tensor name, HF shape, transposed)`` (module docstring)."""
    d, f, v, kv = config.dim, config.ffn_dim, config.vocab_size, config.kv_heads * config.head_dim
    names = {("embed",): ("model.embed_tokens.weight", (v, d), False)}
    if config.norm == "rms":
        names[("final_norm",)] = ("model.norm.weight", (d,), False)
    if not config.tie_embeddings:
        names[("lm_head",)] = ("lm_head.weight", (v, d), True)
    for i in range(config.n_layers):
        hf, ours = f"model.layers.{i}.", ("blocks", i)
        names.update({
            (*ours, "attention", "wq"): (hf + "self_attn.q_proj.weight", (d, d), True),
            (*ours, "attention", "wk"): (hf + "self_attn.k_proj.weight", (kv, d), True),
            (*ours, "attention", "wv"): (hf + "self_attn.v_proj.weight", (kv, d), True),
            (*ours, "attention", "wo"): (hf + "self_attn.o_proj.weight", (d, d), True),
            (*ours, "mlp", "w_gate"): (hf + "mlp.gate_proj.weight", (f, d), True),
            (*ours, "mlp", "w_up"): (hf + "mlp.up_proj.weight", (f, d), True),
            (*ours, "mlp", "w_down"): (hf + "mlp.down_proj.weight", (d, f), True),
        })  # fmt: skip
        if config.norm == "rms":
            names.update({
                (*ours, "attention", "norm"): (hf + "input_layernorm.weight", (d,), False),
                (*ours, "mlp", "norm"): (hf + "post_attention_layernorm.weight", (d,), False),
            })  # fmt: skip
    return names


def _ignored(name: str, config: LlamaConfig) -> bool:
    return name.endswith("rotary_emb.inv_freq") or (
        config.tie_embeddings and name == "lm_head.weight"
    )


def _tensor_files(path: str) -> tuple[str, dict[str, str]]:
    """``(listing file, {tensor name: shard file})`` from the index json or the single file."""
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: weight_map: unreadable ({e!r})") from None
        files = {name: os.path.join(path, file) for name, file in weight_map.items()}
        for name, file in files.items():
            if not os.path.isfile(file):
                raise FileNotFoundError(f"{index}: weight_map.{name}: {file} not found")
        return index, files
    single = os.path.join(path, SINGLE)
    if not os.path.isfile(single):
        raise FileNotFoundError(f"{path}: neither {SINGLE} nor {INDEX} found")
    with _open(single) as f:
        return single, dict.fromkeys(f.keys(), single)


def _check_tensors(path: str, config: LlamaConfig) -> dict[str, str]:
    """Every tensor's name, shape and dtype against ``config`` (headers only); name -> file."""
    listing, files = _tensor_files(path)
    expected = {name: shape for name, shape, _ in tensor_names(config).values()}
    for name in files:
        if name not in expected and not _ignored(name, config):
            arch = _MODELS[_hf_model_type(config)][0]
            raise ValueError(f"{listing}: {name}: unexpected tensor for a {arch} with {CONFIG} "
                             "as given")  # fmt: skip
    for name in expected:
        if name not in files:
            raise ValueError(f"{listing}: {name}: missing tensor")
    by_file: dict[str, list[str]] = {}
    for name in expected:
        by_file.setdefault(files[name], []).append(name)
    for file, names in by_file.items():
        with _open(file) as f:
            keys = set(f.keys())
            for name in names:
                if name not in keys:
                    raise ValueError(f"{file}: {name}: missing tensor (listed in {listing})")
                header = f.get_slice(name)
                shape, dtype = tuple(header.get_shape()), header.get_dtype()
                if shape != expected[name]:
                    raise ValueError(f"{file}: {name}: shape {shape}, but {CONFIG} implies "
                                     f"{expected[name]}")  # fmt: skip
                if dtype not in _DTYPES:
                    raise ValueError(f"{file}: {name}: dtype {dtype} is not supported "
                                     f"(expected one of {_DTYPES})")  # fmt: skip
    return files


# --------------------------------------------------------------------------------------------
# Import


def load_params(
    path: str,
    config: LlamaConfig | None = None,
    *,
    param_dtype=jnp.float32,
    shardings=None,
) -> tuple[LlamaConfig, nnx.GraphDef, nnx.State]:
    """Reads the HF folder ``path`` into ``(config, graph, params)`` of :class:`Llama`.

    Args:
      path: the folder (``config.json`` and ``model.safetensors`` or sharded with
        ``model.safetensors.index.json``).
      config: the model config; ``None`` reads it from ``config.json`` (:func:`read_config`).
        Its shapes must match the folder's tensors.
      param_dtype: dtype of the params (fp32 master weights by default).
      shardings: ``None`` (the default device) or a tree like the params with a
        ``jax.sharding.Sharding`` per param (e.g. :func:`coat_jax.ops.sharding.shardings` of
        :func:`coat_jax.ops.sharding.param_specs`); each device then reads only its shard.

    Raises:
      FileNotFoundError, ValueError: naming the file and key, before any tensor is read.
    """
    config = read_config(path) if config is None else config
    files = _check_tensors(path, config)
    graph, abstract = nnx.split(
        nnx.eval_shape(lambda: Llama(config, param_dtype=param_dtype, rngs=nnx.Rngs(0)))
    )
    names = tensor_names(config)
    flat_shardings = {}
    if shardings is not None:
        flat_shardings = {p: _unbox(s) for p, s in nnx.to_flat_state(shardings)}
        paths = set(nnx.to_flat_state(abstract).paths)
        if set(flat_shardings) != paths:
            odd = sorted(map(str, set(flat_shardings) ^ paths))[:3]
            raise ValueError(f"load_params: shardings do not match the params at {odd}")
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    leaves = []
    for p, var in nnx.to_flat_state(abstract):
        name, _, transposed = names[p]
        with _open(files[name]) as f:
            value = _place(f.get_slice(name), transposed, var.get_value(),
                           flat_shardings.get(p, default))  # fmt: skip
        leaves.append((p, var.replace(value)))
    return config, graph, nnx.from_flat_state(leaves)


def _place(tensor, transposed: bool, like: jax.ShapeDtypeStruct, sharding) -> jax.Array:
    """The array ``like`` with ``sharding``, each device's block read from the safetensors
    ``tensor`` slice (transposed from HF's layout if asked) and cast to ``like.dtype``."""

    def read(index):
        block = tensor[index[::-1] if transposed else index]
        return np.ascontiguousarray(block.T if transposed else block).astype(like.dtype)

    return jax.make_array_from_callback(like.shape, sharding, read)


def load_model(path: str, precision: str = "coat", *, param_dtype=jnp.float32) -> Llama:
    """The :class:`Llama` of the HF folder ``path``, on the default device."""
    config = read_config(path, precision)
    _, graph, params = load_params(path, config, param_dtype=param_dtype)
    return nnx.merge(graph, params)


# --------------------------------------------------------------------------------------------
# Export


def save_pretrained(
    params,
    config: LlamaConfig,
    out: str,
    *,
    dtype: str = "bfloat16",
    base_config: dict | None = None,
    tokenizer_from: str | None = None,
    tokenizer_files: dict[str, dict] | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> list[str]:
    """Writes ``params`` (a :class:`Llama`'s param state, or the model) as an HF folder.

    Args:
      params: ``nnx.State`` of the params, or a :class:`Llama`.
      config: their :class:`LlamaConfig`.
      out: the folder. Everything is written into a temporary folder beside it first and moved
        in once complete (a failed write leaves ``out`` as it was); files already in ``out``
        of the same names are replaced, earlier ``model*.safetensors`` and index files removed.
      dtype: ``"bfloat16"``, ``"float16"`` or ``"float32"`` for the written tensors.
      base_config: a ``config.json`` (dict) whose other keys are kept (:func:`config_to_hf`).
      tokenizer_from: a folder whose tokenizer files (``TOKENIZER_FILES``) are copied.
      tokenizer_files: JSON files to write (name -> object): tokenizer files instead of
        ``tokenizer_from``'s, e.g. :meth:`coat_jax.training.data.ByteTokenizer.hf_files`, or a
        ``generation_config.json``.
      max_shard_bytes: above this, tensors go to ``model-0000i-of-0000n.safetensors`` files
        listed in ``model.safetensors.index.json``; one shard is in host memory at a time.

    Returns:
      The files written.
    """
    st = _safetensors()
    np_dtype = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}
    if dtype not in np_dtype:
        raise ValueError(f"save_pretrained: dtype={dtype!r}: expected one of {list(np_dtype)}")
    hf_config = config_to_hf(config, base_config, dtype)  # raises before anything is written
    if isinstance(params, nnx.Module):
        params = nnx.state(params, nnx.Param)
    flat = {p: _unbox(v) for p, v in nnx.to_flat_state(params)}
    names = tensor_names(config)
    if set(flat) != set(names):
        missing = sorted(map(str, set(names) ^ set(flat)))
        raise ValueError(f"save_pretrained: params do not match the config at {missing[:3]}")
    # Plan the shards from the shapes, so every file gets its final name when written.
    itemsize = np.dtype(np_dtype[dtype]).itemsize
    plan: list[list[tuple]] = [[]]
    size = 0
    for p, (_, shape, _) in names.items():
        nbytes = int(np.prod(shape)) * itemsize
        if plan[-1] and size + nbytes > max_shard_bytes:
            plan.append([])
            size = 0
        plan[-1].append(p)
        size += nbytes
    parent, name = os.path.split(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    staging = os.path.join(parent, f".{name}.partial-{uuid.uuid4().hex[:12]}")
    os.mkdir(staging)  # beside out (one file system: the moves are renames), with the umask's mode
    try:
        files = _write_folder(staging, plan, names, flat, np_dtype[dtype], hf_config, st)
        if tokenizer_from:
            for file in TOKENIZER_FILES:
                src = os.path.join(tokenizer_from, file)
                if os.path.isfile(src):
                    shutil.copyfile(src, os.path.join(staging, file))
                    files.append(file)
        for file, content in (tokenizer_files or {}).items():
            with open(os.path.join(staging, file), "w") as f:
                json.dump(content, f, indent=2, ensure_ascii=False)
            files.append(file)
        _move_in(staging, out, files)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return files


def _write_folder(folder, plan, names, flat, np_dtype, hf_config, st) -> list[str]:
    """Writes the planned shards (one in host memory at a time), the index and ``config.json``
    into ``folder``; returns the file names."""
    n = len(plan)
    itemsize = np.dtype(np_dtype).itemsize
    files, weight_map = [], {}
    for i, paths in enumerate(plan, 1):
        file = SINGLE if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
        tensors = {}
        for p in paths:
            name, _, transposed = names[p]
            x = np.asarray(jax.device_get(flat[p]))
            tensors[name] = np.ascontiguousarray(x.T if transposed else x).astype(np_dtype)
        st.numpy.save_file(tensors, os.path.join(folder, file), {"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        files.append(file)
    if n > 1:
        total = sum(int(np.prod(names[p][1])) * itemsize for p in names)
        with open(os.path.join(folder, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        files.append(INDEX)
    with open(os.path.join(folder, CONFIG), "w") as f:
        json.dump(hf_config, f, indent=2)
    files.append(CONFIG)
    return files


def _move_in(staging: str, out: str, files: list[str]) -> None:
    """Puts the complete folder ``staging`` at ``out``: a rename when ``out`` does not exist;
    else each file replaces its namesake (one rename each), and only then are the earlier
    weight files the new ones do not replace removed, so ``out`` always holds one whole set."""
    if not os.path.exists(out):
        os.rename(staging, out)
        return
    for file in files:
        os.replace(os.path.join(staging, file), os.path.join(out, file))
    for file in os.listdir(out):
        stale = file.startswith("model") and file.endswith((".safetensors", INDEX))
        if stale and file not in files:
            os.remove(os.path.join(out, file))
