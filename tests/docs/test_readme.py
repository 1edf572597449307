"""The README stays a few screens long, and every link of it and of the docs pages it reaches resolves
to a file of the repository (and to a heading, where it names one)."""

from __future__ import annotations

import pytest

from tests.docs.pages import README, ROOT, anchors, links, local_target, pages

MAX_LINES = 250
MAX_CHARS = 20_000


def test_readme_fits_on_a_few_screens() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= MAX_LINES, "README.md: move detail into a docs/ page"
    assert len(text) <= MAX_CHARS, "README.md: move detail into a docs/ page"


def test_the_readme_reaches_every_docs_page() -> None:
    reached = set(pages())
    orphans = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md") if p not in reached)
    assert not orphans, f"docs pages no link from the README leads to: {orphans}"


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve_inside_the_repository(page) -> None:  # type: ignore[no-untyped-def]
    broken = []
    for target in links(page):
        path = local_target(page, target)
        if path is None:
            if target.startswith("#") and target[1:] not in anchors(page):
                broken.append(f"{target} (no such heading)")
            continue
        if not path.is_relative_to(ROOT):
            broken.append(f"{target} (outside the repository)")
        elif not path.exists():
            broken.append(f"{target} (no such file)")
        elif "#" in target and path.suffix == ".md" and target.split("#", 1)[1] not in anchors(path):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"
