"""Generation (coat_jax.training.generate, python -m coat_jax.generate, train.py's eval
samples): greedy ids equal transformers' generate, sampling is seeded and degenerates to greedy,
rows stop at EOS, bad input is one line, and the command line end to end on a train.py run."""

import dataclasses
import json
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from child_env import child_env
from flax import nnx

from coat_jax.models.llama import Llama
from coat_jax.tools import generate as cli
from coat_jax.training import configs, data
from coat_jax.training import generate as gen

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from test_hf_llama import VARIANTS, make_hf_model, write_tokenizer  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROMPTS = [[1, 3, 50, 70, 90, 110, 120, 30], [1, 20, 25]]  # ids < 128: the tiny HF vocabulary
NEW = 32


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A random tiny GQA Llama saved by transformers, with a word-level tokenizer; and the
    transformers model (fp32)."""
    path = tmp_path_factory.mktemp("hf")
    model = make_hf_model(path, **VARIANTS["gqa"])
    write_tokenizer(path)
    return path, model


@pytest.fixture(scope="module")
def hf_source(hf_folder):
    source = gen.read_source(str(hf_folder[0]))
    return source, source.load(jnp.float32)


def greedy(model, eos_id=None, **kwargs):
    with jax.default_matmul_precision("highest"):  # fp32 GEMMs on a GPU too (not TF32)
        made = gen.generate(model, PROMPTS, max_new_tokens=NEW, eos_id=eos_id,
                            compute_dtype=jnp.float32, **kwargs)  # fmt: skip
    return made.tokens


def transformers_greedy(model, eos_id=2):
    """transformers' ``generate(do_sample=False)`` of PROMPTS, left-padded with a mask."""
    width = max(map(len, PROMPTS))
    ids = torch.zeros((2, width), dtype=torch.long)
    mask = torch.zeros((2, width), dtype=torch.long)
    for i, p in enumerate(PROMPTS):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW,
                             do_sample=False, pad_token_id=0)  # fmt: skip
    return [
        row[: row.index(eos_id) + 1] if eos_id in row else row for row in out[:, width:].tolist()
    ]


def test_greedy_equals_transformers_generate(hf_folder, hf_source):
    """Left-padded batch of two prompts, 32 new tokens, fp32: the same ids as transformers'
    ``generate(do_sample=False)`` with left padding and an attention mask, EOS included."""
    source, model = hf_source
    assert source.kind == "hf" and source.eos_ids == (2,) and source.max_len == 64
    ours = greedy(model, eos_id=source.eos_ids)
    assert ours == transformers_greedy(hf_folder[1])
    assert all(len(set(row)) > 5 for row in ours)  # not a degenerate repeat


@pytest.mark.parametrize("variant", ["untied", "tied_clip_gqa"])
def test_greedy_olmo_equals_transformers_generate(tmp_path, variant):
    """The same for a random tiny OlmoForCausalLM (non-parametric LayerNorm; tied embeddings,
    QKV clipping and GQA in the second variant) imported from its folder."""
    from test_olmo import VARIANTS as OLMO_VARIANTS
    from test_olmo import make_hf_olmo

    theirs_model = make_hf_olmo(tmp_path, **OLMO_VARIANTS[variant])
    source = gen.read_source(str(tmp_path))
    assert source.model.norm == "layer" and source.eos_ids == (2,)
    ours = greedy(source.load(jnp.float32), eos_id=source.eos_ids)
    assert ours == transformers_greedy(theirs_model)
    assert len({t for row in ours for t in row}) > 5  # not a degenerate repeat


@pytest.mark.slow
def test_sampling_is_seeded_and_degenerates_to_greedy(hf_source):
    model = hf_source[1]
    want = greedy(model)
    draw = lambda seed, **s: greedy(model, seed=seed, **{"temperature": 1.0, **s})
    assert draw(0) == draw(0)
    assert draw(0) != draw(1)
    assert draw(3, top_k=1) == want
    assert draw(3, temperature=1e-6) == want
    assert draw(3, top_p=1e-6) == want


def test_a_tiny_temperature_samples_the_argmax():
    """Divided by 1e-38 (or a temperature below fp32's smallest normal) every logit overflowed
    to inf (or nan) and the draw took the first of them, token 0; after subtracting the
    row's max first the argmax stays the only finite one."""
    logits = jnp.array([[0.5, 0.1, 3.0, 2.9, -1.0]] * 64)
    keys = jax.random.key(0)
    for t in (1e-6, 1e-20, 1e-38, 1e-45, 1e-300):
        for kw in ({}, {"top_k": 3}, {"top_p": 0.9}):
            drawn = gen.sample_logits(logits, keys, gen.Sampling(t, **kw))
            assert set(np.asarray(drawn)) == {2}, (t, kw)


