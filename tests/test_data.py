"""Data sources, tokenizers and the deterministic sampler."""

import json

import numpy as np
import pytest

from coat_jax import data


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
