"""The import layers of docs/architecture.md, enforced.

1. import-linter's contracts in pyproject.toml ([tool.importlinter]): models never import
   parallel; the planner imports neither torch nor the trainer, the CLI or calibrate; parallel
   never imports train; comm imports no strategy; the commands on top (only tessel.__main__
   imports them), elastic training above train (only the commands import it), tessel.testing
   imported by nothing in tessel; no import cycles (between the packages and modules of every
   folder). Imports inside functions count: deferring one hides nothing.
2. What the static graph cannot see, checked in a fresh interpreter: importing a module also
   runs its packages' __init__ files, so the planner and the CLI's first imports are loaded for
   real and the modules they pull in are listed.
3. An import inside a function is a deferred dependency, allowed only for a heavy library
   (torch, matplotlib, ...) or with a `# deferred: <why>` comment on its line.

A line whose owner is still moving it is listed in KNOWN with its owner; a listed line that is
fixed warns, so that the list only shrinks.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # not tests.helpers: this test must not import tessel itself

# Non-tessel libraries heavy enough that a function may import them without a comment: torch costs
# a second, matplotlib half of one, and the commands that never need them must not pay for them.
HEAVY = {"torch", "matplotlib", "transformers", "tensorboard"}
DEFERRED = re.compile(r"#.*\bdeferred:\s*\S")

# (file, import statement) inside a function, without a `# deferred:` comment, in files that their
# owners are editing now; each entry names who removes it (by moving the import up or commenting it).
KNOWN = {
}


def cli_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))), "OMP_NUM_THREADS": "1"}


def test_import_linter_contracts():
    """`lint-imports` over pyproject.toml's contracts; its report is the failure message."""
    cmd = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
           "sys.exit(lint_imports_command())", "--config", "pyproject.toml", "--no-cache"]
    out = subprocess.run(cmd, cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=120)
    report = out.stdout[out.stdout.find("Contracts"):] + out.stderr
    assert out.returncode == 0, report
    assert "broken" in report and " 0 broken" in report, report


def loaded_by(*modules: str) -> list[str]:
    """The tessel and torch modules a fresh interpreter holds after importing `modules`."""
    code = (f"import sys; import {', '.join(modules)}; "
            "print('\\n'.join(sorted(m for m in sys.modules if m.split('.')[0] in ('tessel', 'torch'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=cli_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_the_planner_loads_no_torch_trainer_cli_or_probe():
    planner = sorted(f"tessel.planner.{p.stem}" for p in (ROOT / "tessel" / "planner").glob("*.py")
                     if p.stem != "__init__")
    bad = [m for m in loaded_by(*planner) if m.split(".")[0] == "torch"
           or m.startswith(("tessel.train", "tessel.commands", "tessel.elastic", "tessel.calibrate", "tessel.testing"))]
    assert not bad, bad


def test_the_cli_loads_no_torch_before_a_command_needs_it():
    """`tessel train` with a bad config prints its one line before torch would have loaded (a second)."""
    assert not [m for m in loaded_by("tessel.commands.cli", "tessel.commands.launch") if m.split(".")[0] == "torch"]


def function_imports(root: Path = ROOT / "tessel") -> list[tuple[str, int, str, list[str], str]]:
    """(file, line, statement, modules, source lines) of every import inside a function under `root`."""
    return [row for path in sorted(root.rglob("*.py"))
            for row in imports_in(path.read_text(), path.relative_to(ROOT).as_posix())]


def imports_in(source: str, rel: str) -> list[tuple[str, int, str, list[str], str]]:
    lines, found = source.splitlines(), {}
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):  # nested functions and classes too (deduplicated by line)
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = ["tessel" if node.level else node.module or ""]  # relative: one of ours
            else:
                continue
            text = " ".join(ast.get_source_segment(source, node).split())
            found[node.lineno] = (rel, node.lineno, text, modules, " ".join(lines[node.lineno - 1:node.end_lineno]))
    return [found[k] for k in sorted(found)]


def allowed(modules: list[str], source: str) -> bool:
    heavy = all(m.split(".")[0] in HEAVY for m in modules)
    return heavy or bool(DEFERRED.search(source))


def test_imports_inside_functions_are_heavy_or_say_why():
    bad, known_seen = [], set()
    for rel, line, text, modules, source in function_imports():
        if allowed(modules, source):
            continue
        if (rel, text) in KNOWN:
            known_seen.add((rel, text))
            continue
        bad.append(f"{rel}:{line}: {text}")
    assert not bad, ("imports inside functions: move each to the top of its module, or, where it defers a heavy "
                     "dependency or breaks a cycle, say so on its line with `# deferred: <why>`:\n  "
                     + "\n  ".join(bad))
    stale = sorted(set(KNOWN) - known_seen)
    if stale:  # a warning, not a failure: the owner fixing the line should not break this test
        warnings.warn(f"fixed: remove from tests/test_layers.py KNOWN: {stale}", stacklevel=1)


def test_the_import_check_sees_what_it_should():
    """The AST walk on a sample: top-level imports are free, a function's need a heavy library or a reason."""
    sample = ("import os\n"
              "def f():\n"
              "    import torch.distributed as dist\n"
              "    from tessel.models.gpt import GPT  # deferred: loads torch\n"
              "    from tessel.config import Config\n"
              "    class C:\n"
              "        def g(self):\n"
              "            import json\n")
    rows = imports_in(sample, "sample.py")
    assert [(line, allowed(mods, src)) for _, line, _, mods, src in rows] == [
        (3, True), (4, True), (5, False), (8, False)]
