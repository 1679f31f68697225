"""The documents stay true to the code: docs/flags.md is what launch/flags_doc.py writes from
the parsers now, the README stays short, and no relative link points at a missing file."""
from __future__ import annotations

import difflib
import re
from pathlib import Path

import pytest

from launch import flags_doc

ROOT = Path(__file__).resolve().parents[3]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 150  # issue 23: readable in five minutes
# Issue 54: references, not journals; older runs go to docs/benchmarks-history.md.
REFERENCE_MAX_LINES = {"docs/benchmarks.md": 400, "docs/design.md": 500}

# Links inside code are not links: drop fenced blocks and inline code first.
FENCED = re.compile(r"^```.*?^```", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def test_flags_md_is_what_the_parsers_say():
    committed = (ROOT / "docs" / "flags.md").read_text()
    generated = flags_doc.render()
    if committed != generated:
        diff = "".join(list(difflib.unified_diff(committed.splitlines(True),
                                                 generated.splitlines(True),
                                                 "docs/flags.md", "generated"))[:40])
        pytest.fail(f"docs/flags.md is out of date with the argparse parsers: run "
                    f"`{flags_doc.COMMAND}` and commit the result\n{diff}")


def test_readme_is_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, at most {README_MAX_LINES}: move detail into docs/")


@pytest.mark.parametrize("name", sorted(REFERENCE_MAX_LINES))
def test_reference_documents_stay_within_their_cap(name):
    lines = len((ROOT / name).read_text().splitlines())
    assert lines <= REFERENCE_MAX_LINES[name], (
        f"{name} has {lines} lines, at most {REFERENCE_MAX_LINES[name]}: move earlier runs or "
        "history to docs/benchmarks-history.md")


def relative_links(text: str) -> list[str]:
    text = INLINE_CODE.sub("", FENCED.sub("", text))
    return [t for t in LINK.findall(text)
            if not re.match(r"[a-z][a-z0-9+.-]*:", t, re.I) and not t.startswith("#")]


def test_relative_links_point_at_files_that_exist():
    missing = []
    for doc in DOCUMENTS:
        for target in relative_links(doc.read_text()):
            path = target.split("#", 1)[0]
            if not (doc.parent / path).exists():
                missing.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not missing, "links to missing files:\n" + "\n".join(missing)


def test_the_link_check_sees_links():
    # Guards the regular expressions: a check that finds no links would pass on anything.
    sample = "[a](docs/x.md) [b](https://e.org) `[c](no.md)` [d](#top) [e](y.md#part)"
    assert relative_links(sample) == ["docs/x.md", "y.md#part"]
    assert any(relative_links((ROOT / "README.md").read_text()))


def grpcurl_lines(doc: Path) -> list[str]:
    return [ln.strip() for ln in doc.read_text().splitlines()
            if ln.strip().startswith(".venv/bin/grpcurl -plaintext ")]


def test_the_api_reference_shows_only_grpcurl_lines_that_are_run():
    # tests/integration/test_integration_rpcs.py runs the README's grpcurl lines; docs/api.md repeats them
    # beside what they answer, so a line there that the README lacks would go untested.
    readme = set(grpcurl_lines(ROOT / "README.md"))
    untested = [ln for ln in grpcurl_lines(ROOT / "docs" / "api.md") if ln not in readme]
    assert not untested, "grpcurl lines in docs/api.md that README.md lacks:\n" + "\n".join(untested)
