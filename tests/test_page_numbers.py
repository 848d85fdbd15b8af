"""Every number of a reproduction page is generated or declared.

A number of ``docs/reproductions/<name>.md`` is either inside a generated block (rendered from the committed
records; ``test_reproduction_pages.py`` checks the blocks byte for byte), or in the table of what a paper-scale run
needs (checked against the committed ``paper-scale.csv`` there too), or declared with its source in
``docs/reproductions/<name>.numbers.yaml``: ``paper``, ``setup`` or ``derived``, each with the place it comes from,
the number of times the page states it (``count``: an edit of one declared number into another changes two counts)
and, where simple, a ``check`` that recomputes it from the study's presets, the paper's numbers in the code or the
closed forms. The section ``## History`` is exempt: its dated entries record values before and after a change, which
no committed record holds any more (``fedweave.experiments.pages.prose_numbers``).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from collections import Counter
from pathlib import Path

import pytest
import yaml

from fedweave.experiments.pages import NUMBER, normal, prose_numbers, table_after

ROOT = Path(__file__).parents[1]
PAGES = ROOT / "docs" / "reproductions"
DECLARED = sorted(p.name.removesuffix(".numbers.yaml") for p in PAGES.glob("*.numbers.yaml"))
SOURCES = ("paper", "setup", "derived")
MODULES = {"cse-fsl": "fedweave.reproduce.cse_fsl", "zo-hfl": "fedweave.reproduce.zo_hfl"}
MODULES |= {"cfl-saga": "fedweave.reproduce.cfl_saga", "afind": "fedweave.reproduce.afind_plus"}
MODULES |= {"fedmim": "fedweave.reproduce.fedmim"}
PAPER_SCALE = "## What a paper-scale run needs"


def _paper_scale_cost():
    spec = importlib.util.spec_from_file_location("paper_scale_cost", ROOT / "benchmarks" / "paper_scale_cost.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load(name: str) -> dict:
    return yaml.safe_load((PAGES / f"{name}.numbers.yaml").read_text(encoding="utf-8"))


def declarations(name: str) -> dict[str, dict]:
    """The page's declared numbers by their normal form (``pages.normal``); ``_let`` names the checks' helpers."""
    return {normal(str(value)): entry for value, entry in _load(name).items() if value != "_let"}


def scanned(name: str, page: str) -> list[tuple[int, str]]:
    """The page's numbers outside its generated blocks and History, less those of its paper-scale table when
    that table is the committed estimate's (``test_the_paper_scale_table_is_the_committed_estimate``)."""
    found = prose_numbers(page)
    if PAPER_SCALE in page:
        from fedweave.experiments.tables import read_csv

        table = table_after(page, PAPER_SCALE)
        if table == _paper_scale_cost().page_table(
            read_csv(PAGES / "paper-scale.csv"), read_csv(PAGES / "paper-scale-gpu.csv"), name
        ):
            first = page[: page.index(table)].count("\n") + 1
            rows = range(first, first + table.count("\n"))
            found = [(i, t) for i, t in found if i not in rows]
    return found


def problems(name: str, page: str, declared: dict[str, dict]) -> list[str]:
    """What is wrong with the page's numbers against its declarations: ``PAGE:LINE: NUMBER`` for a number that
    is neither generated nor declared, and a line for every declared number the page states another number of
    times than its ``count`` (so that an edit of one declared number into another is found too)."""
    found = scanned(name, page)
    bad = [f"{name}.md:{i}: {t}" for i, t in found if normal(t) not in declared]
    stated = Counter(normal(t) for _, t in found)
    for value, entry in declared.items():
        if stated[value] != entry.get("count"):
            lines = [i for i, t in found if normal(t) == value]
            bad.append(f"{name}.md states {value} {stated[value]} times (lines {lines}), declared {entry.get('count')}")
    return bad


def test_every_reproduction_page_declares_its_numbers():
    assert sorted(p.stem for p in PAGES.glob("*.md")) == DECLARED, "a page without its .numbers.yaml"


@pytest.mark.parametrize("name", DECLARED)
def test_every_number_outside_the_generated_blocks_is_declared(name):
    page = (PAGES / f"{name}.md").read_text(encoding="utf-8")
    bad = problems(name, page, declarations(name))
    assert not bad, f"numbers neither generated nor declared in {name}.numbers.yaml:\n" + "\n".join(bad)