def test_top_k_and_top_p_keep_the_right_candidates():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 4000))
    keys = jax.random.key(0)
    seen = lambda **s: set(np.asarray(gen.sample_logits(logits, keys, gen.Sampling(1.0, **s))))
    assert seen() == {0, 1, 2, 3}
    assert seen(top_k=2) == {0, 1}
    assert seen(top_p=0.8) == {0, 1}  # 0.5 + 0.3 reach 0.8
    assert seen(top_p=0.81) == {0, 1, 2}
    assert seen(top_k=3, top_p=0.5) == {0}


def test_a_row_stops_at_its_eos_and_the_batch_when_all_have(hf_source):
    model = hf_source[1]
    full = greedy(model)
    cut = lambda row, eos: row[: min([row.index(e) + 1 for e in eos if e in row] or [len(row)])]
    first = next(t for i, t in enumerate(full[0]) if i >= 3 and t not in full[0][:i])
    assert greedy(model, eos_id=first) == [cut(full[0], [first]), cut(full[1], [first])]
    other = next(t for t in full[1] if t not in full[0])
    streamed = []
    both = greedy(model, eos_id=[first, other], on_token=lambda r, t: streamed.append((r, t)))
    assert both == [cut(full[0], [first, other]), cut(full[1], [first, other])]
    assert both[0][-1] in (first, other) and both[1][-1] in (first, other)
    assert sorted(streamed) == sorted((r, t) for r, row in enumerate(both) for t in row)


def test_lengths_and_settings_are_checked_in_one_line(hf_source):
    model = hf_source[1]
    with pytest.raises(ValueError, match=r"^prompt 0 has 8 tokens \+ max_new_tokens 57 = 65, "
                                         r"more than the model's context of 64$"):  # fmt: skip
        gen.generate(model, PROMPTS, max_new_tokens=57, max_len=64)
    with pytest.raises(ValueError, match="prompt 1 has no tokens"):
        gen.generate(model, [[1], []], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"prompt 0: token id 128 outside the vocabulary"):
        gen.generate(model, [[128]], max_new_tokens=4)
    with pytest.raises(ValueError, match="top_p must be in"):
        gen.generate(model, PROMPTS, max_new_tokens=4, top_p=0)
    for seed, match in ((2**63, "seed must fit 64 bits"), (1.5, "seed must be an int")):
        with pytest.raises(ValueError, match=match):
            gen.generate(model, PROMPTS, max_new_tokens=4, seed=seed)
    config = dataclasses.replace(model.config, precision="coat")
    coat = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))  # refused before it runs
    with pytest.raises(ValueError, match="needs a precision='bf16' model"):
        gen.generate(coat, PROMPTS, max_new_tokens=4)


def run_cli(*args):
    """``main(args)`` in this process: its return value, or the exit code or message."""
    try:
        return cli.main([str(a) for a in args])
    except SystemExit as e:
        return e.code


def test_the_cli_refuses_bad_input_in_one_line(hf_folder, tmp_path, capsys):
    path = hf_folder[0]
    long = " ".join(["w1"] * 70)
    cases = {
        "prompt": ((path, "--prompt", long), "prompt 0 has 70 tokens, more than the model's"),
        "folder": ((tmp_path, "--prompt", "w1"), "neither a Hugging Face folder"),
        "missing": ((tmp_path / "nowhere", "--prompt", "w1"), "no such folder"),
        "seed": ((path, "--prompt", "w1", "--seed", 2**64), "seed must fit 64 bits"),
        "prompts_file": ((path, "--prompts_file", tmp_path / "latin1.txt"),
                         "latin1.txt: not UTF-8 (invalid continuation byte at byte 4)"),
    }
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9 w1\n".encode("latin-1"))
    big = tmp_path / "big"  # the same model with a tokenizer of 200 ids (embedding: 128)
    shutil.copytree(path, big)
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({f"t{i}": i for i in range(200)}, unk_token="t0")).save(
        str(big / "tokenizer.json")
    )
    cases["vocab"] = ((big, "--prompt", "t1"), "has 200 ids, the model's embedding only 128 rows")
    for name, (args, expected) in cases.items():
        code = run_cli("--from", *args)
        assert isinstance(code, str) and code.startswith("generate: "), (name, code)
        assert expected in code and "\n" not in code, (name, code)
    assert capsys.readouterr().out == ""  # nothing printed, nothing compiled


def test_the_cli_prints_each_completion_of_several_prompts(hf_folder, capsys):
    code = run_cli("--from", hf_folder[0], "--prompt", "w1 w2 w3", "--prompt", "w4",
                   "--max_new_tokens", 6, "--dtype", "float32")  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.count("--- ") == 2 and "--- 0: 'w1 w2 w3'\nw1 w2 w3" in out and "--- 1: 'w4'" in out
    assert "tokens/s" in err


def test_streaming_holds_back_an_incomplete_character(capsys):
    printer = cli.Printer(data.ByteTokenizer(), ["x"], (), max_new_tokens=3, prompt_ids=[[120]])
    printer(0, 0xC3)  # the first byte of "é"
    assert capsys.readouterr().out == ""
    printer(0, 0xA9)
    assert capsys.readouterr().out == "é"
    printer(0, ord("!"))
    assert capsys.readouterr().out == "!\n"


