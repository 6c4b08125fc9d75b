"""Training configuration: the one place for defaults, and its validation.

Config files under ``configs/`` call :func:`base_config` and change what differs; ``train.py``
loads them with ``ml_collections`` (``--config configs/llama.py --config.steps=100``). The
returned ConfigDict is locked: a misspelt key fails at the command line, naming the key;
:func:`validate` rejects bad values, naming the key, before anything is built.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import os

import ml_collections

from coat_jax.core.formats import get_format
from coat_jax.core.recipe import Fp8Recipe
from coat_jax.models.llama import PRESETS, LlamaConfig
from coat_jax.models.policy import POLICIES
from pallas_kernels.dispatch import KERNEL_OPTIONS, hopper_gpu

__all__ = [
    "apply_overrides",
    "base_config",
    "describe",
    "resume_changes",
    "fp8_recipe",
    "resolve_grad_dtype",
    "llama_config",
    "load_file",
    "model_fields",
    "parse_overrides",
    "pretraining_config",
    "validate",
]

OPTIMIZERS = ("fp8_adamw", "adamw")
MASTER_WEIGHTS = {"fp32": None, "bf16+16": 16, "bf16+8": 8}
"""``config.optimizer.master_weights`` -> remainder bits (``None``: fp32 parameters)."""
DATA_FORMATS = ("text", "prompt_response")
GRAD_DTYPES = ("auto", "float32", "bfloat16")


def resolve_grad_dtype(config: ml_collections.ConfigDict, fused_update: bool) -> str:
    """``config.grad_dtype`` with ``auto`` decided: ``bfloat16`` with BF16 master weights (their
    gradients are BF16) or where the fused FP8 AdamW update runs on one micro-batch a step (it
    reads them as they are: the gradient buffer halves), ``float32`` elsewhere (the optax chain
    and the micro-batch sum work in fp32 anyway).

    The evidence for bf16 (docs/history.md, 2026-12-01): 114M Llama, 2000 steps, two seeds,
    COAT + ``fp8_adamw`` final losses within 0.3% of fp32 gradients' (train -0.22%, eval
    -0.28% on average); Llama-2-7B on an H200: peak at batch 1 56.4 GB instead of 68.4, the
    same tokens/s at batch 1 and 12.
    """
    if config.grad_dtype != "auto":
        return config.grad_dtype
    bf16_master = config.optimizer.master_weights != "fp32"
    return "bfloat16" if bf16_master or (fused_update and config.grad_accum == 1) else "float32"


def model_fields(preset: str) -> ml_collections.ConfigDict:
    """The :class:`LlamaConfig` fields of a preset (``PRESETS``), minus ``precision`` and
    ``fp8`` (``config.precision`` and ``config.fp8``)."""
    fields = dataclasses.asdict(PRESETS[preset])
    fields.pop("precision")
    fields.pop("fp8")
    fields["n_kv_heads"] = fields["n_kv_heads"] or fields["n_heads"]
    # None-valued fields a command line may set need a typed placeholder
    for name, kind in (("matmul_precision", str), ("clip_qkv", float)):
        if fields[name] is None:
            fields[name] = ml_collections.config_dict.placeholder(kind)
    return ml_collections.ConfigDict(fields)


def base_config() -> ml_collections.ConfigDict:
    """All keys with their defaults (a tiny model on the embedded corpus)."""
    c = ml_collections.ConfigDict()
    c.model = model_fields("tiny")
    c.precision = "coat"  # fp32 | bf16 | fp8_linear | coat
    # The FP8 recipe of the FP8 precisions (coat_jax.core.recipe.Fp8Recipe): formats of GEMM
    # operands and gradients, the group of saved non-linear inputs, the scaling of GEMM operands
    # (tensor | row | block), the GEMM backend
    # (xla | pallas | auto), whether the Pallas GEMM autotunes, Triton GEMMs on a GPU.
    c.fp8 = ml_collections.ConfigDict(dataclasses.asdict(Fp8Recipe()))
    # auto | float32 | bfloat16: the gradients' dtype (coat_jax.training.step.make_train_step;
    # bf16 halves the gradient buffer where the fused FP8 AdamW update runs and grad_accum is
    # 1). auto: bfloat16 there and with BF16 master weights, float32 elsewhere (resolve_grad_dtype)
    c.grad_dtype = "auto"
    c.optimizer = ml_collections.ConfigDict(
        dict(
            name="fp8_adamw",  # fp8_adamw | adamw
            lr=3e-3,
            min_lr_ratio=0.1,  # cosine decays to lr * min_lr_ratio
            warmup_steps=50,
            decay_steps=0,  # cosine length; 0 = steps (set it to run one schedule in chunks)
            weight_decay=0.1,
            decay_embeddings=False,  # norms and biases are never decayed
            b1=0.9,
            b2=0.95,
            eps=1e-8,
            grad_clip=1.0,  # global norm; 0 disables
            mu_format="e4m3",
            nu_format="e4m3",
            expansion=True,
            group_size=128,
            min_size=16384,
            # fp32 | bf16+16 | bf16+8: the master weights (coat_jax.ops.master_weights). The
            # bf16+ options keep BF16 parameters and a 16-bit (exact) or 8-bit (lossy)
            # remainder of the fp32 weight in the optimizer state; they need grad_dtype=bfloat16
            master_weights="fp32",
            # True: clip by the previous step's gradient norm, so that each parameter's update
            # needs only its own gradient and runs during the backward pass; the step never
            # holds all gradients (7B: 13.5 GB less). Non-finite steps are then told by the
            # loss alone; one micro-batch a step (coat_jax.training.step.make_train_step)
            update_in_backward=False,
            # auto | pallas | reference | interpret: the fused Pallas optimizer kernels
            # (pallas_kernels.dispatch; auto = on a Hopper GPU where measured faster)
            kernels="auto",
        )
    )
    # a Hugging Face folder or a coat-jax run to start from (coat_jax.training.finetune)
    c.init_from = ""
    c.data = ml_collections.ConfigDict(
        dict(
            source="stdlib",
            tokenizer="auto",  # auto (init_from's, else bytes) | bytes | path to tokenizer.json
            format="text",  # text | prompt_response (.jsonl; loss on the response only)
            text_key="text",
            prompt_key="prompt",
            response_key="response",
            eval_fraction=0.05,
        )
    )
    # Device mesh (coat_jax.ops.sharding): examples split over data x fsdp, parameters and FP8
    # optimizer state over fsdp (and tensor); -1 = all remaining devices.
    c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))
    # sequences per optimizer step (split over grad_accum micro-batches); -1 = the largest that
    # fits the device (coat_jax.training.planner; train.py --dry_run prints it)
    c.batch_size = 16
    c.seq_len = 128
    c.grad_accum = 1
    c.steps = 300
    c.seed = 0
    c.log_interval = 25
    c.eval_interval = 100
    c.eval_batches = 4
    # At each eval, print eval_samples texts (0 = off): sample_prompt continued by sample_tokens
    # tokens drawn at sample_temperature (0 = greedy) (coat_jax.training.generate)
    c.eval_samples = 0
    c.sample_prompt = "def "
    c.sample_tokens = 64
    c.sample_temperature = 0.8
    c.checkpoint_interval = 100  # also saved at the last step; 0 = never save
    c.keep_checkpoints = 3
    c.resume = False
    c.resume_step = 0  # with resume: roll back to this checkpoint step or before; 0 = newest
    c.workdir = "runs/llama"
    c.peak_tflops = 0.0  # per device, for MFU; 0 = from the device kind
    c.memory_limit_gb = 0.0  # the planner's device memory per device; 0 = the allocator's limit
    c.compile_cache_dir = ""  # JAX's persistent compilation cache ("" = off)
    c.progress = True
    # A step whose loss or gradient norm is NaN or Inf leaves params and optimizer state
    # unchanged (skipped); up to this many in a row are skipped, one more stops the run
    # (0 = stop at the first).
    c.skip_nonfinite = 10
    c.lock()
    return c


# Keys that decide the shapes or structure of the saved state: a checkpoint cannot resume
# with another value. Prefixes end in a dot.
STATE_KEYS = ("model.", "optimizer.name", "optimizer.mu_format", "optimizer.nu_format",
              "optimizer.expansion", "optimizer.group_size", "optimizer.min_size",
              "optimizer.master_weights", "optimizer.update_in_backward")  # fmt: skip
# Model keys that change how the step computes but not the state: a resume may change them
# (reported as changed), e.g. to fit a larger batch.
COMPUTE_ONLY_MODEL_KEYS = ("model.loss_chunk", "model.recompute_attention",
                           "model.matmul_precision")  # fmt: skip
# Keys that steer a run but not what it computes: never reported on resume.
RUN_CONTROL_KEYS = ("resume", "resume_step", "workdir", "progress", "log_interval", "eval_interval",
                    "eval_batches", "checkpoint_interval", "keep_checkpoints", "compile_cache_dir",
                    "memory_limit_gb", "peak_tflops", "init_from", "skip_nonfinite",
                    "eval_samples", "sample_prompt", "sample_tokens",
                    "sample_temperature")  # fmt: skip


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def resume_changes(saved: dict, c: ml_collections.ConfigDict) -> tuple[list[str], list[str]]:
    """``(refused, changed)``: the keys whose value in ``c`` differs from ``saved`` (a
    checkpointed run's config, as a dict), as ``"key: old -> new"`` lines. ``refused`` holds
    the keys that change the saved state's shapes (:data:`STATE_KEYS`; the model, the
    optimizer's state layout, ``optimizer.grad_clip`` turned on or off), which no checkpoint
    can resume into; ``changed`` the rest, except :data:`RUN_CONTROL_KEYS`."""
    # a key the saved run did not have yet ran as its default
    old = _flat(base_config().to_dict()) | _flat(saved)
    new = _flat(json.loads(c.to_json()))
    refused, changed = [], []
    for key in sorted(old.keys() | new.keys()):
        a, b = old.get(key, "(absent)"), new.get(key, "(absent)")
        if a == b or key in RUN_CONTROL_KEYS:
            continue
        line = f"{key}: {a!r} -> {b!r}"
        clip_switched = key == "optimizer.grad_clip" and (a == 0) != (b == 0)
        state_key = key not in COMPUTE_ONLY_MODEL_KEYS and any(
            key == k or (k.endswith(".") and key.startswith(k)) for k in STATE_KEYS)
        if clip_switched or state_key:
            refused.append(line)
        else:
            changed.append(line)
    return refused, changed


def describe(c: ml_collections.ConfigDict) -> str:
    """Every key of ``c`` with its value, one ``--config.key=value`` a line (``--help``)."""
    return "\n".join(f"  --config.{k}={v!r}" for k, v in _flat(c.to_dict()).items())


def pretraining_config(preset: str) -> ml_collections.ConfigDict:
    """A full-size preset (``llama2_7b``, ``llama3_8b``, ...) at context 2048, batch 1."""
    c = base_config()
    c.model = model_fields(preset)
    c.batch_size, c.seq_len, c.steps = 1, 2048, 1000
    c.optimizer.update(lr=3e-4, warmup_steps=100)
    c.log_interval, c.eval_interval, c.checkpoint_interval = 10, 200, 500
    c.workdir = f"runs/{preset}"
    c.compile_cache_dir = "runs/xla_cache"  # --dry_run's compiles serve the run after it
    return c


def parse_overrides(items: list[str]) -> dict:
    """``["optimizer.lr=1e-3", "precision=coat"]`` -> ``{"optimizer.lr": 0.001, ...}``: values
    as Python literals where they parse as one, else as strings (the benches' ``--set``)."""
    out = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        try:
            out[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            out[key] = text
    return out


def apply_overrides(c: ml_collections.ConfigDict, overrides: dict) -> ml_collections.ConfigDict:
    """Sets each dotted key of ``overrides`` in ``c`` (in place; returns ``c``)."""
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        node = c
        for part in parents:
            node = node[part]
        node[leaf] = value
    return c


def load_file(path: str, overrides: dict | None = None) -> ml_collections.ConfigDict:
    """``get_config()`` of the config file ``path`` (as ``train.py --config`` reads it), with
    ``overrides`` applied."""
    spec = importlib.util.spec_from_file_location("coat_jax_config_file", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return apply_overrides(module.get_config(), overrides or {})


def _positive_int(c, key):
    value = _get(c, key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"config.{key} must be a positive int, got {value!r}")


def _get(c, key):
    for part in key.split("."):
        c = c[part]
    return c


def validate(c: ml_collections.ConfigDict) -> None:
    """Raises ValueError naming the first bad key."""
    wd = c.workdir
    if not isinstance(wd, str) or not wd.strip():
        raise ValueError(f"config.workdir must name a folder, got {wd!r}")
    if os.path.exists(wd) and not os.path.isdir(wd):
        raise ValueError(f"config.workdir={wd!r} exists and is not a folder")
    rs = c.resume_step
    if isinstance(rs, bool) or not isinstance(rs, int) or rs < 0:
        raise ValueError(f"config.resume_step must be an int >= 0 (0 = the newest), got {rs!r}")
    if rs and isinstance(c.steps, int) and rs > c.steps:
        raise ValueError(f"config.resume_step={rs} is past config.steps={c.steps}")
    sn = c.skip_nonfinite
    if isinstance(sn, bool) or not isinstance(sn, int) or sn < 0:
        raise ValueError(f"config.skip_nonfinite must be an int >= 0 (0 = stop at the first "
                         f"non-finite step), got {sn!r}")  # fmt: skip
    for key in ("seq_len", "grad_accum", "steps", "log_interval", "eval_interval",
                "eval_batches", "keep_checkpoints"):  # fmt: skip
        _positive_int(c, key)
    if c.batch_size != -1:
        _positive_int(c, "batch_size")
    es = c.eval_samples
    if isinstance(es, bool) or not isinstance(es, int) or es < 0:
        raise ValueError(f"config.eval_samples must be an int >= 0 (0 = off), got {es!r}")
    if es:
        _positive_int(c, "sample_tokens")
        st = c.sample_temperature
        if isinstance(st, bool) or not isinstance(st, (int, float)) or not 0 <= st < float("inf"):
            raise ValueError(f"config.sample_temperature must be >= 0 (0 = greedy), got {st!r}")
        if not isinstance(c.sample_prompt, str) or not c.sample_prompt:
            raise ValueError(f"config.sample_prompt must be a non-empty string, got "
                             f"{c.sample_prompt!r}")  # fmt: skip
    if not isinstance(c.memory_limit_gb, (int, float)) or c.memory_limit_gb < 0:
        raise ValueError(f"config.memory_limit_gb must be >= 0 (0 = the allocator's limit), "
                         f"got {c.memory_limit_gb!r}")  # fmt: skip
    ci = c.checkpoint_interval
    if isinstance(ci, bool) or not isinstance(ci, int) or ci < 0:
        raise ValueError(f"config.checkpoint_interval must be an int >= 0 (0 = never), got {ci!r}")
    if c.batch_size != -1 and c.batch_size % c.grad_accum:
        raise ValueError(
            f"config.batch_size={c.batch_size} must be a multiple of "
            f"config.grad_accum={c.grad_accum}"
        )
    sizes = [c.mesh[k] for k in ("data", "fsdp", "tensor")]
    for key, size in zip(("data", "fsdp", "tensor"), sizes, strict=True):
        if isinstance(size, bool) or not isinstance(size, int) or size == 0 or size < -1:
            raise ValueError(f"config.mesh.{key} must be a positive int or -1, got {size!r}")
    if sizes.count(-1) > 1:
        raise ValueError(f"config.mesh: at most one size may be -1, got {c.mesh.to_dict()}")
    if c.grad_dtype not in GRAD_DTYPES:
        raise ValueError(f"config.grad_dtype={c.grad_dtype!r}: expected one of {list(GRAD_DTYPES)}")
    if c.precision not in POLICIES:
        raise ValueError(f"config.precision={c.precision!r}: expected one of {sorted(POLICIES)}")
    if c.precision in ("fp8_linear", "coat") and not hopper_gpu():  # else the first step says it
        elsewhere = {"gemm": "'auto' or 'xla'", "fused_quantize": "'auto' or 'interpret'",
                     "fused_mlp": "'auto' or 'interpret'",
                     "fused_backward": "'auto' or 'interpret'",
                     "grad_transpose": "'auto' or 'interpret'"}  # fmt: skip
        for key, fallback in elsewhere.items():
            if c.fp8[key] == "pallas":
                raise ValueError(f"config.fp8.{key}='pallas' needs a Hopper GPU; use {fallback}")
    o = c.optimizer
    if o.master_weights not in MASTER_WEIGHTS:
        raise ValueError(
            f"config.optimizer.master_weights={o.master_weights!r}: expected one of "
            f"{list(MASTER_WEIGHTS)}"
        )
    if o.master_weights != "fp32" and c.grad_dtype == "float32":
        raise ValueError(
            f"config.optimizer.master_weights={o.master_weights!r} keeps BF16 parameters, whose "
            "gradients are BF16: set config.grad_dtype=bfloat16 (or auto)"
        )
    if o.name not in OPTIMIZERS:
        raise ValueError(f"config.optimizer.name={o.name!r}: expected one of {list(OPTIMIZERS)}")
    if o.kernels not in KERNEL_OPTIONS:
        raise ValueError(
            f"config.optimizer.kernels={o.kernels!r}: expected one of {list(KERNEL_OPTIONS)}"
        )
    if not o.lr > 0:
        raise ValueError(f"config.optimizer.lr must be > 0, got {o.lr}")
    if not 0 <= o.min_lr_ratio <= 1:
        raise ValueError(f"config.optimizer.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}")
    if o.warmup_steps < 0 or o.warmup_steps >= c.steps:
        raise ValueError(
            f"config.optimizer.warmup_steps={o.warmup_steps} must be in [0, steps={c.steps})"
        )
    ds = o.decay_steps
    if isinstance(ds, bool) or not isinstance(ds, int) or ds < 0 or 0 < ds <= o.warmup_steps:
        raise ValueError(
            f"config.optimizer.decay_steps={ds!r} must be 0 (= steps) or an int > warmup_steps"
        )
    for key in ("b1", "b2"):
        if not 0 <= o[key] < 1:
            raise ValueError(f"config.optimizer.{key} must be in [0, 1), got {o[key]}")
    if o.grad_clip < 0 or o.weight_decay < 0:
        raise ValueError("config.optimizer.grad_clip and weight_decay must be >= 0")
    if o.update_in_backward and c.grad_accum != 1:
        raise ValueError(
            f"config.optimizer.update_in_backward=True updates during one micro-batch's "
            f"backward pass; it needs config.grad_accum=1, got {c.grad_accum}"
        )
    for key in ("mu_format", "nu_format"):
        if o[key] is not None:
            try:
                get_format(o[key])
            except ValueError:
                raise ValueError(
                    f"config.optimizer.{key}={o[key]!r}: expected 'e4m3', 'e5m2' or None"
                ) from None
    if c.data.format not in DATA_FORMATS:
        raise ValueError(f"config.data.format={c.data.format!r}: expected one of {DATA_FORMATS}")
    if not 0 < c.data.eval_fraction < 1:
        raise ValueError(f"config.data.eval_fraction must be in (0, 1), got {c.data.eval_fraction}")
    fp8_recipe(c)  # names the bad field
    llama_config(c)  # model shape checks (divisibility, group size, ...) name their field


def fp8_recipe(c: ml_collections.ConfigDict) -> Fp8Recipe:
    """``c.fp8`` as an :class:`~coat_jax.core.recipe.Fp8Recipe`."""
    try:
        return Fp8Recipe(**c.fp8.to_dict())
    except ValueError as e:
        raise ValueError(f"config.fp8: {e}") from None


def llama_config(c: ml_collections.ConfigDict, vocab_size: int | None = None) -> LlamaConfig:
    """The model config: ``c.model`` fields plus ``c.precision`` and ``c.fp8``; ``vocab_size``
    overrides."""
    fields = dict(c.model.to_dict(), precision=c.precision, fp8=fp8_recipe(c))
    if vocab_size is not None:
        fields["vocab_size"] = vocab_size
    try:
        return LlamaConfig(**fields)
    except ValueError as e:
        raise ValueError(f"config.model: {e}") from None
