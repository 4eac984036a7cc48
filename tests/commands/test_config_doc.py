"""docs/config.md, the configuration reference: regenerated from the schema it equals the committed page (stale:
run `tessel config-doc --out docs/config.md`), and it names every section and field of tessel.config.Config, each
with a description, its choices and its default."""

from __future__ import annotations

from typer.testing import CliRunner

from tessel.commands.cli import app
from tessel.config import Config
from tessel.commands.config_doc import allowed_text, config_markdown, type_text
from tests.helpers import ROOT


def test_docs_config_md_is_what_config_doc_writes(tmp_path):
    out = tmp_path / "config.md"
    result = CliRunner().invoke(app, ["config-doc", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_text() == (ROOT / "docs" / "config.md").read_text(), \
        "docs/config.md is stale: run `tessel config-doc --out docs/config.md`"


def test_every_field_is_documented_with_its_choices():
    page = config_markdown()
    for section, info in Config.model_fields.items():
        assert f"## `[{section}]`" in page
        for name, field in info.annotation.model_fields.items():
            assert field.description, f"{section}.{name} has no description"
            row = next(line for line in page.splitlines() if line.startswith(f"| `{name}` |")
                       and field.description.split()[0] in line)
            assert field.description.split()[-1] in row, (section, name)
    schedule = Config.model_fields["parallel"].annotation.model_fields["schedule"]
    assert allowed_text(schedule).count("`") == 2 * 8  # every pipeline schedule listed
    assert type_text(Config.model_fields["runtime"].annotation.model_fields["nproc_per_node"].annotation) \
        == "int or none"
