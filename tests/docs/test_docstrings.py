"""No dates in docstrings: a docstring says what the code does and why, and git keeps when. A date
inside a quoted literal (an example SQL timestamp) is an example, not a dated note."""

from __future__ import annotations

import ast
import re

from tests.docs.pages import ROOT

DATE = re.compile(r"(?<!['\d])\b20\d\d-[01]\d(-[0-3]\d)?\b")
_SKIP = frozenset({"tests", "docs", ".venv", "results", "profiles"})


def _docstrings(tree: ast.AST) -> list[ast.Constant]:
    """Every string that stands alone as a statement: module, class, function and attribute docstrings."""
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    ]


def test_no_dated_notes_in_docstrings() -> None:
    dated = []
    for path in sorted(ROOT.glob("*/**/*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in _SKIP or rel.parts[0].startswith("."):
            continue
        for doc in _docstrings(ast.parse(path.read_text(encoding="utf-8"))):
            for match in DATE.finditer(str(doc.value)):
                dated.append(f"{rel}:{doc.lineno}: {match.group()}")
    assert not dated, f"dates in docstrings (git keeps the history): {dated}"


def test_the_check_sees_a_dated_note() -> None:
    tree = ast.parse('"""Measured 2026-12-04 on one host."""\nX = 1\n"""Until 2026-12 it was 2."""\n')
    assert [bool(DATE.search(str(d.value))) for d in _docstrings(tree)] == [True, True]
    assert not DATE.search("a filter such as t_arrival >= TIMESTAMP '2026-12-01 10:00'")
