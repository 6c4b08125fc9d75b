"""Training data: corpora, tokenizers and a deterministic, resumable batch sampler.

Sources (``load_tokens``):

* ``"stdlib"``: the embedded default corpus, the source text of the Python standard library's
  top-level modules (``sysconfig.get_paths()["stdlib"]/*.py``, sorted; ~4.7 MB on CPython 3.11).
  It exists wherever Python does, so the default run needs no download.
* ``"stdlib_all"``: every ``.py`` file under the standard library's folder, packages and test
  suites included (site-packages excluded; sorted; ~31.5 MB on CPython 3.11): 7x more text, for
  runs long enough to memorise ``"stdlib"`` (``configs/llama_114m.py``).
* a ``.txt`` file or a folder of them; a ``.jsonl`` file (one JSON object a line, field
  ``text_key``); a pre-tokenized ``.bin`` file of uint16 or uint32 tokens (read as a memmap).

Fine-tuning data (:func:`load_examples`, :class:`ExampleSampler`): a ``.jsonl`` of
prompt/response records; each example is ``prompt + response (+ eos)`` in one row of
``seq_len + 1`` tokens (truncated, or padded with masked-out zeros) with a loss mask that is 1
only where the target token belongs to the response.

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

__all__ = [
    "BatchSampler",
    "ByteTokenizer",
    "ExampleSampler",
    "HFTokenizer",
    "check_token_range",
    "load_corpus",
    "load_examples",
    "make_sampler",
    "load_tokenizer",
    "load_tokens",
]


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab 256, no merges, lossless."""

    vocab_size = 256
    eos_id = None

    def encode(self, text: str, add_special_tokens: bool = True) -> np.ndarray:
        del add_special_tokens  # there are none
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, tokens) -> str:
        return bytes(np.asarray(tokens, np.uint8).tolist()).decode("utf-8", errors="replace")

    @staticmethod
    def hf_files() -> dict[str, dict]:
        """This tokenizer as Hugging Face files (name -> JSON object), for an exported model.

        ``tokenizer.json`` is a byte-level BPE without merges whose token ``b`` is byte ``b``:
        the ``ByteLevel`` pre-tokenizer maps each byte to one printable character (GPT-2's
        table: printable Latin-1 bytes are themselves, the other 68 take the characters from
        U+0100 on, in byte order), so ``tokenizers`` and ``transformers`` encode a text to its
        UTF-8 bytes, as :meth:`encode` does, and decode them back.
        """
        vocab = {char: byte for byte, char in enumerate(_byte_level_chars())}
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                      "use_regex": False}  # fmt: skip
        model = {"type": "BPE", "dropout": None, "unk_token": None, "fuse_unk": False,
                 "continuing_subword_prefix": None, "end_of_word_suffix": None,
                 "byte_fallback": False, "ignore_merges": False,
                 "vocab": vocab, "merges": []}  # fmt: skip
        tokenizer = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
                     "normalizer": None, "pre_tokenizer": byte_level, "post_processor": None,
                     "decoder": byte_level, "model": model}  # fmt: skip
        config = {"tokenizer_class": "PreTrainedTokenizerFast",
                  "clean_up_tokenization_spaces": False}  # fmt: skip
        return {"tokenizer.json": tokenizer, "tokenizer_config.json": config}


