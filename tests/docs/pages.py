"""The pages the docs tests read, and what they hold: fenced blocks, shell commands, links.

The pages are the README and every ``docs/`` page it links, followed link by link (a page linked only
from another docs page counts too). A fenced block's language decides what it is: ``bash``, ``sh``,
``shell`` and ``console`` blocks hold commands, one per line (a trailing backslash and a quoted string
may carry a command over several lines; ``#`` starts a comment), ``python`` and ``toml`` blocks hold
code; anything else (``text``, no language) is shown, not run."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SHELL_LANGS = frozenset({"bash", "sh", "shell", "console"})

_FENCE = re.compile(r"^```([\w+-]*)[^\n]*\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


@dataclass(frozen=True)
class Block:
    page: Path
    lang: str
    text: str

    @property
    def where(self) -> str:
        return str(self.page.relative_to(ROOT))


def fenced_blocks(page: Path) -> list[Block]:
    return [Block(page, m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(page.read_text(encoding="utf-8"))]


def links(page: Path) -> list[str]:
    """Every link and image target of ``page``, outside fenced blocks."""
    text = _FENCE.sub("", page.read_text(encoding="utf-8"))
    return [*_LINK.findall(text), *_IMAGE.findall(text)]


def local_target(page: Path, target: str) -> Path | None:
    """The file a relative link names (its ``#anchor`` dropped); None for a URL or a bare anchor."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
        return None
    return (page.parent / target.split("#", 1)[0]).resolve()


def pages() -> list[Path]:
    """The README, then each Markdown page under ``docs/`` it reaches through links, in link order."""
    docs = (ROOT / "docs").resolve()
    seen: list[Path] = [README]
    for page in seen:
        for target in links(page):
            path = local_target(page, target)
            if path is not None and path.suffix == ".md" and path.is_relative_to(docs) and path not in seen:
                if path.is_file():
                    seen.append(path)
    return seen


def commands(block: Block) -> list[list[str]]:
    """The shell commands of a block as argument lists (comments dropped, continuations joined)."""
    out: list[list[str]] = []
    pending = ""
    for line in block.text.replace("\\\n", " ").splitlines():
        pending = f"{pending}\n{line}" if pending else line
        try:
            argv = shlex.split(pending, comments=True)
        except ValueError:  # a quoted string goes on over the next line
            continue
        pending = ""
        if argv:
            out.append(argv)
    if pending:
        raise ValueError(f"{block.where}: unterminated command {pending!r}")
    return out


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of ``page``'s headings: lower case, punctuation dropped, spaces as hyphens."""
    text = _FENCE.sub("", page.read_text(encoding="utf-8"))
    return {
        re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        for heading in re.findall(r"^#{1,6} (.+)$", text, re.MULTILINE)
    }
