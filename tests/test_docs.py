"""The documentation stays true: generated tables match the dataclasses, links and file paths resolve."""

from __future__ import annotations

import argparse
import re
import runpy
from pathlib import Path

import pytest

from megatron_dhp.config_io import field_docs
from megatron_dhp.cost import CostConfig
from megatron_dhp.integration.dhp_config import DhpConfig
from megatron_dhp.megatron.arguments import add_dhp_args
from megatron_dhp.training.config import DataConfig, ModelConfig, RunConfig, VisionConfig

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted((REPO / "docs").glob("*.md"))
README = REPO / "README.md"
LINK = re.compile(r"\]\(([^)\s]+)\)")
PATH = re.compile(r"`((?:megatron_dhp|tests|scripts|bench|configs|docs|csrc|patches|workload|plan|cost|solver|runtime|"
                  r"testing|integration|training|cli|closed_loop)/[\w./-]+)`")
"""A path of this project (upstream Megatron-LM's files, `megatron/...`, and bare file names are not checked)."""


def test_configuration_page_is_generated_from_the_dataclasses():
    page = runpy.run_path(str(REPO / "scripts" / "config_docs.py"))["page"]()
    assert (REPO / "docs" / "configuration.md").read_text() == page, (
        "regenerate it: python scripts/config_docs.py > docs/configuration.md")


def test_megatron_page_lists_the_flags_and_the_refusals_the_validator_uses():
    with_generated = runpy.run_path(str(REPO / "scripts" / "config_docs.py"))["with_generated"]
    page = (REPO / "docs" / "megatron-lm.md").read_text()
    assert with_generated(page) == page, "regenerate it: python scripts/config_docs.py --megatron-lm"


@pytest.mark.parametrize("cls", [CostConfig, DhpConfig, ModelConfig, VisionConfig, DataConfig, RunConfig])
def test_every_config_field_has_a_docstring(cls):
    assert set(field_docs(cls)) == set(cls.__dataclass_fields__)


def test_megatron_page_documents_every_flag():
    page = (REPO / "docs" / "megatron-lm.md").read_text()
    flags = [a.option_strings[0] for a in add_dhp_args(argparse.ArgumentParser())._actions if a.option_strings[0] != "-h"]
    assert flags and [f for f in flags if f"`{f}" not in page] == []


def test_readme_is_a_short_page_that_links_every_doc():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    quickstart = text[text.index("## Quickstart"):].split("```")[1]
    assert quickstart.split("\n")[1:4] == ['pip install -e ".[dev]"', "megatron-dhp demo", "python -m pytest -q"]
    assert [p.name for p in PAGES if f"(docs/{p.name})" not in text] == []


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: p.name)
def test_links_and_paths_resolve(page):
    text = page.read_text()
    for target in LINK.findall(text):
        if target.startswith(("http://", "https://")):
            continue
        file, _, anchor = target.partition("#")
        resolved = (page.parent / file) if file else page
        assert resolved.is_file(), f"{page.name}: link {target!r} points at nothing"
        if anchor and resolved.suffix == ".md":
            assert anchor in _anchors(resolved), f"{page.name}: link {target!r} has no such heading"
    for path in PATH.findall(text):
        roots = (REPO, REPO / "megatron_dhp", REPO / "docs")
        assert any((root / path).exists() for root in roots), f"{page.name}: `{path}` does not exist"