def _byte_level_chars() -> list[str]:
    """The character ``ByteLevel`` writes for each byte 0..255 (GPT-2's reversible table)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)}  # fmt: skip
    chars, shifted = [], 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + shifted))
            shifted += 1
    return chars


class HFTokenizer:
    """A local Hugging Face ``tokenizer.json`` (needs the ``tokenizers`` package).

    ``eos_id`` comes from the ``eos_token`` of a ``tokenizer_config.json`` beside it, else
    from the model folder's ``generation_config.json`` / ``config.json`` ``eos_token_id`` (the
    first, if a list) beside it, else ``None``.
    """

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise ImportError(f"{path}: install the 'tokenizers' package to use it") from e
        self._tok = Tokenizer.from_file(path)
        self.vocab_size = self._tok.get_vocab_size()
        self.eos_id = None
        config = os.path.join(os.path.dirname(path), "tokenizer_config.json")
        if os.path.isfile(config):
            with open(config) as f:
                eos = json.load(f).get("eos_token")
            eos = eos.get("content") if isinstance(eos, dict) else eos
            self.eos_id = self._tok.token_to_id(eos) if isinstance(eos, str) else None
        if self.eos_id is None:
            self.eos_id = _model_eos_id(os.path.dirname(path), self.vocab_size)

    def encode(self, text: str, add_special_tokens: bool = True) -> np.ndarray:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        return np.asarray(ids, np.int32)

    def decode(self, tokens) -> str:
        return self._tok.decode([int(t) for t in tokens])


def _model_eos_id(folder: str, vocab_size: int) -> int | None:
    """The first ``eos_token_id`` of ``generation_config.json``, else ``config.json``, in
    ``folder`` (a Hugging Face model folder), if it is an id of the tokenizer."""
    for name in ("generation_config.json", "config.json"):
        try:
            with open(os.path.join(folder, name)) as f:
                eos = json.load(f).get("eos_token_id")
        except (OSError, ValueError, AttributeError):  # absent, not JSON, not an object
            continue
        eos = eos[0] if isinstance(eos, list) and eos else eos
        if isinstance(eos, int) and not isinstance(eos, bool) and 0 <= eos < vocab_size:
            return eos
    return None


def load_tokenizer(path: str | None):
    """``ByteTokenizer()`` for ``None`` / ``"bytes"`` / ``"auto"`` (config default: what
    :func:`coat_jax.training.finetune.resolve_init_from` leaves when there is no model folder's
    tokenizer), else the ``tokenizer.json`` at ``path`` (or in the folder ``path``)."""
    if path in (None, "", "bytes", "auto"):
        return ByteTokenizer()
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    return HFTokenizer(path)


def _stdlib_text(tree: bool = False) -> str:
    root = sysconfig.get_paths()["stdlib"]
    if tree:
        files = glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
        files = sorted(f for f in files if "site-packages" not in os.path.relpath(f, root))
    else:
        files = sorted(glob.glob(os.path.join(root, "*.py")))
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
    if source in ("stdlib", "stdlib_all"):
        tokens = tokenizer.encode(_stdlib_text(tree=source == "stdlib_all"))
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
        for n, line in _jsonl_lines(source):
            if line.strip():
                record = _json_record(source, n, line)
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


def _jsonl_lines(path: str):
    """``(n, line)`` of the ``.jsonl`` ``path``, each line decoded as UTF-8 on its own (a
    ValueError names the file, line and byte where one is not: decoding the whole file would
    name only a position inside a read chunk)."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                yield n, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{n}: not UTF-8 ({e.reason} at byte {e.start + 1} "
                                 "of the line)") from None  # fmt: skip


def _json_record(path: str, n: int, line: str) -> dict:
    """Line ``n`` of the ``.jsonl`` ``path`` as a dict, or a ValueError naming file and line."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{path}:{n}: expected a JSON object, got {type(record).__name__}")
    return record


def check_token_range(tokens, vocab_size: int, source: str) -> None:
    """Raises ValueError, naming ``source``, if a token id is outside ``[0, vocab_size)``
    (read in chunks: a memmapped ``.bin`` is scanned once, never loaded whole)."""
    chunk = 1 << 24
    for start in range(0, len(tokens), chunk):
        part = np.asarray(tokens[start : start + chunk])
        top, low = int(part.max()), int(part.min())
        if top >= vocab_size or low < 0:
            bad = start + int(np.argmax((part >= vocab_size) | (part < 0)))
            raise ValueError(
                f"{source}: token id {int(tokens[bad])} at position {bad} is outside the "
                f"model's vocabulary [0, {vocab_size}) (config.model.vocab_size)"
            )


def _load_bin(path: str) -> np.ndarray:
    """A ``.bin`` of uint16 tokens, or uint32 when the file name ends in ``.u32.bin``."""
    dtype = np.uint32 if path.endswith(".u32.bin") else np.uint16
    size = os.path.getsize(path)
    if size == 0 or size % np.dtype(dtype).itemsize:
        raise ValueError(f"{path}: size {size} is not a positive multiple of {np.dtype(dtype)}")
    return np.memmap(path, dtype=dtype, mode="r")


def text_splits(tokens, seq_len: int, eval_fraction: float) -> dict:
    """``{"train": ..., "eval": ...}``: the stream cut at ``1 - eval_fraction`` of its length.

    Raises:
      ValueError: ``eval_fraction`` outside (0, 1), or a split shorter than one window
        (``seq_len + 2`` tokens).
    """
    if not 0 < eval_fraction < 1:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    split = int(len(tokens) * (1 - eval_fraction))
    splits = {"train": tokens[:split], "eval": tokens[split:]}
    for name, part in splits.items():
        if len(part) < seq_len + 2:
            raise ValueError(
                f"data too short: the {name} split has {len(part)} tokens, "
                f"seq_len {seq_len} needs at least {seq_len + 2}"
            )
    return splits


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
        self.splits = text_splits(tokens, seq_len, eval_fraction)
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


def load_examples(
    path: str,
    tokenizer,
    seq_len: int,
    prompt_key: str = "prompt",
    response_key: str = "response",
) -> tuple[np.ndarray, np.ndarray]:
    """Prompt/response records of a ``.jsonl`` as ``(tokens, mask)``, int32 and bool
    ``(n, seq_len + 1)``: ``mask[i, j]`` is whether ``tokens[i, j]`` is a response (or the
    appended eos) token, i.e. a target the loss counts.

    The prompt is encoded with the tokenizer's special tokens (e.g. BOS), the response
    without, then ``tokenizer.eos_id`` is appended if the tokenizer has one.

    Raises:
      FileNotFoundError: no such file.
      ValueError: naming the line: not a ``.jsonl``, a line not UTF-8 or not a JSON object, a
        record without the keys, an empty response with no eos, a prompt longer than ``seq_len``.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data source not found: {path}")
    if not path.endswith(".jsonl"):
        raise ValueError(f"{path}: prompt/response data must be a .jsonl file")
    rows, masks = [], []
    for n, line in _jsonl_lines(path):
        if not line.strip():
            continue
        record = _json_record(path, n, line)
        for key in (prompt_key, response_key):
            if not isinstance(record.get(key), str):
                raise ValueError(f"{path}:{n}: no text field {key!r} in this record")
        prompt = tokenizer.encode(record[prompt_key])
        response = tokenizer.encode(record[response_key], add_special_tokens=False)
        if tokenizer.eos_id is not None:
            response = np.append(response, np.int32(tokenizer.eos_id))
        if len(response) == 0:
            raise ValueError(f"{path}:{n}: {response_key!r} is empty and the tokenizer has no "
                             "eos token: this example has nothing to learn")  # fmt: skip
        if len(prompt) >= seq_len + 1:
            raise ValueError(
                f"{path}:{n}: the prompt alone has {len(prompt)} tokens, seq_len is {seq_len}"
            )
        tokens = np.zeros(seq_len + 1, np.int32)
        mask = np.zeros(seq_len + 1, bool)
        both = np.concatenate([prompt, response])[: seq_len + 1]
        tokens[: len(both)] = both
        mask[len(prompt) : len(both)] = True
        rows.append(tokens)
        masks.append(mask)
    if not rows:
        raise ValueError(f"{path}: no records")
    return np.stack(rows), np.stack(masks)


