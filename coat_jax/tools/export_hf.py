"""Export a coat-jax run as a Hugging Face Llama or OLMo folder (safetensors + config.json;
``LlamaForCausalLM``, or ``OlmoForCausalLM`` for a model with ``norm="layer"``).

Reads the run's ``config.json`` and the params of its latest (or ``--step``) checkpoint and
writes them with :func:`coat_jax.models.hf_llama.save_pretrained`. When the run started from a
Hugging Face folder (``init_from``) that still exists, its other ``config.json`` keys (token
ids, context length) are kept and its tokenizer files copied; else the run's
``data.tokenizer`` file, if any, is copied.

Usage::

  python -m coat_jax.tools.export_hf --workdir runs/finetune --out /path/to/out \\
      [--step N] [--dtype bfloat16|float16|float32]
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
from coat_jax.training import configs
from coat_jax.training.checkpoint import Checkpointer


def export(workdir: str, out: str, step: int | None = None, dtype: str = "bfloat16") -> list:
    """Writes ``workdir``'s checkpoint ``step`` (default: latest) to ``out``; returns the files.

    Raises:
      FileNotFoundError: no run config or no checkpoint.
    """
    run_config = os.path.join(workdir, "config.json")
    if not os.path.isfile(run_config):
        raise FileNotFoundError(f"{run_config}: not found (is --workdir a train.py run?)")
    with open(run_config) as f:
        config = ml_collections.ConfigDict(json.load(f))
    model_config = configs.llama_config(config)
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"))
    try:
        step = ckpt.latest_step() if step is None else step
        if step is None or step not in ckpt.all_steps():
            raise FileNotFoundError(f"{ckpt.directory}: no checkpoint {step or ''}".rstrip())
        abstract = nnx.state(nnx.eval_shape(lambda: Llama(model_config, rngs=nnx.Rngs(0))))
        params = ckpt.restore_params(step, abstract)
    finally:
        ckpt.close()
    source = config.get("init_from", "")
    base, tokenizer_from = None, None
    if source and hf_llama.is_hf_folder(source):
        with open(os.path.join(source, "config.json")) as f:
            base = json.load(f)
        tokenizer_from = source
    elif config.data.tokenizer not in ("", "bytes", "auto") and os.path.isfile(
        config.data.tokenizer
    ):
        tokenizer_from = os.path.dirname(config.data.tokenizer)
    return hf_llama.save_pretrained(
        params, model_config, out, dtype=dtype, base_config=base, tokenizer_from=tokenizer_from
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", required=True, help="the train.py run's workdir")
    parser.add_argument("--out", required=True, help="the Hugging Face folder to write")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (latest)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args(argv)
    try:
        files = export(args.workdir, args.out, args.step, args.dtype)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"export_hf: {e}")
    print(f"Wrote {args.out}: {', '.join(files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
