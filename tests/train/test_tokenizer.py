"""Tokenizers: tessel's byte-level BPE (deterministic, lossless), the stdlib corpus in subword tokens,
sample decoding, the vocabulary checked against the model, and `tessel data prepare`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import tessel.commands.cli
from tessel.config import ConfigError, DataConfig, build_config
from tessel.train.data import load_tokens, text_codec, tokenizer_file, validate_data
from tessel.train.tokenizer import EOT, ByteCodec, read_tokenizer, train_bpe
from tests.helpers import TINY

TEXT = "".join(f"def f{i}(x):\n    return {{'héllo_{i % 37}': x + {i * 7 % 101}}}  # wörld 🎉\n\tclass A{i % 13}:\n"
               "        pass\n\n\n" for i in range(300))  # enough distinct pairs for 300 ids
ODD = "  leading spaces, \r\n CRLF, a lone \t tab, emoji 🎉🎉, café, 中文, \x00 nul, trailing  "


def tiny() -> dict:
    return {k: dict(v) for k, v in TINY.items()}  # build_config writes overrides into the sections


def bpe(tmp_path, vocab: int = 300):
    (tmp_path / "corpus.txt").write_text(TEXT)
    return train_bpe(tmp_path / "corpus.txt", vocab, tmp_path / f"bpe-{vocab}.json")


def test_bpe_is_deterministic_and_lossless(tmp_path):
    first = bpe(tmp_path).read_bytes()
    again = train_bpe(tmp_path / "corpus.txt", 300, tmp_path / "again.json").read_bytes()
    assert first == again
    codec = read_tokenizer(tmp_path / "bpe-300.json")
    assert codec.tokenizer.token_to_id(EOT) == 0
    for text in (TEXT, ODD, ""):
        ids = codec.encode(text)
        assert codec.decode(ids) == text
    assert len(codec.encode(TEXT)) < len(TEXT.encode()) / 2  # subwords, not bytes
    assert codec.vocab_size == 300


def test_stdlib_bpe_is_built_once_and_tokenizes_the_corpus():
    d = DataConfig(tokenizer="stdlib-bpe-1024", max_bytes=1_000_000)
    path = tokenizer_file(d)
    assert path == tokenizer_file(d) and path.stat().st_size > 0  # cached
    codec = text_codec(d)
    assert codec.vocab_size == 1024
    tokens = load_tokens(d, 1024)
    assert tokens.train.dtype == np.uint16 and int(tokens.train.max()) < 1024
    sample = codec.decode(np.asarray(tokens.train[:2000]).tolist())
    raw = load_tokens(DataConfig(max_bytes=1_000_000), 256).train  # the same corpus as bytes
    assert bytes(raw[:len(sample.encode()) // 2]).decode("utf-8", "replace") in sample
    assert len(tokens.train) < len(raw) / 2.5  # ~3 bytes per token


def test_sample_decodes_with_the_tokenizer(tmp_path):
    from tessel.train.trainer import sample_text
    cfg = build_config({**tiny(), "data": {"source": "synthetic", "tokenizer": str(bpe(tmp_path))}},
                       ["model.vocab_size=300", "train.sample_tokens=3", 'train.sample_prompt="def f"'])
    codec = read_tokenizer(cfg.data.tokenizer)
    tail = codec.encode(" return x")

    class Runner:  # generates `tail` after whatever prompt it gets
        def generate(self, prompt, new_tokens, seed):
            assert prompt.tolist() == [codec.encode("def f")] and new_tokens == 3
            return torch.cat([prompt, torch.tensor([tail[:3]])], dim=1)
    assert sample_text(Runner(), cfg) == codec.decode(codec.encode("def f") + tail[:3])
    assert ByteCodec().decode(ByteCodec().encode(ODD)) == ODD


def test_a_tokenizer_larger_than_the_model_is_refused_before_training(tmp_path):
    cfg = build_config({**tiny(), "data": {"source": "synthetic", "tokenizer": str(bpe(tmp_path, 300))}})
    with pytest.raises(ConfigError, match="has 300 ids, but model.vocab_size is 256") as err:
        validate_data(cfg)
    assert err.value.field == "data.tokenizer"
    (tmp_path / "broken.json").write_text("{}")
    cfg = build_config({**tiny(), "data": {"source": "synthetic", "tokenizer": str(tmp_path / "broken.json")}})
    with pytest.raises(ConfigError, match="not a tokenizers tokenizer.json"):
        validate_data(cfg)


def test_a_document_separator_other_than_the_tokenizers_end_of_text_is_refused(tmp_path):
    data = {"source": "synthetic", "tokenizer": str(bpe(tmp_path, 300))}  # its <|endoftext|> is id 0
    cfg = build_config({**tiny(), "data": data}, ["model.vocab_size=300", "model.document_separator=5"])
    with pytest.raises(ConfigError, match="its <\\|endoftext\\|> is id 0") as err:
        validate_data(cfg)
    assert err.value.field == "model.document_separator"
    validate_data(build_config({**tiny(), "data": data}, ["model.vocab_size=300", "model.document_separator=0"]))
    # bytes have no end of text: the separator is the data's own choice
    validate_data(build_config(tiny(), ["model.document_separator=5"]))


# ---- tessel data prepare ----------------------------------------------------------------------
DOCS = {"a.py": "def f(x):\n    return x + 1\n", "sub/b.txt": "Hello wörld 🎉\n\ttabs  spaces\n",
        "sub/notes.md": "# notes\n" * 50}
LINES = ["first doc", "second\ndoc", "third 🎉"]


def run(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        tessel.commands.cli.main(argv)
    out, err = capsys.readouterr()
    return exit_.value.code, out, err


def test_prepare_round_trip(tmp_path, capsys):
    src = tmp_path / "docs"
    for name, text in DOCS.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(text)
    (src / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in LINES) + "\n")
    tok = bpe(tmp_path)
    code, out, err = run(["data", "prepare", str(src), "--tokenizer", str(tok), "--out", str(tmp_path / "bin"),
                          "--workers", "2", "--val-fraction", "0.3", "--model-config", str(llama(tmp_path, 300))],
                         capsys)
    assert code == 0, err
    codec = read_tokenizer(tmp_path / "bin" / "tokenizer.json")
    docs = []
    for split in ("train", "val"):
        ids = np.fromfile(tmp_path / "bin" / f"{split}.bin", dtype=np.uint16).tolist()
        text = codec.tokenizer.decode(ids, skip_special_tokens=False)
        assert text.endswith(EOT)
        docs += text.split(EOT)[:-1]
    # every document once, whole (decode(encode(text)) == text), split by a hash of its name
    assert sorted(docs) == sorted([*DOCS.values(), *LINES])
    report = json.loads((tmp_path / "bin" / "prepare.json").read_text())
    assert report["train_tokens"] > 0 and report["val_tokens"] > 0 and report["vocab_size"] == 300


def llama(tmp_path, vocab: int):
    path = tmp_path / f"llama-{vocab}.json"
    path.write_text(json.dumps({"model_type": "llama", "vocab_size": vocab, "hidden_size": 32,
                                "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                "max_position_embeddings": 32}))
    return path


def test_prepare_refuses_a_model_too_small_for_the_tokenizer(tmp_path, capsys):
    (tmp_path / "t.txt").write_text(TEXT)
    code, _, err = run(["data", "prepare", str(tmp_path / "t.txt"), "--tokenizer", str(bpe(tmp_path)),
                        "--out", str(tmp_path / "bin"), "--model-config", str(llama(tmp_path, 256))], capsys)
    assert code == 2 and "--model-config: the model has 256 embeddings" in err and "300 ids" in err
    assert not (tmp_path / "bin").exists()