class ExampleSampler:
    """Deterministic random batches of whole examples, split into train and eval.

    Batch ``i`` of a split is ``(tokens (batch_size, seq_len + 1), mask (batch_size, seq_len))``,
    a function of ``(seed, split, i)`` like :class:`BatchSampler`'s; ``mask`` weights the
    next-token targets ``tokens[:, 1:]`` (see :func:`coat_jax.models.llama.loss_fn`). The last
    ``eval_fraction`` of the examples (at least one) is held out for evaluation.
    """

    def __init__(self, tokens, mask, batch_size: int, seed: int, eval_fraction=0.05):
        if not 0 < eval_fraction < 1:
            raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
        if len(tokens) < 2:
            raise ValueError(f"data too short: {len(tokens)} example(s), need at least 2")
        split = min(int(len(tokens) * (1 - eval_fraction)), len(tokens) - 1)
        self.splits = {
            "train": (tokens[:split], mask[:split, 1:]),
            "eval": (tokens[split:], mask[split:, 1:]),
        }
        self.batch_size, self.seed, self.seq_len = batch_size, seed, tokens.shape[1] - 1

    def batch(self, index: int, split: str = "train", rows=None) -> tuple[np.ndarray, np.ndarray]:
        """Batch ``index`` of ``split``, or only its examples ``rows`` (as
        :meth:`BatchSampler.batch`)."""
        tokens, mask = self.splits[split]
        rng = np.random.default_rng([self.seed, 0 if split == "train" else 1, index])
        picked = rng.integers(0, len(tokens), size=self.batch_size)
        if rows is not None:
            picked = picked[np.asarray(rows)]
        return tokens[picked], mask[picked]


def load_corpus(c, tokenizer):
    """The data a training config ``c`` names, loaded and checked (before anything compiles):
    the tokens of ``c.data.source`` (``c.data.format="text"``) or its prompt/response
    ``(tokens, mask)`` (``"prompt_response"``), every id inside ``c.model.vocab_size`` and
    each split long enough for ``c.seq_len`` (what the samplers would refuse after the model
    was made).

    Raises:
      FileNotFoundError, ValueError: naming the file (and line) that cannot be used.
    """
    d = c.data
    if d.format == "prompt_response":
        corpus = load_examples(d.source, tokenizer, c.seq_len, d.prompt_key, d.response_key)
        tokens = corpus[0].reshape(-1)
        if len(corpus[0]) < 2:
            count = len(corpus[0])
            raise ValueError(f"{d.source}: data too short: {count} example(s), need at least 2")
    else:
        corpus = tokens = load_tokens(d.source, tokenizer, d.text_key)
    check_token_range(tokens, c.model.vocab_size, d.source)
    if d.format != "prompt_response":
        try:
            text_splits(tokens, c.seq_len, d.eval_fraction)
        except ValueError as e:
            raise ValueError(f"{d.source}: {e}") from None
    return corpus


def make_sampler(c, tokenizer, corpus=None):
    """The sampler a training config ``c`` asks for: :class:`BatchSampler` over
    ``c.data.source`` (``c.data.format="text"``) or :class:`ExampleSampler` over its
    prompt/response records (``"prompt_response"``); ``corpus``: :func:`load_corpus`'s result
    (loaded here when not given)."""
    d = c.data
    corpus = load_corpus(c, tokenizer) if corpus is None else corpus
    if d.format == "prompt_response":
        return ExampleSampler(*corpus, c.batch_size, c.seed, d.eval_fraction)
    return BatchSampler(corpus, c.seq_len, c.batch_size, c.seed, d.eval_fraction)
