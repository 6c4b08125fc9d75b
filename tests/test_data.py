"""Data sources, tokenizers and the deterministic sampler."""

import json

import numpy as np
import pytest

from coat_jax.training import data


def test_byte_tokenizer_roundtrip():
    tok = data.ByteTokenizer()
    text = "héllo\nwörld ✓"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode(text).max() < tok.vocab_size


def test_embedded_corpus_exists_and_is_deterministic():
    a = data.load_tokens("stdlib")
    assert len(a) > 1_000_000
    np.testing.assert_array_equal(a[:1000], data.load_tokens("stdlib")[:1000])


def test_text_jsonl_folder_and_bin_sources(tmp_path):
    (tmp_path / "a.txt").write_text("abc")
    sub = tmp_path / "docs"
    sub.mkdir()
    (sub / "b.txt").write_text("de")
    (sub / "c.txt").write_text("f")
    np.testing.assert_array_equal(data.load_tokens(str(sub)), data.ByteTokenizer().encode("def"))
    assert len(data.load_tokens(str(tmp_path / "a.txt"))) == 3
    rows = tmp_path / "d.jsonl"
    rows.write_text(json.dumps({"text": "xy"}) + "\n\n" + json.dumps({"text": "z"}) + "\n")
    assert data.ByteTokenizer().decode(data.load_tokens(str(rows))) == "xy\nz"
    u16 = tmp_path / "t.bin"
    np.arange(1000, dtype=np.uint16).tofile(u16)
    np.testing.assert_array_equal(data.load_tokens(str(u16)), np.arange(1000))
    u32 = tmp_path / "t.u32.bin"
    np.array([70000, 5], np.uint32).tofile(u32)
    np.testing.assert_array_equal(data.load_tokens(str(u32)), [70000, 5])


@pytest.mark.parametrize(
    ("name", "content", "error", "match"),
    [
        ("missing.txt", None, FileNotFoundError, "not found"),
        ("x.csv", "a,b", ValueError, "unsupported"),
        ("x.jsonl", '{"body": "a"}\n', ValueError, r"x.jsonl:1: no field 'text'"),
        ("x.bin", b"\x00\x01\x02", ValueError, "not a positive multiple"),
        ("empty.txt", "", ValueError, "no tokens"),
    ],
)
def test_bad_sources_raise(tmp_path, name, content, error, match):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(error, match=match):
        data.load_tokens(str(path))


def test_sampler_is_deterministic_resumable_and_splits():
    tokens = np.arange(10_000, dtype=np.int32)
    s = data.BatchSampler(tokens, seq_len=16, batch_size=4, seed=3, eval_fraction=0.1)
    again = data.BatchSampler(tokens, seq_len=16, batch_size=4, seed=3, eval_fraction=0.1)
    np.testing.assert_array_equal(s.batch(7), again.batch(7))  # position = batch index
    assert not np.array_equal(s.batch(7), s.batch(8))
    b = s.batch(0)
    assert b.shape == (4, 17) and b.dtype == np.int32
    np.testing.assert_array_equal(np.diff(b, axis=1), 1)  # contiguous windows
    assert s.batch(0, "train").max() < 9000 <= s.batch(0, "eval").min()
    other_seed = data.BatchSampler(tokens, 16, 4, seed=4).batch(7)
    assert not np.array_equal(other_seed, s.batch(7))


def test_sampler_rejects_short_data():
    with pytest.raises(ValueError, match="eval split has 5 tokens"):
        data.BatchSampler(np.arange(100), seq_len=16, batch_size=2, seed=0, eval_fraction=0.05)


def test_missing_tokenizer_file():
    with pytest.raises(FileNotFoundError, match="tokenizer file not found"):
        data.load_tokenizer("/nonexistent/tokenizer.json")


def test_prompt_response_examples_mask_only_the_response(tmp_path):
    path = tmp_path / "pairs.jsonl"
    records = [{"prompt": "ab", "response": "cde"}, {"prompt": "xyz", "response": "0123456789"}]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    tokens, mask = data.load_examples(str(path), data.ByteTokenizer(), seq_len=7)
    assert tokens.shape == mask.shape == (2, 8) and tokens.dtype == np.int32
    assert bytes(tokens[0, :5].tolist()) == b"abcde" and not tokens[0, 5:].any()  # padded
    assert mask[0].tolist() == [0, 0, 1, 1, 1, 0, 0, 0]
    assert bytes(tokens[1].tolist()) == b"xyz01234" and mask[1].tolist() == [0] * 3 + [1] * 5
    sampler = data.ExampleSampler(tokens, mask, batch_size=3, seed=0, eval_fraction=0.5)
    batch_tokens, batch_mask = sampler.batch(0)
    assert batch_tokens.shape == (3, 8) and batch_mask.shape == (3, 7)  # mask of the targets
    np.testing.assert_array_equal(batch_mask, mask[:1, 1:].repeat(3, 0))  # train = example 0
    np.testing.assert_array_equal(sampler.batch(5, "eval")[0], tokens[[1, 1, 1]])


