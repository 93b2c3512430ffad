"""The repository holds its own design document, and every reference into it points at a real section.

Code, docstrings and docs cite ``docs/design.md §N``; Markdown links to it with an anchor. A
section renumbered or renamed, or a reference to a document outside the repository, fails here.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from plugins.readme_page import github_slug

REPO = Path(__file__).resolve().parents[1]
DESIGN = REPO / "docs/design.md"
# The shared document the references used to name, spelled so that this file does not name it.
OLD_NAME = "DESIGN" + ".md"
TEXT_SUFFIXES = {".py", ".md", ".html", ".json", ".toml", ".sh", ".yaml", ".yml", ".cfg", ".ini", ".txt", ".jinja", ".j2"}
SKIPPED_PARTS = {".venv", ".cache", ".git", "__pycache__"}

HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
SECTION_NUMBER = re.compile(r"^(\d+(?:\.\d+)*)\.?\s")
# "docs/design.md §3.3" (or its relative form from a file in docs/), and in the design document itself a bare "§3.1".
REFERENCE = re.compile(r"design\.md\s*§\s*(\d+(?:\.\d+)*)")
BARE_REFERENCE = re.compile(r"§\s*(\d+(?:\.\d+)*)")
# A Markdown link (inline form) and its target: [text](target)
LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def repository_files() -> list[Path]:
    """Tracked files plus untracked ones git does not ignore, text files only, outside tool folders."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout.split("\0")
    files = []
    for name in sorted(set(filter(None, listed))):
        path = REPO / name
        parts = set(Path(name).parts)
        if parts & SKIPPED_PARTS or any(p.endswith(".egg-info") for p in parts) or not path.is_file():
            continue
        if path.suffix in TEXT_SUFFIXES or path.name in ("Makefile", "Dockerfile") or Path(name).parts[0] == "docker":
            files.append(path)
    return files


def read_text(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    return None if "\0" in text else text


def design_headings() -> list[str]:
    """The headings of docs/design.md (outside code blocks), as written."""
    headings, fenced = [], False
    for line in DESIGN.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        match = None if fenced else HEADING.match(line)
        if match:
            headings.append(match.group(2))
    return headings


def design_sections() -> set[str]:
    """Section numbers of docs/design.md's headings: "1" for "## 1. What…", "3.3" for "### 3.3 Training dataset"."""
    return {m.group(1) for h in design_headings() if (m := SECTION_NUMBER.match(h))}


def design_anchors() -> set[str]:
    anchors: set[str] = set()
    for heading in design_headings():
        slug = github_slug(heading)
        n = 1
        while slug in anchors:  # GitHub suffixes repeated headings with -1, -2, …
            slug, n = f"{github_slug(heading)}-{n}", n + 1
        anchors.add(slug)
    return anchors


def matches(pattern_for: Callable[[Path], re.Pattern[str]]) -> Iterator[tuple[Path, int, re.Match[str]]]:
    """``(file relative to the repository, line, match)`` of each match of the file's pattern in every text file."""
    for path in repository_files():
        text = read_text(path)
        if text is None:
            continue
        for match in pattern_for(path).finditer(text):
            yield path.relative_to(REPO), text.count("\n", 0, match.start()) + 1, match


def test_the_design_document_keeps_its_section_numbers() -> None:
    """§1 … §12, §3.1 … §3.6 and §4.1 are what the code has always cited."""
    expected = {str(n) for n in range(1, 13)} | {f"3.{n}" for n in range(1, 7)} | {"4.1"}
    assert expected <= design_sections()


def test_no_file_names_the_design_document_outside_the_repository() -> None:
    """Every reference to the design document is to docs/design.md (a relative link from a file in docs/), never the shared one."""
    bad = []
    for rel, line, match in matches(lambda path: re.compile(r"[\w./-]*design\.md", flags=re.IGNORECASE)):
        name = match.group(0)
        in_repo = name.endswith("docs/design.md") and "shared" not in name.lower()
        relative_in_docs = rel.parts[0] == "docs" and name == DESIGN.name
        if OLD_NAME in name or not (in_repo or relative_in_docs):
            bad.append(f"{rel}:{line}: {name}")
    assert bad == [], "references to a design document that is not docs/design.md:\n" + "\n".join(bad)


def test_every_section_reference_names_a_section_of_the_design_document() -> None:
    sections = design_sections()
    bad = [f"{rel}:{line}: §{match.group(1)}"
           for rel, line, match in matches(lambda path: BARE_REFERENCE if path == DESIGN else REFERENCE)
           if match.group(1) not in sections]
    assert bad == [], f"references to sections docs/design.md does not have ({sorted(sections)}):\n" + "\n".join(bad)


def test_every_markdown_link_into_the_design_document_finds_its_heading() -> None:
    anchors = design_anchors()
    bad, checked = [], 0
    for path in repository_files():
        if path.suffix != ".md":
            continue
        text = read_text(path) or ""
        rel = path.relative_to(REPO)
        for match in LINK.finditer(text):
            target = match.group(1)
            file_part, _, anchor = target.partition("#")
            if re.match(r"^[a-z]+:", file_part):
                continue  # another site
            resolved = path if not file_part else (path.parent / file_part).resolve()
            if resolved != DESIGN.resolve():
                continue
            checked += 1
            line = text.count("\n", 0, match.start()) + 1
            if anchor and anchor not in anchors:
                bad.append(f"{rel}:{line}: #{anchor}")
    assert checked, "no Markdown file links to docs/design.md"
    assert bad == [], f"links to headings docs/design.md does not have (it has {sorted(anchors)}):\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("heading", "slug"),
    [
        ("3.3 Training dataset", "33-training-dataset"),
        ("6. Facts about Airflow 3.3.2", "6-facts-about-airflow-332"),
        ("7. The seed's lessons, as checks the product makes itself", "7-the-seeds-lessons-as-checks-the-product-makes-itself"),
        ("Drafter families: EAGLE-3 or DFlash (`draft_algorithm`)", "drafter-families-eagle-3-or-dflash-draft_algorithm"),
    ],
)
def test_github_slug(heading: str, slug: str) -> None:
    """The last one is a README heading the README itself links to: GitHub's own anchor."""
    assert github_slug(heading) == slug
