"""Long work beyond training (checksumming and verifying a checkpoint, tokenizing, the planner's search, the
simulator) shows a rich bar on a terminal and writes nothing when the output is a log or a pipe."""

import io
import json
import os
import pty

import pytest
import rich
from rich.console import Console

import tessel.commands.cli
from tessel.observe.progress import work_progress
from tessel.train.checkpoint.manager import _check_files, commit
from tessel.train.prepare import check_prepare, prepare
from tessel.train.tokenizer import train_bpe

BAR = "━"  # rich's bar glyph


def _console(terminal: bool) -> Console:
    return Console(file=io.StringIO(), force_terminal=terminal, width=100)


def test_a_terminal_gets_a_bar_and_a_pipe_gets_nothing():
    master, slave = pty.openpty()
    with os.fdopen(slave, "w") as tty:  # a real terminal: rich decides by isatty, as for a user's shell
        with work_progress("checksumming", 10, console=Console(file=tty, width=80)) as work:
            work.advance(10)
        tty.flush()
        drawn = os.read(master, 65536).decode(errors="replace")
    os.close(master)
    assert "checksumming" in drawn and BAR in drawn
    piped = _console(terminal=False)
    with work_progress("checksumming", 10, console=piped) as work:
        work.advance(10)
    assert piped.file.getvalue() == ""


@pytest.fixture(params=[True, False], ids=["terminal", "log"])
def console(request, monkeypatch):
    """rich's own console (the one every bar draws on) as a terminal or as a log file."""
    made = _console(request.param)
    monkeypatch.setattr(rich, "_console", made)
    return made


def test_checkpoint_checksums_and_verification(console, tmp_path):
    tmp, final = tmp_path / ".tmp-step_00000001", tmp_path / "step_00000001"
    tmp.mkdir()
    (tmp / "dcp_metadata.json").write_text("{}")
    (tmp / "__0_0.distcp").write_bytes(os.urandom(3 << 20))  # three blocks of the hash's reads
    commit(tmp, final, 1, {})
    _check_files(final, json.loads((final / "manifest.json").read_text())["files"])
    shown = console.file.getvalue()
    if console.is_terminal:
        assert "checksumming .tmp-step_00000001" in shown and "verifying step_00000001" in shown
        assert "3.1 MB" in shown  # counted in bytes
    else:
        assert shown == ""


def test_planner_search_and_simulator(console, tmp_path, capsys):
    for argv in (["plan", "--model", "gpt3-1.3b", "--world", "8", "--top", "1"],
                 ["simulate", "--model", "gpt3-1.3b", "--world", "4", "--layout", "dp=1,tp=2,pp=2,mb=1",
                  "--trace", str(tmp_path / "t.json"), "--png", str(tmp_path / "t.png")]):
        with pytest.raises(SystemExit) as done:
            tessel.commands.cli.main(argv)
        assert done.value.code == 0
    capsys.readouterr()
    shown = console.file.getvalue()
    if console.is_terminal:
        assert "pricing layouts" in shown and "simulating" in shown and BAR in shown
    else:
        assert shown == ""


def test_data_prepare(console, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x): return x + {i}\n" for i in range(300)))
    train_bpe(corpus, 280, tmp_path / "bpe.json")
    job = check_prepare(str(corpus), str(tmp_path / "bpe.json"), str(tmp_path / "out"), None, None, 0.1, 1,
                        "text", False)
    assert prepare(job)["train_tokens"] > 0
    shown = console.file.getvalue()
    assert ("tokenizing" in shown) == console.is_terminal and (shown == "") != console.is_terminal
