"""Training data: corpora, tokenizers and a deterministic, resumable batch sampler.

Sources (``load_tokens``):

* ``"stdlib"``: the embedded default corpus, the source text of the Python standard library's
  top-level modules (``sysconfig.get_paths()["stdlib"]/*.py``, sorted; ~4.7 MB on CPython 3.11).
  It exists wherever Python does, so the default run needs no download.
* a ``.txt`` file or a folder of them; a ``.jsonl`` file (one JSON object a line, field
  ``text_key``); a pre-tokenized ``.bin`` file of uint16 or uint32 tokens (read as a memmap).

Tokenizers: :class:`ByteTokenizer` (vocab 256, the default) or a local Hugging Face
``tokenizer.json`` through the optional ``tokenizers`` package.

Sampling (:class:`BatchSampler`): the token stream is split once into train (first
``1 - eval_fraction``) and eval (the rest). Batch ``i`` of a split is a deterministic function of
``(seed, split, i)``: random windows of ``seq_len + 1`` tokens. The data position in a
checkpoint is just the step, so a resumed run reads exactly the batches an uninterrupted one
would have read.
"""

from __future__ import annotations

import glob
import json
import os
import sysconfig

import numpy as np

__all__ = ["BatchSampler", "ByteTokenizer", "HFTokenizer", "load_tokenizer", "load_tokens"]


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab 256, no merges, lossless."""

    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, tokens) -> str:
        return bytes(np.asarray(tokens, np.uint8).tolist()).decode("utf-8", errors="replace")


class HFTokenizer:
    """A local Hugging Face ``tokenizer.json`` (needs the ``tokenizers`` package)."""

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise ImportError(f"{path}: install the 'tokenizers' package to use it") from e
        self._tok = Tokenizer.from_file(path)
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text).ids, np.int32)

    def decode(self, tokens) -> str:
        return self._tok.decode([int(t) for t in tokens])


def load_tokenizer(path: str | None):
    """``ByteTokenizer()`` for ``None`` / ``"bytes"``, else the ``tokenizer.json`` at ``path``."""
    if path in (None, "", "bytes"):
        return ByteTokenizer()
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    return HFTokenizer(path)


def _stdlib_text() -> str:
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    if not files:
        raise FileNotFoundError("no standard-library sources found for the 'stdlib' corpus")
    parts = []
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            parts.append(fh.read())
    return "\n".join(parts)


def load_tokens(source: str, tokenizer=None, text_key: str = "text") -> np.ndarray:
    """All tokens of ``source`` as one array (int32, or a uint16/uint32 memmap for ``.bin``).

    Raises:
      FileNotFoundError: the path does not exist.
      ValueError: an unsupported file type, a ``.jsonl`` line without ``text_key``, or no tokens.
    """
    tokenizer = tokenizer or ByteTokenizer()
    if source == "stdlib":
        tokens = tokenizer.encode(_stdlib_text())
    elif not os.path.exists(source):
        raise FileNotFoundError(f"data source not found: {source}")
    elif os.path.isdir(source):
        files = sorted(glob.glob(os.path.join(source, "**", "*.txt"), recursive=True))
        if not files:
            raise ValueError(f"{source}: no .txt files in this folder")
        tokens = np.concatenate([load_tokens(f, tokenizer) for f in files])
    elif source.endswith(".bin"):
        return _load_bin(source)
    elif source.endswith(".jsonl"):
        texts = []
        with open(source, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    record = json.loads(line)
                    if text_key not in record:
                        raise ValueError(f"{source}:{n}: no field {text_key!r} in this record")
                    texts.append(record[text_key])
        tokens = tokenizer.encode("\n".join(texts))
    elif source.endswith((".txt", ".md", ".py")):
        with open(source, encoding="utf-8", errors="replace") as f:
            tokens = tokenizer.encode(f.read())
    else:
        raise ValueError(f"{source}: unsupported data file (use .txt, .jsonl, .bin or a folder)")
    if len(tokens) == 0:
        raise ValueError(f"{source}: no tokens")
    return tokens


def _load_bin(path: str) -> np.ndarray:
    """A ``.bin`` of uint16 tokens, or uint32 when the file name ends in ``.u32.bin``."""
    dtype = np.uint32 if path.endswith(".u32.bin") else np.uint16
    size = os.path.getsize(path)
    if size == 0 or size % np.dtype(dtype).itemsize:
        raise ValueError(f"{path}: size {size} is not a positive multiple of {np.dtype(dtype)}")
    return np.memmap(path, dtype=dtype, mode="r")


class BatchSampler:
    """Deterministic random windows over a token array, split into train and eval.

    Args:
      tokens: the whole token stream.
      seq_len: tokens per example (each window holds ``seq_len + 1`` for the shifted targets).
      batch_size: examples per batch.
      seed: the data seed.
      eval_fraction: share of the stream, at its end, held out for evaluation.
    """

    def __init__(self, tokens, seq_len: int, batch_size: int, seed: int, eval_fraction=0.05):
        if not 0 < eval_fraction < 1:
            raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
        split = int(len(tokens) * (1 - eval_fraction))
        self.splits = {"train": tokens[:split], "eval": tokens[split:]}
        for name, part in self.splits.items():
            if len(part) < seq_len + 2:
                raise ValueError(
                    f"data too short: the {name} split has {len(part)} tokens, "
                    f"seq_len {seq_len} needs at least {seq_len + 2}"
                )
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed

    def batch(self, index: int, split: str = "train", rows=None) -> np.ndarray:
        """Batch ``index`` of ``split``: int32 ``(batch_size, seq_len + 1)``, or only the
        examples ``rows`` (indices into the batch) of it - what one process of many reads."""
        part = self.splits[split]
        rng = np.random.default_rng([self.seed, 0 if split == "train" else 1, index])
        starts = rng.integers(0, len(part) - self.seq_len - 1, size=self.batch_size)
        if rows is not None:
            starts = starts[np.asarray(rows)]
        return np.stack([part[s : s + self.seq_len + 1] for s in starts]).astype(np.int32)
