"""Generate text from a coat-jax run or a Hugging Face Llama folder.

Usage::

  python -m coat_jax.generate --from runs/llama --prompt "def "
  python -m coat_jax.generate --from /models/Llama-3.2-1B --prompt "The capital of" \\
      --prompt "Once upon a time" --max_new_tokens 64 --temperature 0.8 --top_p 0.95

One prompt: its text streams to the terminal as the tokens come. Several: each completion is
printed when its row ends (at EOS or ``--max_new_tokens``). Then one line on stderr: the new
tokens, tokens/s of generation (prefill and steps, compilation excluded) and the compile time.
Bad input (a folder that is no model, a prompt longer than the context, a tokenizer larger
than the embedding, a bad setting) stops with one line before anything compiles. The model
runs the ``bf16`` precision policy whatever it was trained with
(:mod:`coat_jax.training.generate`).
"""

from __future__ import annotations

import argparse
import sys

import jax.numpy as jnp

from coat_jax.training import generate as gen

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


def read_prompts(args) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        try:
            with open(args.prompts_file, encoding="utf-8") as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as e:
            raise ValueError(f"--prompts_file {args.prompts_file}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"--prompts_file {args.prompts_file}: not UTF-8 ({e.reason} at "
                             f"byte {e.start + 1})") from None  # fmt: skip
    if not prompts:
        raise ValueError("no prompt: pass --prompt TEXT (repeatable) or --prompts_file FILE")
    return prompts


class Printer:
    """The terminal side of :func:`coat_jax.training.generate.generate`'s ``on_token``: streams
    the one row's text (held back while a character's bytes are incomplete), or prints each
    row's whole text when it ends.

    A row's new tokens are decoded after the last :data:`CONTEXT` tokens of its prompt, and
    that context's text cut off: decoded alone, the first new token is the start of a text,
    and decoders that strip a leading space there (Llama 2's ``Metaspace`` + ``Strip``) lose
    the space between the prompt and the first new word."""

    CONTEXT = 8

    def __init__(self, tokenizer, prompts: list[str], eos_ids, max_new_tokens: int,
                 prompt_ids: list[list[int]]):  # fmt: skip
        self.tokenizer, self.prompts, self.eos = tokenizer, prompts, set(eos_ids)
        self.max_new_tokens = max_new_tokens
        self.context = [list(ids[-self.CONTEXT :]) for ids in prompt_ids]
        self.context_text = [tokenizer.decode(ids) for ids in self.context]
        self.rows = [[] for _ in prompts]
        self.shown = 0  # characters of the streamed row already printed

    def text(self, row: int) -> str:
        new = [t for t in self.rows[row] if t not in self.eos]
        full = self.tokenizer.decode(self.context[row] + new)
        before = self.context_text[row]
        return full[len(before) :] if full.startswith(before) else self.tokenizer.decode(new)

    def __call__(self, row: int, token: int) -> None:
        self.rows[row].append(token)
        ended = token in self.eos or len(self.rows[row]) == self.max_new_tokens
        if len(self.prompts) == 1:
            text = self.text(row)
            if ended or not text.endswith("\ufffd"):  # a multi-byte character still coming
                print(text[self.shown :], end="", flush=True)
                self.shown = len(text)
            if ended:
                print(flush=True)
        elif ended:
            print(f"--- {row}: {self.prompts[row]!r}\n{self.prompts[row]}{self.text(row)}",
                  flush=True)  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--from", dest="source", required=True,
                        help="a train.py workdir or a Hugging Face Llama folder")  # fmt: skip
    parser.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    parser.add_argument("--prompts_file", help="a text file, one prompt a line")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top_k", type=int, default=0, help="0: off")
    parser.add_argument("--top_p", type=float, default=1.0, help="1: off")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES),
                        help="of weights, activations and the cache")  # fmt: skip
    parser.add_argument("--max_len", type=int, default=None,
                        help="context length (default: the run's seq_len or the Hugging Face "
                        "max_position_embeddings)")  # fmt: skip
    args = parser.parse_args(argv)
    try:  # every check before any weight is read or anything compiles
        texts = read_prompts(args)
        gen.Sampling(args.temperature, args.top_k, args.top_p)
        gen.check_seed(args.seed)
        source = gen.read_source(args.source, args.max_len)
        if source.tokenizer is None:
            raise ValueError(f"{args.source}: no tokenizer.json (text needs the model's tokenizer)")
        prompts = [[int(t) for t in source.tokenizer.encode(text)] for text in texts]
        gen.check_lengths(prompts, args.max_new_tokens, source.max_len)
        model = source.load(DTYPES[args.dtype])
    except (FileNotFoundError, ValueError, ImportError) as e:
        sys.exit(f"generate: {e}")
    printer = Printer(source.tokenizer, texts, source.eos_ids, args.max_new_tokens, prompts)
    if len(texts) == 1:
        print(texts[0], end="", flush=True)
    made = gen.generate(
        model, prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, eos_id=source.eos_ids, seed=args.seed,
        max_len=source.max_len, compute_dtype=DTYPES[args.dtype], on_token=printer,
    )  # fmt: skip
    print(f"{made.new_tokens} new tokens in {made.prefill_s + made.decode_s:.2f} s: "
          f"{made.tokens_per_s:.1f} tokens/s (prompt {made.prompt_tokens} tokens, prefill "
          f"{made.prefill_s:.2f} s; compile {made.compile_s:.1f} s)", file=sys.stderr)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
