"""tests/ mirrors tessel/ (docs/architecture.md): a test file sits in the folder of the modules it tests, and a
test file at the top of tests/ is named for a module at the top of tessel/, so a module's tests are found from
its path. Reads the tree only: imports nothing of tessel, so no torch."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Tests of no one module, each with why it stands outside the mirror.
CROSS_CUTTING = {
    "test_layers.py": "the import contracts of the whole package",
    "test_readme.py": "the README's commands, run end to end",
    "test_tree.py": "this test: the tree of the tests themselves",
    "test_gpu_suite.py": "the smoke run of benchmarks/gpu_suite.py, a benchmark rather than a module",
    "hf_matrix": "the parity sweep of every Hugging Face family on every axis (make hf-matrix)",
}


def _test_files() -> list[Path]:
    return sorted(path.relative_to(ROOT / "tests") for path in (ROOT / "tests").rglob("test_*.py"))


def _mirror_miss(test: Path) -> str | None:
    """Why `test` (relative to tests/) is not where its module is, or None."""
    if test.parts[0] in CROSS_CUTTING:
        return None
    if len(test.parts) == 1:
        module = test.name.removeprefix("test_")
        return None if (ROOT / "tessel" / module).is_file() else f"tessel/{module} does not exist"
    folder = ROOT / "tessel" / test.parent
    return None if folder.is_dir() else f"tessel/{test.parent} does not exist"


def test_every_test_file_sits_where_its_module_is():
    misses = {str(test): why for test in _test_files() if (why := _mirror_miss(test))}
    assert not misses, f"move these beside their modules' mirror (or name them in CROSS_CUTTING): {misses}"


def test_every_cross_cutting_entry_still_exists():
    stale = [name for name in CROSS_CUTTING if not (ROOT / "tests" / name).exists()]
    assert not stale, f"remove from CROSS_CUTTING: {stale}"
