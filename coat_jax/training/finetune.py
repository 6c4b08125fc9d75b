"""Starting a run from existing weights: ``config.init_from``.

``init_from`` is either

* a Hugging Face Llama folder (``config.json`` + safetensors, :mod:`coat_jax.models.hf_llama`):
  its ``config.json`` replaces ``config.model``, its ``tokenizer.json`` (if any) is the data
  tokenizer when ``config.data.tokenizer`` is ``"auto"``, and its weights are the initial params;
* a coat-jax run (its ``workdir``, or the ``checkpoints`` folder in it): that run's
  ``config.model`` and tokenizer, and the params of its latest checkpoint (not its optimizer
  state: the new run starts its own schedule).

:func:`resolve_init_from` runs before the config is validated (it only reads small JSON
files); :func:`initial_params` then reads the weights into the model's (abstract) params.
"""

from __future__ import annotations

import json
import os
import sys

import jax
import ml_collections
from flax import nnx

from coat_jax.models import hf_llama
from coat_jax.models.llama import LlamaConfig
from coat_jax.training import configs, parallel
from coat_jax.training.checkpoint import Checkpointer

__all__ = [
    "base_folder",
    "initial_params",
    "read_run_config",
    "resolve_init_from",
    "run_dirs",
    "trained_context",
]


def run_dirs(path: str) -> tuple[str, str]:
    """``(workdir, checkpoints dir)`` of a coat-jax run given either."""
    if os.path.basename(os.path.normpath(path)) == "checkpoints":
        return os.path.dirname(os.path.normpath(path)), path
    return path, os.path.join(path, "checkpoints")


def read_run_config(workdir: str, ckpt: Checkpointer | None = None, step: int | None = None):
    """A ``train.py`` run's config as a dict: the one saved with checkpoint ``step`` of
    ``ckpt`` (its meta) when given and readable, else ``workdir/config.json``.

    Raises:
      FileNotFoundError: no ``config.json`` where the checkpoint holds none.
      ValueError: the config has no ``model`` (not a coat-jax run).
    """
    saved = None
    if ckpt is not None and step is not None:
        try:
            saved = ckpt.read_meta(step).get("config")
        except Exception:  # noqa: BLE001 - an unreadable meta: the restore says what is wrong
            saved = None
    path = os.path.join(workdir, "config.json")
    if saved is None:
        if not os.path.isfile(path):
            held = "" if step is None else f", and checkpoint {step} holds no config"
            raise FileNotFoundError(f"{path}: not found (a train.py run's config){held}")
        try:
            with open(path) as f:
                saved = json.load(f)
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            raise ValueError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(saved, dict) or "model" not in saved:
        raise ValueError(f"{path}: model: missing (not a coat-jax run config)")
    return saved


def resolve_init_from(c: ml_collections.ConfigDict, *,
                      tokenizer_required: bool = True) -> list[str]:  # fmt: skip
    """Fills ``c.model`` and an ``"auto"`` ``c.data.tokenizer`` from ``c.init_from``, in place;
    returns the ``c.model`` keys this changed, as ``"key: before -> after"`` (a value set on
    the command line is replaced too: the weights decide the model). The model keys that
    change only how the step computes (``loss_chunk``, ``recompute_attention``,
    ``matmul_precision``) stay this run's.

    A resume (``c.resume``) of a run whose ``config.json`` in ``c.workdir`` names the same
    ``init_from`` takes the model and tokenizer from that file instead: its checkpoints hold
    the weights, so the folder it started from need not exist any more.

    Args:
      tokenizer_required: a Hugging Face folder without a ``tokenizer.json`` under an
        ``"auto"`` tokenizer is refused (its ids are not UTF-8 bytes); ``False`` leaves
        ``"bytes"`` for a caller that treats such a folder as ids only.

    Raises:
      FileNotFoundError, ValueError: naming the file and key (``init_from`` is neither kind,
        or its ``config.json`` is unsupported, or it has no tokenizer to use).
    """
    tokenizer, changed = "bytes", []
    if c.init_from:
        path = c.init_from
        resumed = _resumed_run(c)
        workdir, checkpoints = run_dirs(path)
        if resumed is not None:
            model = LlamaConfig(**resumed["model"], precision=c.precision)
            tokenizer = resumed.get("data", {}).get("tokenizer", "bytes")
        elif not os.path.isdir(path):
            raise FileNotFoundError(f"config.init_from={path!r}: no such folder")
        elif hf_llama.is_hf_folder(path) and not os.path.isdir(checkpoints):
            model = hf_llama.read_config(path, c.precision)
            if os.path.isfile(os.path.join(path, "tokenizer.json")):
                tokenizer = os.path.join(path, "tokenizer.json")
            elif tokenizer_required and c.data.tokenizer == "auto":
                raise ValueError(
                    f"config.init_from={path!r} has no tokenizer.json: pass "
                    "--config.data.tokenizer=PATH (or =bytes if the model's ids are UTF-8 bytes)"
                )
        elif os.path.isdir(checkpoints):
            run = read_run_config(workdir)
            model = LlamaConfig(**run["model"], precision=c.precision)
            tokenizer = run.get("data", {}).get("tokenizer", "bytes")
        else:
            raise FileNotFoundError(
                f"config.init_from={path!r}: neither a Hugging Face folder (config.json) nor a "
                "coat-jax run (checkpoints/)"
            )
        compute_only = {k.removeprefix("model.") for k in configs.COMPUTE_ONLY_MODEL_KEYS}
        fields = {k: getattr(model, k) for k in c.model if k not in compute_only}
        fields["n_kv_heads"] = model.kv_heads
        changed = [f"{k}: {c.model[k]!r} -> {v!r}" for k, v in fields.items() if c.model[k] != v]
        c.model.update(fields)
    if c.data.tokenizer == "auto":
        c.data.tokenizer = tokenizer
    return changed


