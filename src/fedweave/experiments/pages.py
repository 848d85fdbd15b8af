"""The generated sections of a reproduction page.

A page, ``docs/reproductions/<paper>.md``, marks what the pipeline writes as blocks::

    <!-- generated: NAME -->
    ...
    <!-- end generated -->

and its study renders each NAME from the committed records beside the page (``Study.sections``), so that a
page's claim tables are never edited by hand: ``fedweave reproduce NAME ... --page PAGE`` rewrites the blocks
after the report, and the suite checks that the committed blocks are what the records render.
"""

from __future__ import annotations

import re
from pathlib import Path

from fedweave.config import ConfigError
from fedweave.results import atomic_write

BLOCK = re.compile(r"<!-- generated: (?P<name>[\w./-]+) -->\n(?P<body>.*?)<!-- end generated -->", re.S)


def blocks(page: str) -> dict[str, str]:
    """The generated blocks of a page's text, by name: their bodies as the page holds them."""
    return {m["name"]: m["body"] for m in BLOCK.finditer(page)}


def fill(page: str, sections: dict[str, str], where: str = "the page") -> str:
    """``page`` with the body of every generated block replaced by its rendered section; a block the study
    does not render, or a section without its block, is a ConfigError naming it."""
    names = list(blocks(page))
    if missing := sorted(set(sections) - set(names)):
        raise ConfigError(f"{where} has no block '<!-- generated: {missing[0]} -->' for the section {missing[0]!r}")
    if unknown := sorted(set(names) - set(sections)):
        raise ConfigError(f"{where}: no section renders the generated block {unknown[0]!r}")
    return BLOCK.sub(lambda m: f"<!-- generated: {m['name']} -->\n{sections[m['name']]}<!-- end generated -->", page)


def update(path: str | Path, sections: dict[str, str]) -> bool:
    """Rewrite the generated blocks of the page at ``path`` (atomically, only when they change); whether
    they changed."""
    path = Path(path)
    page = path.read_text(encoding="utf-8")
    new = fill(page, sections, str(path))
    if new != page:
        atomic_write(path, new)
    return new != page


def table_after(text: str, heading: str, where: str = "the file") -> str:
    """The first markdown table after the line that starts with ``heading`` in ``text`` (a committed report),
    with its newline: a page's copy of a report's table is a generated block, so an edit of it is found."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(heading)), None)
    if start is None:
        raise ConfigError(f"{where} has no line starting with {heading!r}")
    first = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("|"))
    last = next((i for i in range(first, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "\n".join(lines[first:last]) + "\n"
