"""validate_data: bad token data refused before any rank starts, naming the field and the file."""

import json
import os

import numpy as np
import pytest

from tessel.config import Config, ConfigError
from tessel.train import data
from tessel.train.data import BatchSampler, validate_data

SEQ = 16  # windows of 17 tokens: a split needs at least 18


def config(source="bin", path=None, vocab=256, seq_len=SEQ, **data_fields) -> Config:
    """A config as build_config would make it, without check_layout (which already refuses a missing
    data.path): validate_data must stand on its own."""
    return Config.model_validate({"model": {"vocab_size": vocab, "max_seq_len": max(64, seq_len)},
                                  "train": {"seq_len": seq_len},
                                  "data": {"source": source, "path": path and str(path), **data_fields}})


def tokens(n, top=255):
    return (np.arange(n) % (top + 1)).astype(np.uint16)


# each case: the files it writes under tmp_path -> (data.path, the field, the file the message names,
# a piece of the message)
def missing(d):
    return d / "train.bin", "data.path", d / "train.bin", "no such file"


def directory(d):
    (d / "train.bin").mkdir()
    return d / "train.bin", "data.path", d / "train.bin", "is a directory"


def empty(d):
    (d / "train.bin").write_bytes(b"")
    return d / "train.bin", "data.path", d / "train.bin", "is empty"


def odd_bytes(d):
    (d / "train.bin").write_bytes(tokens(100).tobytes() + b"\0")
    return d / "train.bin", "data.path", d / "train.bin", "201 bytes, an odd count"


def too_short(d):
    tokens(SEQ + 1).tofile(d / "train.bin")  # one window exactly: BatchSampler needs more
    tokens(1000).tofile(d / "val.bin")
    return d / "train.bin", "train.seq_len", d / "train.bin", "holds 17 tokens"


def val_bin_too_short(d):
    tokens(1000).tofile(d / "train.bin")
    tokens(10).tofile(d / "val.bin")
    return d / "train.bin", "train.seq_len", d / "val.bin", "holds 10 tokens"


def val_split_too_short(d):
    tokens(200).tofile(d / "train.bin")  # no val.bin: the last 5% (10 tokens) validate
    return d / "train.bin", "train.seq_len", d / "train.bin", "validation split"


def val_bin_is_a_directory(d):
    tokens(1000).tofile(d / "train.bin")
    (d / "val.bin").mkdir()
    return d / "train.bin", "data.path", d / "val.bin", "is a directory"


def out_of_vocab(d):
    arr = tokens(5000)
    arr[1234] = 300
    arr.tofile(d / "train.bin")
    return d / "train.bin", "data.path", d / "train.bin", "holds token id 300 at position 1234, but " \
                                                          "model.vocab_size is 256"


def out_of_vocab_in_val_bin(d):
    tokens(5000).tofile(d / "train.bin")
    arr = tokens(1000)
    arr[7] = 256
    arr.tofile(d / "val.bin")
    return d / "train.bin", "data.path", d / "val.bin", "holds token id 256 at position 7"


@pytest.mark.parametrize("case", [missing, directory, empty, odd_bytes, too_short, val_bin_too_short,
                                  val_split_too_short, val_bin_is_a_directory, out_of_vocab,
                                  out_of_vocab_in_val_bin])
def test_bad_bin_files_are_refused_naming_field_and_file(tmp_path, monkeypatch, case):
    monkeypatch.setenv("TESSEL_CACHE", str(tmp_path / "cache"))
    path, field, culprit, text = case(tmp_path)
    with pytest.raises(ConfigError) as err:
        validate_data(config(path=path))
    assert err.value.field == field
    assert str(culprit) in err.value.message and text in err.value.message
    assert "\n" not in str(err.value)


