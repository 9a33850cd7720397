"""The docs site: the configuration reference is generated from the code, and the pages the
navigation names exist."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def generator():
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reference_page_is_what_the_generator_writes_now():
    """docs/guide/reference.md is docs/gen_reference.py's output for the CLI and AdaptConfig as
    they are: a changed option or hyper-parameter fails here until the page is regenerated
    (``.venv/bin/python docs/gen_reference.py``)."""
    committed = (DOCS / "guide" / "reference.md").read_text()
    assert committed == generator().render(), (
        "docs/guide/reference.md is stale: run .venv/bin/python docs/gen_reference.py")


def test_the_reference_names_every_option_and_every_hyper_parameter():
    from dataclasses import fields

    from eva0_edge.cli import build_parser
    from eva0_edge.runtime.config import AdaptConfig

    page = generator().render()
    for field in fields(AdaptConfig):
        assert f"| `{field.name}` |" in page, field.name
    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    for name, command in sub.choices.items():
        assert f"### `eva0-edge {name}`" in page
        for action in command._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}" in page, (name, flag)


def test_every_page_in_the_navigation_exists_and_every_page_is_in_it():
    nav = re.findall(r":\s*([\w/.-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), flags=re.M)
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert len(nav) == len(set(nav))
    assert set(nav) == pages