def test_a_run_stops_at_its_base_folders_eos_ids_and_names_a_bad_config(tmp_path):
    """Generating from a fine-tuned run ends rows at the generation_config.json EOS ids of
    the Hugging Face folder its chain of runs began with, as its export does (it took the
    tokenizer's one eos); a run whose config.json is not JSON is named in one line (it
    raised a TypeError rebuilding the JSON error)."""
    base, run, again = tmp_path / "base", tmp_path / "run", tmp_path / "again"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    (base / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 9]}))
    for folder, init_from in ((run, base), (again, run)):
        (folder / "checkpoints").mkdir(parents=True)
        c = configs.base_config()
        c.init_from, c.data.tokenizer = str(init_from), "bytes"
        (folder / "config.json").write_text(c.to_json())
    assert gen.read_source(str(again)).eos_ids == (2, 7, 9)
    (base / "generation_config.json").unlink()
    assert gen.read_source(str(run / "checkpoints")).eos_ids == (2,)
    (run / "config.json").write_text("{bad")
    with pytest.raises(ValueError, match=r"run/config.json: not a readable JSON file \(Expecting"):
        gen.read_source(str(run))


def test_the_first_new_word_keeps_its_space_after_the_prompt(capsys):
    """A Llama-2-style decoder (Metaspace, then Strip of one leading space) decoding the new
    tokens alone dropped the space between the prompt and the first new word ("x = hfor");
    decoded after the prompt's last tokens, the text reads as the whole sequence does."""
    from tokenizers import Tokenizer, decoders, models

    words = ["<unk>", "\u2581x", "\u2581=", "\u2581h", "\u2581for", "\u2581in", "s"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])  # fmt: skip

    class Words:  # the HFTokenizer interface the printer uses
        decode = staticmethod(lambda ids: tok.decode([int(i) for i in ids]))

    prompt = [1, 2, 3]
    assert Words.decode(prompt) == "x = h" and Words.decode([4]) == "for"  # the trap
    for texts, ids in ((["x = h"], [prompt]), (["x = h", "x"], [prompt, [1]])):
        printer = cli.Printer(Words, texts, (), max_new_tokens=2, prompt_ids=ids)
        for row in range(len(texts)):
            printer(row, 4)
            printer(row, 6)
        out = capsys.readouterr().out
        if len(texts) == 1:  # streamed after the prompt, which main() prints
            assert out == " fors\n", out
        else:
            assert "--- 0: 'x = h'\nx = h fors\n" in out and "--- 1: 'x'\nx fors\n" in out, out


@pytest.mark.parametrize(
    "key, value, match",
    [("eval_samples", -1, "eval_samples must be an int >= 0"),
     ("sample_tokens", 0, "sample_tokens must be a positive int"),
     ("sample_temperature", -0.5, "sample_temperature must be >= 0"),
     ("sample_prompt", "", "sample_prompt must be a non-empty string")],
)  # fmt: skip
def test_eval_sample_keys_are_validated(key, value, match):
    c = configs.base_config()
    c.eval_samples = 2
    c[key] = value
    with pytest.raises(ValueError, match=match):
        configs.validate(c)


# --------------------------------------------------------------------------------------------
# End to end: train.py with eval samples, then the command line on its workdir.


def subprocess_env():
    return child_env(drop_prefix="XLA_PYTHON_CLIENT_", JAX_PLATFORMS="cpu")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("run")
    cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs/llama_tiny.py"),
           f"--config.workdir={workdir}", "--config.steps=5", "--config.optimizer.warmup_steps=1",
           "--config.log_interval=5", "--config.eval_interval=5", "--config.eval_samples=2",
           "--config.sample_tokens=16"]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    return workdir, out


@pytest.mark.slow
def test_train_prints_eval_samples(tiny_run):
    workdir, out = tiny_run
    assert out.returncode == 0, out.stdout + out.stderr
    samples = [line for line in out.stdout.splitlines() if line.startswith("sample ")]
    assert [s[:12] for s in samples] == ["sample 1/2: ", "sample 2/2: "]
    assert all(s[12:].startswith("'def ") for s in samples), samples
    assert json.loads((workdir / "config.json").read_text())["eval_samples"] == 2


@pytest.mark.slow
def test_the_cli_streams_from_a_run(tiny_run):
    workdir, trained = tiny_run
    assert trained.returncode == 0, trained.stdout + trained.stderr
    cmd = [sys.executable, "-m", "coat_jax.generate", "--from", str(workdir),
           "--prompt", "def ", "--max_new_tokens", "12", "--temperature", "0.8", "--top_k", "50",
           "--top_p", "0.95", "--seed", "1"]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("def ") and out.stdout.endswith("\n")
    assert len(out.stdout.encode()) > len("def \n")
    assert "12 new tokens in" in out.stderr and "tokens/s" in out.stderr
    source = gen.read_source(str(workdir / "checkpoints"))
    assert (source.kind, source.max_len, source.eos_ids) == ("run", 64, ())
    assert source.model.precision == "bf16"
