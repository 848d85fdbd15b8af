"""The generated sections of a reproduction page.

A page, ``docs/reproductions/<paper>.md``, marks what the pipeline writes as blocks::

    <!-- generated: NAME -->
    ...
    <!-- end generated -->

and its study renders each NAME from the committed records beside the page (``Study.sections``), so that a
page's claim tables are never edited by hand: ``fedweave reproduce NAME ... --page PAGE`` rewrites the blocks
after the report, and the suite checks that the committed blocks are what the records render.

Every other number of a page is declared, with its source, in ``docs/reproductions/<paper>.numbers.yaml``
(``prose_numbers`` finds them; ``tests/test_page_numbers.py`` fails on one the file does not declare).
"""

from __future__ import annotations

import re
import textwrap
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
    with its newline: a page's copy of a report's table is a generated block, so an edit of it is found. A
    missing heading, or no table after it, is a ConfigError of one line naming ``where``."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(heading)), None)
    if start is None:
        raise ConfigError(f"{where} has no line starting with {heading!r}")
    first = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("|")), None)
    if first is None:
        raise ConfigError(f"{where} has no table after the line starting with {heading!r}")
    last = next((i for i in range(first, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "\n".join(lines[first:last]) + "\n"


# A number as a page prints it: 1,187,774 / 36.23 / 1e-8 / 0 (a sign is not part of it), not a digit inside a
# word or name (C1, F-EMNIST, CIFAR-10, fig9, s0, v2.1).
NUMBER = re.compile(r"(?<![\w.])(?<![A-Za-z_]-)(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?(?:e[-+]?\d+)?)(?![\w])")
# what names a place rather than states a value: a paper's figure, table, equation or section (Figs. 3-7, Eq. (14),
# §9.3, spec 9.1, Table 4, Alg. 1), a date (26 Nov 2026), an arXiv number, a heading's or a list item's own numbering
_NUM = r"\(?\d+(?:\.\d+)*[a-z]?\)?"
_ONE = r"Fig\.|Figure|Eq\.|eq\.|Table|§|Thm\.|Theorem|Alg\.|Algorithm|Appendix|App\.|Section|section|Sec\.|[Ss]pec"
_ONE += r"|Lemma|Assumption|Remark|Corollary|Proposition"
_MANY = r"Figs\.|Figures|Eqs\.|eqs\.|Tables|Sections|sections"  # a list after these: Figs. 6, 7 and 9
REFERENCE = re.compile(
    rf"(?:{_MANY})\s*{_NUM}(?:\s*(?:[–-]|and|or|,|/)\s*{_NUM})*|(?:{_ONE})\s*{_NUM}(?:\s*[–/-]\s*{_NUM})?"
    r"|\b\d{1,2} (?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]* \d{4}\b"
    r"|arXiv:? ?\d+\.\d+"
    r"|^#+ \d+[a-z]?\.|^\s*\d+\. "
)
HISTORY = "## History"


def paragraph(text: str) -> str:
    """A generated sentence of a page's prose, wrapped at the pages' 110 columns (no word or hyphen broken)."""
    return textwrap.fill(text, 110, break_long_words=False, break_on_hyphens=False) + "\n"


def normal(token: str) -> str:
    """A number as declared and compared: without thousands separators (1,400 and 1400 are one number)."""
    return token.replace(",", "")


def prose_numbers(page: str) -> list[tuple[int, str]]:
    """(line, number) for every number of a page's text that no generated block holds: outside the blocks, the
    HTML comments, the targets of links and the section ``## History`` (whose dated entries record past values,
    before and after a change, that no committed record holds any more), and other than the places
    ``REFERENCE`` names (figures, tables, sections, dates). Code spans and fenced code count: a command's
    ``--seeds 5`` states a setting."""
    text = BLOCK.sub(lambda m: "\n" * m[0].count("\n"), page)
    text = re.sub(r"<!--.*?-->", lambda m: "\n" * m[0].count("\n"), text, flags=re.S)
    out, history = [], False
    for i, line in enumerate(text.split("\n"), 1):
        if line.startswith("## "):
            history = line.startswith(HISTORY)
        if history:
            continue
        line = REFERENCE.sub(" ", re.sub(r"\]\([^)]*\)", "]", line))
        out += [(i, token) for token in NUMBER.findall(line)]
    return out


# what a report says after its wall time where its invocation reused runs (``study.Plan.reused_note``): a pattern's
# optional group, so that the page's prose reads the note beside the seconds it qualifies
REUSED_NOTE = r"( \(\d+ of \d+ runs reused from an earlier invocation, not in this time\))?"


def stated(path: str | Path, pattern: str) -> tuple[str, ...]:
    """The groups of the first match of ``pattern`` in the committed file at ``path``: values its report states
    (a wall time, a count of runs) that a page's prose reads; a ConfigError naming the file and the pattern when it
    states none (a report written by other code, or edited by hand)."""
    if (m := re.search(pattern, Path(path).read_text(encoding="utf-8"))) is None:
        raise ConfigError(f"{path} states nothing that matches '{pattern}'")
    return m.groups()