def test_good_bin_files_pass(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSEL_CACHE", str(tmp_path / "cache"))
    tokens(5000, top=299).tofile(tmp_path / "train.bin")
    validate_data(config(path=tmp_path / "train.bin", vocab=300))  # id 299 is the last of 300
    with pytest.raises(ConfigError, match="holds token id 299"):
        validate_data(config(path=tmp_path / "train.bin", vocab=299))


def test_the_scan_is_chunked_and_finds_the_first_largest_id(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "SCAN_CHUNK", 7)  # the maximum moves across many chunks
    arr = tokens(100, top=50)
    arr[[33, 64, 90]] = [70, 80, 80]
    arr.tofile(tmp_path / "train.bin")
    assert data.scan_max(tmp_path / "train.bin") == (80, 64)


@pytest.fixture
def scans(monkeypatch, tmp_path):
    """The paths the real scan reads (the cache must spare it)."""
    monkeypatch.setenv("TESSEL_CACHE", str(tmp_path / "cache"))
    calls, real = [], data.scan_max
    monkeypatch.setattr(data, "scan_max", lambda path: calls.append(path) or real(path))
    return calls


def test_the_largest_id_is_cached_beside_the_file_and_reused(tmp_path, scans):
    path = tmp_path / "train.bin"
    tokens(5000).tofile(path)
    validate_data(config(path=path))
    sidecar = tmp_path / "train.bin.tessel-stats.json"
    doc = json.loads(sidecar.read_text())
    assert (doc["max"], doc["size"], doc["mtime_ns"]) == (255, 10000, path.stat().st_mtime_ns)
    validate_data(config(path=path))
    validate_data(config(path=path, seq_len=32))
    assert len(scans) == 1


def test_a_changed_file_or_a_corrupt_cache_is_scanned_again(tmp_path, scans):
    path = tmp_path / "train.bin"
    tokens(5000).tofile(path)
    validate_data(config(path=path))
    arr = tokens(5000)
    arr[10] = 999  # same size: only the mtime tells
    arr.tofile(path)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(ConfigError, match="token id 999 at position 10"):
        validate_data(config(path=path))
    assert len(scans) == 2
    (tmp_path / "train.bin.tessel-stats.json").write_text("{not json")
    with pytest.raises(ConfigError, match="token id 999"):
        validate_data(config(path=path))
    assert len(scans) == 3
    tokens(6000).tofile(path)  # a new size
    validate_data(config(path=path))
    assert len(scans) == 4


def test_an_unwritable_folder_caches_under_the_cache_dir(tmp_path, scans, monkeypatch):
    path = tmp_path / "train.bin"
    tokens(5000).tofile(path)
    (tmp_path / "blocker").write_text("")  # a file where the sidecar's folder should be: mkdir fails
    # (chmod cannot make a folder unwritable for root, who runs these tests in CI)
    original = data._stats_paths
    monkeypatch.setattr(data, "_stats_paths", lambda p: [tmp_path / "blocker" / "x.json", *original(p)[1:]])
    validate_data(config(path=path))
    assert list((tmp_path / "cache" / "bin-stats").glob("*.json"))
    validate_data(config(path=path))
    assert len(scans) == 1


def test_stdlib_and_synthetic_sources_obey_the_same_lengths(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSEL_CACHE", str(tmp_path))
    validate_data(config("stdlib", max_bytes=2_000_000, val_fraction=0.1))
    with pytest.raises(ConfigError) as err:  # a corpus of a few small files: none falls in the val split
        validate_data(config("stdlib", max_bytes=1_000))
    assert err.value.field == "train.seq_len" and "stdlib corpus" in err.value.message
    with pytest.raises(ConfigError) as err:
        validate_data(config("stdlib", vocab=200))
    assert err.value.field == "model.vocab_size"
    validate_data(config("synthetic"))
    with pytest.raises(ConfigError) as err:  # 100,000 tokens, 5% of them validate
        validate_data(config("synthetic", seq_len=6000))
    assert err.value.field == "train.seq_len" and "synthetic data's validation split" in err.value.message


def test_batch_sampler_refuses_an_id_past_the_vocabulary(tmp_path):
    arr = tokens(400)
    arr[200:] = 300
    arr.tofile(tmp_path / "train.bin")
    mm = np.memmap(tmp_path / "train.bin", dtype=np.uint16, mode="r")
    BatchSampler(mm, 8, 64, seed=0).next()  # no vocabulary given: unchecked, as before
    with pytest.raises(ValueError) as err:
        BatchSampler(mm, 8, 64, seed=0, vocab_size=256).next()
    msg = str(err.value)
    assert "token id 300" in msg and "model.vocab_size" in msg and "256" in msg and str(tmp_path) in msg
    with pytest.raises(ValueError, match="in-memory token array"):
        BatchSampler(np.asarray(arr, dtype=np.int64), 8, 64, seed=0, vocab_size=256).next()
    BatchSampler(mm, 8, 64, seed=0, vocab_size=301).next()