def _resumed_run(c: ml_collections.ConfigDict) -> dict | None:
    """The config a resume continues (``c.workdir``'s ``config.json``, written when the run
    started) when it started from this same ``c.init_from``; else ``None``."""
    if not c.get("resume"):
        return None
    try:
        saved = read_run_config(c.get("workdir", ""))
    except (OSError, ValueError):  # none, or unreadable: the resume's own checks say what
        return None
    same = saved.get("init_from") == c.init_from and isinstance(saved["model"], dict)
    return saved if same else None


def base_folder(init_from: str) -> str:
    """The folder a run's weights came from first: ``init_from``, or where the coat-jax run it
    names (a workdir with ``checkpoints/``) started, and so on back (``""``: a run started
    from scratch; a run whose ``config.json`` is unreadable ends the walk)."""
    seen = set()
    while init_from:
        workdir = os.path.realpath(run_dirs(init_from)[0])
        if not os.path.isdir(os.path.join(workdir, "checkpoints")):  # not a run: the base
            break
        if workdir in seen:  # a loop of runs (hand-edited configs): no base
            return ""
        seen.add(workdir)
        try:
            init_from = read_run_config(workdir).get("init_from", "")
        except (OSError, ValueError):
            return ""
    return init_from


def trained_context(c: ml_collections.ConfigDict) -> int | None:
    """The ``max_position_embeddings`` of ``c.init_from``'s ``config.json`` when it is a
    Hugging Face folder that gives one (positions past it were never trained), else ``None``."""
    if not c.init_from or os.path.isdir(run_dirs(c.init_from)[1]):
        return None
    try:
        with open(os.path.join(c.init_from, "config.json")) as f:
            context = json.load(f).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):  # gone, not JSON, not an object
        return None
    return context if isinstance(context, int) and not isinstance(context, bool) else None


def _warn(message: str) -> None:
    if jax.process_index() == 0:
        print(message, file=sys.stderr, flush=True)


def initial_params(c: ml_collections.ConfigDict, params_like: nnx.State, shardings=None,
                   log=_warn):  # fmt: skip
    """The params to start from: ``c.init_from``'s weights, laid out like ``params_like``
    (abstract is fine) and placed with ``shardings`` (a tree like the params, optional). From
    a run: its newest checkpoint whose params restore (each newer one that does not is said
    through ``log``; nothing in that run is moved).

    Raises:
      FileNotFoundError: the run has no checkpoint.
      ValueError: none of its checkpoints restores (one line).
    """
    path = c.init_from
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path!r}: no such folder (the weights to start from)")
    workdir, checkpoints = run_dirs(path)
    if hf_llama.is_hf_folder(path) and not os.path.isdir(checkpoints):
        dtype = next(iter(nnx.to_flat_state(params_like)))[1].get_value().dtype
        config = hf_llama.read_config(path, c.precision)
        _, _, params = hf_llama.load_params(path, config, param_dtype=dtype, shardings=shardings)
        return params
    ckpt = Checkpointer(checkpoints)
    try:
        if shardings is not None:
            params_like = parallel.with_shardings(params_like, shardings)
        return ckpt.restore_params_newest(params_like, log=log)[1]
    finally:
        ckpt.close()