@pytest.mark.parametrize(
    ("line", "match"),
    [('{"prompt": "a"}', "pairs.jsonl:1: no text field 'response'"),
     ('{"prompt": "0123456789", "response": "b"}', "pairs.jsonl:1: the prompt alone"),
     ('{"prompt": "a", "response": ""}', "pairs.jsonl:1: 'response' is empty and the "
                                         "tokenizer has no eos"),
     ('{"prompt": "caf\xe9", "response": "b"}'.encode("latin-1"),
      r"pairs.jsonl:1: not UTF-8 \(invalid continuation byte at byte 16 of the line\)")],
)  # fmt: skip
def test_bad_prompt_response_records(tmp_path, line, match):
    line = line if isinstance(line, bytes) else line.encode()
    (tmp_path / "pairs.jsonl").write_bytes(line + b"\n")
    with pytest.raises(ValueError, match=match):
        data.load_examples(str(tmp_path / "pairs.jsonl"), data.ByteTokenizer(), seq_len=4)


def test_a_line_not_utf8_is_named_by_its_line(tmp_path):
    """Decoding the whole file named a position inside a read chunk; each line is decoded on
    its own, so the error names the file's line (here the 300th, past the first read)."""
    good = json.dumps({"text": "x" * 100}).encode() + b"\n"
    (tmp_path / "t.jsonl").write_bytes(good * 299 + b'{"text": "\xff"}\n' + good)
    with pytest.raises(ValueError, match=r"t.jsonl:300: not UTF-8 \(invalid start byte at byte 11"):
        data.load_tokens(str(tmp_path / "t.jsonl"))
    (tmp_path / "p.jsonl").write_bytes(good.replace(b"text", b"prompt")[:-2] + b', "response": '
                                       b'"\xc3"}\n')  # fmt: skip
    with pytest.raises(ValueError, match=r"p.jsonl:1: not UTF-8"):
        data.load_examples(str(tmp_path / "p.jsonl"), data.ByteTokenizer(), seq_len=200)


def test_an_empty_response_trains_the_eos_where_there_is_one(tmp_path):
    tokenizer = data.ByteTokenizer()
    tokenizer.eos_id = 0  # an instance attribute: the class keeps None
    (tmp_path / "pairs.jsonl").write_text('{"prompt": "ab", "response": ""}\n')
    tokens, mask = data.load_examples(str(tmp_path / "pairs.jsonl"), tokenizer, seq_len=4)
    assert tokens[0].tolist() == [97, 98, 0, 0, 0] and mask[0].tolist() == [0, 0, 1, 0, 0]


def test_hf_tokenizer_eos_from_the_model_folder(tmp_path):
    """Without a tokenizer_config.json naming it, the eos comes from the folder's
    generation_config.json, else config.json (the first id of a list); ids the tokenizer
    does not have, or other JSON, give none."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({f"w{i}": i for i in range(8)}, unk_token="w0")).save(
        str(tmp_path / "tokenizer.json")
    )
    eos = lambda: data.load_tokenizer(str(tmp_path)).eos_id
    assert eos() is None
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 3}))
    assert eos() == 3
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    assert eos() == 5
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 8}))  # no id
    assert eos() == 3
    (tmp_path / "config.json").write_text("[1, 2]")
    assert eos() is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w2"}))
    assert eos() == 2  # the tokenizer's own word first


def test_stdlib_all_is_the_whole_tree_and_contains_stdlib():
    """``stdlib_all`` holds every .py of the standard library's folder (not site-packages):
    several times ``stdlib``'s text, the top-level modules included, in a fixed order."""
    top, tree = data._stdlib_text(), data._stdlib_text(tree=True)
    assert len(tree) > 3 * len(top)
    first_module = top[:2000]
    assert first_module in tree
    assert data.load_tokens("stdlib_all")[:1000].tolist() == list(tree.encode()[:1000])


def _byte_level_tokenizer_folder(folder):
    for name, content in data.ByteTokenizer.hf_files().items():
        (folder / name).write_text(json.dumps(content, ensure_ascii=False))
    return folder


_TEXTS = ["", " lead and trail ", "tabs\tnew\nlines\r\n", "héllo wörld", "日本語 🙂", "\x00\x7f"]


def test_byte_tokenizer_hf_files_encode_as_bytes(tmp_path):
    """The exported byte-level tokenizer.json: ``tokenizers`` and ``transformers`` give each
    text's UTF-8 bytes as ids (``ByteTokenizer.encode``) and decode them back, spaces kept."""
    pytest.importorskip("tokenizers")
    folder = _byte_level_tokenizer_folder(tmp_path)
    vocab = data.ByteTokenizer.hf_files()["tokenizer.json"]["model"]["vocab"]
    assert sorted(vocab.values()) == list(range(256)) and all(len(c) == 1 for c in vocab)
    ours = data.ByteTokenizer()
    theirs = data.load_tokenizer(str(folder))
    assert theirs.vocab_size == 256
    rng = np.random.default_rng()
    random_text = "".join(chr(c) for c in rng.integers(1, 0x3000, 200) if not 0xD800 <= c < 0xE000)
    for text in [*_TEXTS, random_text]:
        ids = theirs.encode(text)
        np.testing.assert_array_equal(ids, ours.encode(text), err_msg=repr(text))
        assert theirs.decode(ids) == text == ours.decode(ids)
    transformers = pytest.importorskip("transformers")
    auto = transformers.AutoTokenizer.from_pretrained(str(folder))
    for text in [*_TEXTS, random_text]:
        assert auto(text)["input_ids"] == ours.encode(text).tolist(), repr(text)
        assert auto.decode(ours.encode(text)) == text
