"""The documentation stays a reference: no dated measurement in runtime code (numbers live in
BENCHMARKS.md; a comment says why and links the section), README.md and RELIABILITY.md within
their lengths, and every relative link in them and in docs/ pointing at a file and heading that
exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ("pd", "prefill", "decode", "transfer")
_MONTHS = (
    "January|February|March|April|May|June|July|August|September|October|November|December"
    "|Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec"
)
DATED = re.compile(
    rf"\b(?:(?:19|20)\d\d-\d\d-\d\d|(?:{_MONTHS})\.? +(?:19|20)\d\d)\b|\bmeasured\b",
    re.IGNORECASE,
)
MAX_LINES = {"README.md": 400, "RELIABILITY.md": 450}


def _runtime_files() -> list[Path]:
    return sorted(
        p for folder in RUNTIME for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".cpp")
    )


def test_no_dated_measurement_in_runtime_code() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in _runtime_files()
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if DATED.search(line)
    ]
    assert not found, (
        "a date or a measurement in runtime code: say why in one line and link the "
        'BENCHMARKS.md section (e.g. (BENCHMARKS.md, "CPU weight formats")):\n' + "\n".join(found)
    )


@pytest.mark.parametrize("name", sorted(MAX_LINES))
def test_top_level_docs_stay_short(name: str) -> None:
    num_lines = len((ROOT / name).read_text().splitlines())
    assert num_lines <= MAX_LINES[name], f"{name}: {num_lines} lines, at most {MAX_LINES[name]}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out: set[str] = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not (m := re.match(r"#{1,6} +(.*)", line)):
            continue
        slug = _slug(m.group(1))
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


def _docs() -> list[Path]:
    return [ROOT / "README.md", ROOT / "RELIABILITY.md", ROOT / "BENCHMARKS.md"] + sorted(
        (ROOT / "docs").rglob("*.md")
    )


def test_relative_links_point_at_files_and_headings_that_exist() -> None:
    broken = []
    for doc in _docs():
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.DOTALL)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            if not path.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
