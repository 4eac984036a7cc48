"""The README is a user's guide whose commands work: at most 300 lines, its links resolve, the docs map opens with
docs/architecture.md, and every command it shows is run here exactly as written. `bash` blocks are run line by
line in a scratch folder that sees the repository's recipes and examples (so relative paths and each recipe's
own out_dir land there), `sh` blocks hold only install commands (pip, make: not run), a `$ ` transcript is
run and its output compared, and the Python excerpt is the tested examples/own_loop.py word for word."""

from __future__ import annotations

import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tessel.commands.cli import app
from tests.helpers import ROOT, cli_env, metrics_rows

README = ROOT / "README.md"
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)
# the commands a line may start with, as this interpreter runs them (the checkout on PYTHONPATH: cli_env)
PROGRAMS = {"tessel": [sys.executable, "-m", "tessel"], "torchrun": [sys.executable, "-m", "torch.distributed.run"]}


def sections() -> dict[str, str]:
    """The README's text under each '## ' heading."""
    parts = re.split(r"^## (.+)$", README.read_text(), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def blocks(text: str, language: str) -> list[str]:
    return [body for lang, body in BLOCK.findall(text) if lang == language]


def command_lines(text: str) -> list[str]:
    """The commands of the section's bash blocks, comments dropped."""
    lines = [line.split("  #")[0].strip() for body in blocks(text, "bash") for line in body.splitlines()]
    return [line for line in lines if line]


def run_as_written(line: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    program, *args = shlex.split(line)
    proc = subprocess.run(PROGRAMS[program] + args, cwd=cwd, env=cli_env(**env), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"`{line}` failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def private_cache(tmp_path: Path) -> dict[str, str]:
    """A TESSEL_CACHE of the test's own that shares the corpora and tokenizers already built, but not the planner's
    folder: `tessel plan --cluster this` writes its probe of this machine there, and the planner of later tests
    (tessel.elastic.replan's world_cluster) would price this machine's links from it."""
    shared = Path(os.environ.get("TESSEL_CACHE") or Path.home() / ".cache" / "tessel")
    own = tmp_path / "cache"
    own.mkdir()
    for entry in shared.iterdir() if shared.is_dir() else ():
        if entry.name != "planner":
            (own / entry.name).symlink_to(entry)
    return {"TESSEL_CACHE": str(own)}


def scratch(tmp_path: Path) -> Path:
    for folder in ("recipes", "examples"):
        (tmp_path / folder).symlink_to(ROOT / folder)
    return tmp_path


def test_the_readme_is_a_short_guide_whose_links_resolve():
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text)
    assert links and all((ROOT / link).exists() for link in links), [x for x in links if not (ROOT / x).exists()]
    docs_map = sections()["Documentation"]
    assert re.findall(r"\]\(([^)]+)\)", docs_map)[0] == "docs/architecture.md"
    for page in sorted((ROOT / "docs").glob("*.md")):  # every page is on the map
        assert f"](docs/{page.name})" in docs_map, page.name
    assert not re.search(r"load average|loaded machine|quiet machine|\bsession\b|\bissue \d", text, re.I)
    languages = {lang for lang, _ in BLOCK.findall(text)}
    assert languages <= {"bash", "sh", "python", ""}, languages
    installs = [line.split("#")[0].split()[0] for body in blocks(text, "sh") for line in body.splitlines()]
    assert set(installs) <= {"pip", "make"}, installs


def test_the_refusal_transcript_is_what_tessel_prints():
    transcript = blocks(sections()["Quick start (5 minutes)"], "")[0].splitlines()
    command, expected = transcript[0].removeprefix("$ "), transcript[1]
    result = CliRunner().invoke(app, shlex.split(command)[1:])  # refused before anything is spawned
    assert result.exit_code == 2 and result.output.strip() == expected


# three CLI runs, two of them 3 processes importing torch: about 30 s of CPU, past the suite's 300 s default
# when the 2-core machine is shared many ways
@pytest.mark.timeout(900)
def test_the_quick_start_commands_run_as_written(tmp_path):
    cwd = scratch(tmp_path)
    quick = command_lines(sections()["Quick start (5 minutes)"])
    assert quick[0].startswith("tessel train") and quick[-1].startswith("tessel train planned.toml")
    cache = private_cache(tmp_path)
    outputs = [run_as_written(line, cwd, **cache).stdout for line in quick]
    for folder in ("tiny", "planned"):  # tiny.toml's out_dir, then the one the README gives the planned run
        rows = metrics_rows(cwd / "runs" / folder)
        assert len(rows) == 20 and rows[-1]["loss"] < rows[0]["loss"] - 0.3, folder  # test_cli's bar for tiny
    assert "wrote planned.toml" in outputs[1] and "run summary" in outputs[2]


def test_the_plan_commands_run_as_written(tmp_path):
    plans = command_lines(sections()["Choosing a layout with `tessel plan`"])
    assert len(plans) == 2
    cwd = scratch(tmp_path)
    ranked, priced = (run_as_written(line, cwd).stdout for line in plans)
    assert "winner" in ranked and "days" in ranked
    assert "dp2" in priced and "tp8" in priced


def test_the_own_loop_excerpt_is_the_tested_example_and_its_command_trains(tmp_path):
    text = sections()["Your own training loop: `tessel.parallelize`"]
    excerpt = blocks(text, "python")[0]
    assert excerpt in (ROOT / "examples" / "own_loop.py").read_text()  # tests/test_api.py runs its `train`
    (line,) = command_lines(text)
    losses = re.search(r"losses: (.*)", run_as_written(line, scratch(tmp_path)).stdout).group(1).split()
    # uniform random tokens over the tiny Llama's 128 ids: nothing to learn, so each step's mean cross-entropy
    # stays near ln(128) = 4.85 (the first 10 measured 4.85-4.93); its parity is tests/test_api.py's
    assert len(losses) == 10 and all(abs(float(x) - math.log(128)) < 0.3 for x in losses), losses
