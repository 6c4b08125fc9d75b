"""Export a coat-jax run as a Hugging Face Llama or OLMo folder (safetensors + config.json;
``LlamaForCausalLM``, or ``OlmoForCausalLM`` for a model with ``norm="layer"``).

Reads the run's ``config.json`` and the params of its latest (or ``--step``) checkpoint and
writes them with :func:`coat_jax.models.hf_llama.save_pretrained`. When the run started from a
Hugging Face folder that still exists (``init_from``, or the one a chain of runs through
``init_from`` began with), its other ``config.json`` keys (token ids, context length) are
kept and its ``generation_config.json`` is copied. The tokenizer files of the run's
``data.tokenizer`` (a ``tokenizer.json`` or a folder holding one) are copied from its folder
(for a run that read UTF-8 bytes, a byte-level ``tokenizer.json`` whose token ``b`` is byte
``b`` is written: :meth:`coat_jax.training.data.ByteTokenizer.hf_files`).

Usage::

  python -m coat_jax.tools.export_hf --workdir runs/finetune --out /path/to/out \\
      [--step N] [--dtype bfloat16|float16|float32] [--overwrite]

``--out`` must be new or empty (``--overwrite``: replace what a non-empty one holds); it may
not be the run's folder, another run, or the Hugging Face folder the run started from.
Everything is written beside ``--out`` first and moved in once complete.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import ml_collections
from flax import nnx

from coat_jax.models import hf_llama
from coat_jax.models.llama import Llama
from coat_jax.training import configs, data, finetune
from coat_jax.training.checkpoint import Checkpointer


def _same_folder(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def check_out(out: str, workdir: str, init_from: str, overwrite: bool) -> None:
    """Refuses an ``out`` that would lose something: the run's own folder (or a folder in
    it), the folder the run started from or the Hugging Face folder at the start of that
    chain of runs (:func:`base_folder`), any other ``train.py`` run, a file, or
    (without ``overwrite``) a folder that already holds files.

    Raises:
      ValueError: naming ``out`` and what it holds.
    """
    real_out, real_run = os.path.realpath(out), os.path.realpath(workdir)
    if real_out == real_run or real_out.startswith(real_run + os.sep):
        raise ValueError(f"--out {out}: inside the run's own folder {workdir}; choose another")
    if any(f and _same_folder(out, f) for f in (init_from, finetune.base_folder(init_from))):
        raise ValueError(f"--out {out}: the folder the run started from (init_from); writing "
                         "there would replace the base model's weights")  # fmt: skip
    if not os.path.exists(out):
        return
    if not os.path.isdir(out):
        raise ValueError(f"--out {out}: exists and is not a folder")
    if os.path.isdir(os.path.join(out, "checkpoints")):
        raise ValueError(f"--out {out}: a train.py run (checkpoints/); choose another folder")
    held = sorted(os.listdir(out))
    if held and not overwrite:
        listed = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        raise ValueError(f"--out {out}: not empty ({listed}); pass --overwrite to replace its "
                         "weights, config.json and tokenizer files, or choose another")  # fmt: skip


def export(
    workdir: str,
    out: str,
    step: int | None = None,
    dtype: str = "bfloat16",
    overwrite: bool = False,
    log=print,
) -> list:
    """Writes ``workdir``'s checkpoint ``step`` (default: the newest that restores) to ``out``;
    returns the files. ``out`` is checked (:func:`check_out`) before anything is read.

    Raises:
      FileNotFoundError: no run config or no checkpoint.
      ValueError: an ``out`` that would lose something, or no checkpoint restores.
    """
    run_config = os.path.join(workdir, "config.json")
    if not os.path.isfile(run_config):
        raise FileNotFoundError(f"{run_config}: not found (is --workdir a train.py run?)")
    with open(run_config) as f:
        config = ml_collections.ConfigDict(json.load(f))
    check_out(out, workdir, config.get("init_from", ""), overwrite)
    model_config = configs.llama_config(config)
    checkpoints = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(checkpoints):  # checked first: a Checkpointer would create it
        raise FileNotFoundError(f"{checkpoints}: no such folder")
    ckpt = Checkpointer(checkpoints)
    try:
        abstract = nnx.state(nnx.eval_shape(lambda: Llama(model_config, rngs=nnx.Rngs(0))))
        step, params = ckpt.restore_params_newest(abstract, log=log, step=step)
    finally:
        ckpt.close()
    source = finetune.base_folder(config.get("init_from", ""))
    base, tokenizer_from, tokenizer_files = None, None, {}
    from_hf = bool(source) and hf_llama.is_hf_folder(source)
    if from_hf:
        with open(os.path.join(source, "config.json")) as f:
            base = json.load(f)
        generation = os.path.join(source, "generation_config.json")  # EOS ids, sampling
        if os.path.isfile(generation):
            with open(generation) as f:
                tokenizer_files["generation_config.json"] = json.load(f)
    elif source:
        log(f"export_hf: {source}, the Hugging Face folder the run's weights came from, is "
            "gone: config.json keeps none of its keys (token ids, context length)")  # fmt: skip
    tokenizer = config.data.tokenizer
    if tokenizer not in ("", "bytes", "auto"):  # the tokenizer the run read, if still there
        if os.path.isdir(tokenizer):  # data.load_tokenizer reads a folder's tokenizer.json
            tokenizer_from = tokenizer
        elif os.path.isfile(tokenizer):
            tokenizer_from = os.path.dirname(tokenizer)
        else:
            log(f"export_hf: the run's tokenizer {tokenizer} is gone; no tokenizer written")
    elif from_hf and tokenizer == "auto":  # a run whose config predates resolving "auto"
        tokenizer_from = source
    else:  # the run read UTF-8 bytes: say so in the folder, generation needs it
        tokenizer_files.update(data.ByteTokenizer.hf_files())
    return hf_llama.save_pretrained(
        params, model_config, out, dtype=dtype, base_config=base, tokenizer_from=tokenizer_from,
        tokenizer_files=tokenizer_files or None,
    )  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].replace("\n", " "),
    )
    parser.add_argument("--workdir", required=True, help="the train.py run's workdir")
    parser.add_argument("--out", required=True, help="the Hugging Face folder to write")
    parser.add_argument("--step", type=int, default=None,
                        help="checkpoint step (default: the newest that restores)")  # fmt: skip
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the files of a non-empty --out")  # fmt: skip
    args = parser.parse_args(argv)
    warn = lambda message: print(message, file=sys.stderr, flush=True)
    try:
        files = export(args.workdir, args.out, args.step, args.dtype, args.overwrite, log=warn)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"export_hf: {e}")
    print(f"Wrote {args.out}: {', '.join(files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