@pytest.mark.parametrize("name", DECLARED)
def test_every_declaration_names_its_source(name):
    for value, entry in declarations(name).items():
        assert entry.get("source") in SOURCES, f"{name}.numbers.yaml: {value}: source must be one of {SOURCES}"
        assert entry.get("where"), f"{name}.numbers.yaml: {value}: no `where`"


def _decimals(value: str) -> int:
    return len(value.split(".")[1]) if "." in value else 0


def _holds(value: str, got) -> bool:
    """Whether ``got`` (a number, or a collection of them) gives ``value`` at its printed decimals."""
    if isinstance(got, list | tuple | set | frozenset):
        return any(_holds(value, g) for g in got)
    if "e" in value:  # 1e-8, 1e6: the number itself
        return math.isclose(float(got), float(value), rel_tol=1e-9)
    return round(float(got), _decimals(value)) == float(value)


@pytest.mark.parametrize("name", DECLARED)
def test_declared_checks_give_their_numbers(name):
    from fedweave.accounting import split

    namespace = {**vars(importlib.import_module(MODULES[name])), "split": split, "importlib": importlib}
    namespace["paper_scale_cost"] = _paper_scale_cost()
    for helper, expression in _load(name).get("_let", {}).items():  # names the checks share, in order
        namespace[helper] = eval(str(expression), namespace)  # noqa: S307
    checked = 0
    for value, entry in declarations(name).items():
        checks = entry.get("check", [])
        for expression in [checks] if isinstance(checks, str) else checks:
            got = eval(expression, namespace)  # noqa: S307 -- the committed declaration file's own expressions
            assert _holds(value, got), f"{name}.numbers.yaml: {value}: {expression} gives {got!r}"
            checked += 1
    assert checked, f"{name}.numbers.yaml checks nothing"


def test_the_history_generated_blocks_references_and_dates_are_not_scanned():
    page = (
        "# T\n\nSee Fig. 9a, Figs. 3–7, Eq. (14), §9.3 and Table 4 of arXiv 2402.18018; C1 on CIFAR-10, `--seeds 5`.\n"
        "## 2. Part\n\n1. first step, [file](a/b-2.md)\n"
        "<!-- generated: x -->\n| 97.15 |\n<!-- end generated -->\n"
        "3,000 images, 1e-8 and h=14\n## History\n\n- 26 Nov 2026: 83.25 → 83.07.\n## After\n0.5\n"
    )
    assert prose_numbers(page) == [(3, "5"), (10, "3,000"), (10, "1e-8"), (10, "14"), (15, "0.5")]
    # a list goes on only after a plural (Figs. 6, 7); after one figure, a number is a number again
    assert prose_numbers("Figs. 6, 7 and 9, Fig. 7/8; spec 9.1, Fig. 2, 3 seeds") == [(1, "3")]


def _edit(page: str, line: int, old: str, new: str) -> str:
    """``page`` with the number ``old`` on ``line`` (its first occurrence as a number) replaced by ``new``."""
    lines = page.split("\n")
    hit = next(m for m in NUMBER.finditer(lines[line - 1]) if m[0] == old)
    lines[line - 1] = lines[line - 1][: hit.start()] + new + lines[line - 1][hit.end() :]
    return "\n".join(lines)


@pytest.mark.parametrize("name", DECLARED)
def test_an_edited_prose_or_table_number_is_found(name):
    """A copy of the page with one prose number edited fails, naming the page, the line and the number; so does
    one with a number of a table outside the generated blocks edited (a hand-written table's, or the paper-scale
    table's, which is then no longer the committed estimate), and one with a declared number changed into
    another declared number (the counts); the page as committed passes."""
    page = (PAGES / f"{name}.md").read_text(encoding="utf-8")
    declared = declarations(name)
    assert not problems(name, page, declared)
    lines = page.split("\n")
    prose = [(i, t) for i, t in scanned(name, page) if not lines[i - 1].startswith("|")]
    i, token = prose[len(prose) // 2]
    assert f"{name}.md:{i}: {token}1" in problems(name, _edit(page, i, token, token + "1"), declared)
    tables = [(i, t) for i, t in prose_numbers(page) if lines[i - 1].startswith("|")]
    assert tables, f"{name}.md has no table outside its generated blocks"
    i, token = tables[-1]
    assert f"{name}.md:{i}: {token}1" in problems(name, _edit(page, i, token, token + "1"), declared)
    i, token = prose[0]
    other = next(v for v in declared if v != normal(token) and "," not in token and "e" not in v)
    bad = problems(name, _edit(page, i, token, other), declared)
    assert any(b.startswith(f"{name}.md states {other} ") for b in bad), bad
