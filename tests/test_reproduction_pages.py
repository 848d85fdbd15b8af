"""Every reproduction page agrees with the result files committed beside it.

For each claim table of ``docs/reproductions/<name>.md`` (a table whose first column is ``claim``), every
number in the row must occur in the files of ``docs/reproductions/<name>/`` (at the precision the page
prints), and the row's verdict must be the file's verdict for that claim, word for word. A claim the
generated files do not evaluate must say which committed plot it was read from.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

PAGES = Path(__file__).parents[1] / "docs" / "reproductions"
NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?", re.IGNORECASE)
# a declared rule's line, alone or (ZO-HFL) followed by the means' criterion
DECLARED = re.compile(
    r"n=\d+: (held|did not hold|inconclusive)( \(the means' criterion: [\w ]+\))?$|^untestable by a declared rule"
)


def _norm(text: str) -> str:
    return text.replace("−", "-").replace("\u2009", "")


def claim_tables(md: str) -> list[list[list[str]]]:
    """The rows (lists of cells) of every table whose header starts with ``| claim``."""
    lines, tables, i = md.splitlines(), [], 0
    while i < len(lines):
        if lines[i].startswith("| claim"):
            rows, i = [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append([c.strip() for c in lines[i].strip().strip("|").split("|")])
                i += 1
            tables.append(rows)
        i += 1
    return tables


def result_text(name: str, pattern: str = "*") -> str:
    """The text of every result file beside the page, in its folder and the folders below it."""
    files = [f for f in sorted((PAGES / name).rglob(pattern)) if f.suffix in (".md", ".csv", ".json")]
    assert files, f"docs/reproductions/{name}/ has no result files"
    return _norm("\n".join(f.read_text(encoding="utf-8") for f in files))


def _decimals(token: str) -> int:
    mantissa = token.replace(",", "").lower().split("e")[0]
    return len(mantissa.split(".")[1]) if "." in mantissa else 0


def missing_numbers(cells: list[str], source: str) -> list[str]:
    """Numbers of ``cells`` that no number of ``source`` equals at the precision the cell prints."""
    values = [float(t.replace(",", "")) for t in NUMBER.findall(source)]
    out = []
    for token in (t for cell in cells for t in NUMBER.findall(_norm(cell))):
        v = float(token.replace(",", ""))
        if "e" in token.lower():
            ok = any(math.isclose(v, f, rel_tol=1e-9) for f in values)
        else:
            d = _decimals(token)
            ok = any(abs(round(f, d) - v) < 0.5 * 10**-d + 1e-12 for f in values)
        if not ok:
            out.append(token)
    return out


def _claim_id(text: str) -> str:
    m = re.match(r"(C\d+)\b", text)
    return m.group(1) if m else text


def test_pages_have_claim_tables_and_result_files():
    for name in ("afind", "cfl-saga", "cse-fsl", "fedmim", "zo-hfl"):
        assert claim_tables((PAGES / f"{name}.md").read_text(encoding="utf-8")), name
        assert result_text(name)


@pytest.mark.parametrize("name", sorted(p.stem for p in PAGES.glob("*.md")))
def test_every_number_in_a_claim_table_is_in_the_committed_files(name):
    tables = claim_tables((PAGES / f"{name}.md").read_text(encoding="utf-8"))
    if not tables:
        pytest.skip(f"{name}.md has no claim table")
    source = result_text(name)
    # a declared rule's line (its interval is computed from the records, not a file's number) is checked byte
    # for byte by test_generated_sections_are_what_the_committed_records_render
    cells = [(row[0], [c for c in row[1:] if not DECLARED.search(c)]) for rows in tables for row in rows]
    bad = {claim[:60]: miss for claim, rest in cells if (miss := missing_numbers(rest, source))}
    assert not bad, f"{name}.md: numbers not in docs/reproductions/{name}/: {bad}"


def _file_verdicts(md: str, verdict_col: int) -> dict[str, str]:
    return {_claim_id(r[0]): r[verdict_col] for rows in claim_tables(md) for r in rows}


@pytest.mark.parametrize(
    "block, result_file, storage_file",
    [
        ("claims-fashion_mnist", "table-fashion_mnist.md", "storage-fashion_mnist.md"),
        ("claims-fashion_mnist-noniid", "table-fashion_mnist-noniid.md", "storage-fashion_mnist.md"),
        ("claims-digits", "table-digits.md", "storage-digits.md"),
    ],
    ids=["fashion", "fashion-noniid", "digits"],
)
def test_cse_fsl_verdicts_are_the_files(block, result_file, storage_file):
    """The page's claim table of each committed Table V gives, for every claim, the verdict its table file
    states (the declared rule's, with its interval), and every claim of the file is on the page; C5's is the
    one its model's storage measurement states (a Table V alone judges only its ratio at its one n)."""
    from fedweave.experiments.pages import blocks

    [page] = claim_tables(blocks((PAGES / "cse-fsl.md").read_text(encoding="utf-8"))[block])
    verdicts = _file_verdicts((PAGES / "cse-fsl" / result_file).read_text(encoding="utf-8"), 1)
    storage = _file_verdicts((PAGES / "cse-fsl" / storage_file).read_text(encoding="utf-8"), 1)
    assert set(storage) == {"C5"} and storage["C5"].startswith("all of 10: CSE-FSL copies at n=2")
    assert {_claim_id(row[0]): row[-1] for row in page} == verdicts | storage


def test_afind_verdicts_are_the_files():
    page = claim_tables((PAGES / "afind.md").read_text(encoding="utf-8"))
    verdicts: dict[str, str] = {}
    for f in sorted((PAGES / "afind").rglob("results.md")):
        verdicts.update(_file_verdicts(f.read_text(encoding="utf-8"), 1))
    for rows in page:
        for row in rows:
            assert row[0] in verdicts, f"afind.md claim {row[0]!r} is in no committed results.md"
            assert row[1] == verdicts[row[0]], (row[0], row[1], verdicts[row[0]])


def test_afind_section5_prose_places_the_mean_gain_where_its_claim_row_does():
    """The prose may say the mean gain over the plug-ins is within section 5's band (+3 ± 1.5 points) only
    where the claim table's estimate (points from +3) is inside it: Fig. 5(b)'s is +2.99 (a mean gain of 5.99),
    which its verdict paragraph called "within 1.5 points of the paper's +3"."""
    page = (PAGES / "afind.md").read_text(encoding="utf-8")
    prose = " ".join(page.split())
    for heading, claim in (("### Fig. 5:", "Section 5: the improvement"), ("### Fig. 5(b)", "Section 5 on Fig. 5(b)")):
        row = next(line for line in page.splitlines() if line.startswith(f"| {claim}"))
        estimate = float(re.search(r"\| ([+-][\d.]+) points from \+3 ", row)[1])
        start = prose.index(heading)
        section = prose[start : prose.index("### ", start + 4)]
        if abs(estimate) >= 1.5:
            assert "within 1.5 points of the paper's +3" not in section, (heading, estimate)


@pytest.mark.parametrize("name", sorted(p.stem for p in PAGES.glob("*.md")))
def test_every_claim_table_is_a_generated_block(name):
    """A page's claim tables (a header that starts with ``| claim``) are all generated blocks, none written by
    hand: each is then what its study renders from the committed records, byte for byte
    (``test_generated_sections_are_what_the_committed_records_render``), so an edited verdict word fails."""
    from fedweave.experiments.pages import BLOCK

    page = (PAGES / f"{name}.md").read_text(encoding="utf-8")
    assert claim_tables(page), f"{name}.md has no claim table"
    hand = [rows[0][0] for rows in claim_tables(BLOCK.sub("", page))]
    assert not hand, f"{name}.md: claim tables outside the generated blocks, first rows {hand}"


def _fedmim_record(split: str, method: str, seed: int, acc: float) -> dict:
    return {"dataset": "d", "split": split, "method": method, "seed": seed, "final_acc": acc, "consistency_last20": 1.0}


def test_fedmim_iid_shrink_claim_is_judged_by_its_declared_rule():
    """The claim that the gain is larger on Dir-0.1 than on IID, by its declared rule (95 % paired t on the seeds'
    differences of the two gaps): held, inconclusive or did not hold as the seeds say, whatever the sign of the
    Dir-0.1 gain."""
    from fedweave.reproduce.fedmim import TABLE_I_CLAIMS

    def outcome(dir_gaps: tuple[float, ...]) -> str:
        rows = []
        for s, gap in enumerate(dir_gaps):  # the IID gap is -1.0 on every seed
            rows += [_fedmim_record("dir0.1", "fedavg", s, 70.0), _fedmim_record("dir0.1", "fedmim", s, 70 + gap)]
            rows += [_fedmim_record("iid", "fedavg", s, 80.0), _fedmim_record("iid", "fedmim", s, 79.0)]
        return TABLE_I_CLAIMS["claim_iid_smaller"].verdict(rows, "d").outcome

    assert outcome((2.0, 2.5, 3.0)) == "held"
    assert outcome((-0.4, -0.5, -0.3)) == "held"  # no Dir-0.1 gain, but a smaller loss than at IID on every seed
    assert outcome((-3.0, 1.0, 2.0)) == "inconclusive"
    assert outcome((-2.0, -2.5, -3.0)) == "did not hold"


def test_cse_fsl_c7_is_untestable_when_fsl_oc_did_not_struggle():
    from fedweave.experiments.study import judge
    from fedweave.reproduce.cse_fsl import CLAIMS, preset

    def c7(oc: float):
        accs = {"fsl_mc": 84.0, "fsl_an": 84.0, "fsl_oc": oc, "cse_fsl h=1": 85.0, "cse_fsl h=5": 83.0}
        accs["cse_fsl h=5 random"] = 83.0
        base = {"load_exact": True, "load_to_target_gib": 1.0, "storage_m": 1.0, "server_copies": 1}
        p = preset("small", "digits")
        p.records = [{"method": m, "seed": s, "accuracy": a + s / 10 * (m == "cse_fsl h=1")} for m, a in accs.items()
                     for s in range(3)]  # fmt: skip
        return {
            v.claim[:2]: v for v in judge(CLAIMS, [{**base, "method": m, "accuracy": a} for m, a in accs.items()], p)
        }["C7"]

    assert c7(85.0).outcome == "untestable"
    assert c7(80.0).outcome == "held"  # h=1 is 6 pp above FSL_OC - 1 pp on every seed


def test_fedmim_gaps_reads_the_checkpoint_rounds_of_every_run(tmp_path):
    from fedweave.experiments.tables import csv_text
    from fedweave.reproduce.fedmim import CORE, GAP_KEYS, PRESETS, gaps, rounds_table

    p = PRESETS["long"]
    accs = {"fedavg": (0.70, 0.80), "fedmim": (0.72, 0.79), "fedcm": (0.71, 0.78), "scaffold": (0.73, 0.81)}
    for m, (a50, a500) in accs.items():
        for seed in (0, 1):
            d = tmp_path / "runs" / f"fashion_mnist-dir0.1-{m}-s{seed}"
            d.mkdir(parents=True)
            rows = [(50, a50 + seed / 100), (150, 0.75), (300, 0.77), (500, a500)]
            (d / "metrics.csv").write_text("round,test_accuracy\n" + "".join(f"{t},{a}\n" for t, a in rows))
    rows = gaps(tmp_path, p, (0, 1, 2))  # seed 2 has no runs: the cells count the seeds that do
    assert "fashion_mnist,dir0.1,fedavg,1,50,71.00,2.00" in csv_text(rows, GAP_KEYS, ".2f")  # 73 - 71 at seed 1
    md = rounds_table(rows, CORE)
    assert "| 50 | 70.50 ± 0.71 | 72.50 ± 0.71 |" in md  # sample std
    assert "| 500 | 80.00 ± 0.00 | 79.00 ± 0.00 | 78.00 ± 0.00 | 81.00 ± 0.00 | −1.00 (−1.00, −1.00)" in md


def _generated_claims(name: str) -> dict[str, list[tuple[str, str, str]]]:
    """Per committed records file beside the page (path relative to its folder): the (claim, verdict,
    measured) rows its reproduce module generates from it for the page (FedMIM: every claim's declared rule on the
    per-seed ``results.csv``; ZO-HFL: the claims of spec §9.2 by their declared rules on each per-seed
    ``results.csv``, with nothing in the measured column)."""
    from fedweave.experiments.tables import read_csv
    from fedweave.reproduce import fedmim, zo_hfl

    out: dict[str, list[tuple[str, str, str]]] = {}
    if name == "zo-hfl":
        for f in sorted((PAGES / name).rglob("results.csv")):
            rows = zo_hfl.verdicts(read_csv(f))
            out[str(f.relative_to(PAGES / name))] = [(v.claim, v.interval, "") for v in rows]
        return out
    for source, v in fedmim.page_verdicts(PAGES / name):  # fedmim
        out.setdefault(source, []).append((v.claim, fedmim.verdict_cell(v), v.measured))
    return out


@pytest.mark.parametrize("name", ["fedmim", "zo-hfl"])
def test_claim_tables_are_the_rows_generated_from_the_committed_claims(name):
    """Every row of the page's claim tables (claim | source | verdict | measured) is, word for word, a row
    the module generates from the claims file it names, and every generated row is on the page."""
    generated = _generated_claims(name)
    page = [row for rows in claim_tables((PAGES / f"{name}.md").read_text(encoding="utf-8")) for row in rows]
    seen = set()
    for claim, source, verdict, *measured in page:  # ZO-HFL's table has no measured column
        measured, source = "".join(measured), source.strip("`")
        assert source in generated, f"{name}.md names {source!r}, not a committed records file"
        assert (_norm(claim), verdict, _norm(measured)) in [(_norm(c), v, _norm(m)) for c, v, m in generated[source]], (
            f"{name}.md: {claim!r} is not the row generated from {source}"
        )
        seen.add((source, _norm(claim)))
    missing = [(f, c) for f, rows in generated.items() for c, _, _ in rows if (f, _norm(c)) not in seen]
    assert not missing, f"{name}.md leaves out claims of its files: {missing}"


@pytest.mark.parametrize("name", ["afind", "cfl-saga", "cse-fsl", "fedmim", "zo-hfl"])
def test_generated_sections_are_what_the_committed_records_render(name):
    """Every page's claim tables are generated blocks, and each block is, byte for byte, what its study renders
    from the committed records beside the page (a hand edit of a number or verdict in a block fails here)."""
    from fedweave.experiments.pages import blocks, fill
    from fedweave.reproduce import study

    page = (PAGES / f"{name}.md").read_text(encoding="utf-8")
    assert any(b == "claims" or b.startswith("claims-") for b in blocks(page)), f"{name}.md has no generated claims"
    assert fill(page, study(name).sections(PAGES / name)) == page


def test_an_edited_generated_number_is_found_and_rewritten(tmp_path):
    from fedweave.experiments.pages import update
    from fedweave.reproduce import study

    page = tmp_path / "zo-hfl.md"
    committed = (PAGES / "zo-hfl.md").read_text(encoding="utf-8")
    edited = committed.replace("] held; 95 % paired t", "] did not hold; 95 % paired t", 1)  # a held rule's verdict
    assert edited != committed
    page.write_text(edited)
    sections = study("zo-hfl").sections(PAGES / "zo-hfl")
    assert update(page, sections) and page.read_text(encoding="utf-8") == committed
    assert not update(page, sections)  # nothing to change: the file is left as it is


@pytest.mark.parametrize("name", ["afind", "cfl-saga", "cse-fsl", "fedmim", "zo-hfl"])
def test_an_edited_number_or_verdict_in_any_generated_block_is_found(name):
    """In every generated block of every page, changing one digit or one verdict word gives a page that is no
    longer what the records render (so the suite fails on it), and filling the blocks restores the page."""
    from fedweave.experiments.pages import BLOCK, fill
    from fedweave.reproduce import study

    page = (PAGES / f"{name}.md").read_text(encoding="utf-8")
    sections = study(name).sections(PAGES / name)
    edits = 0
    for m in BLOCK.finditer(page):
        body = m["body"]
        for pattern, new in ((r"\d", lambda d: str((int(d[0]) + 1) % 10)), (r"inconclusive|did not hold", "held")):
            hit = re.search(pattern, body)
            if hit is None:
                continue
            edited = body[: hit.start()] + (new(hit) if callable(new) else new) + body[hit.end() :]
            bad = page[: m.start("body")] + edited + page[m.end("body") :]
            assert fill(bad, sections) == page != bad, (m["name"], pattern)
            edits += 1
    assert edits, f"{name}.md: no generated number or verdict"


def test_a_copied_table_is_the_reports_and_a_missing_one_is_one_line():
    from fedweave.config import ConfigError
    from fedweave.experiments.pages import table_after

    report = "# r\n\n## Table 1: x\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n## Table 2\n\n| c |\n|---|\n| 3 |\n"
    assert table_after(report, "## Table 1") == "| a | b |\n|---|---|\n| 1 | 2 |\n"
    assert table_after(report, "## Table 2") == "| c |\n|---|\n| 3 |\n"
    with pytest.raises(ConfigError, match=r"^r.md has no line starting with '## Table 4'$"):
        table_after(report, "## Table 4", "r.md")
    # a heading with no table after it (the report's table removed) is one line too, not a StopIteration
    with pytest.raises(ConfigError, match=r"^r.md has no table after the line starting with '## Table 3'$"):
        table_after("# r\n\n## Table 3\n\ntext\n", "## Table 3", "r.md")


@pytest.mark.parametrize("name", ["afind", "cse-fsl", "fedmim"])
def test_the_paper_scale_table_is_the_committed_estimate(name):
    """The page's "What a paper-scale run needs" table is, byte for byte, what ``benchmarks/paper_scale_cost.py``
    renders from the committed ``paper-scale.csv`` and ``paper-scale-gpu.csv`` (an edited number in either fails
    here)."""
    from fedweave.experiments.pages import table_after
    from fedweave.experiments.tables import read_csv

    module = _paper_scale_cost()
    page = (PAGES / f"{name}.md").read_text(encoding="utf-8")
    want = module.page_table(read_csv(PAGES / "paper-scale.csv"), read_csv(PAGES / "paper-scale-gpu.csv"), name)
    assert table_after(page, "## What a paper-scale run needs") == want


def test_fedmim_fedadam_block_states_the_v_init_the_runs_use(monkeypatch):
    """The page's FedAdam settings are the algorithm's: v_init is its default unless the presets set it."""
    from fedweave.algorithms.centralized.fedadam import FedOptHparams
    from fedweave.reproduce import fedmim

    block = fedmim.sections(PAGES / "fedmim")["fedadam"]
    assert f"v_init = {FedOptHparams.v_init:g} (`algorithm.v_init`'s default" in block
    monkeypatch.setitem(fedmim.METHOD_OPTIONS, "fedadam", {**fedmim.METHOD_OPTIONS["fedadam"], "v_init": 1e-4})
    assert "v_init = 0.0001 (`METHOD_OPTIONS`" in fedmim._fedadam_settings()


def test_fedmim_same_cell_table_counts_equal_runs_and_the_largest_difference(tmp_path):
    """The cross-check of the presets that run the small preset's Dir-0.1 Fashion-MNIST configuration pairs their
    runs by method and seed (Table III's J = 0 row as FedAvg, its default row as FedMIM)."""
    from fedweave.reproduce.fedmim import _same_cell_table

    def write(path: str, header: str, rows: list[str]) -> None:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("\n".join([header, *rows]) + "\n", encoding="utf-8")

    write(
        "results.csv",
        "dataset,split,method,seed,final_acc",
        [
            "fashion_mnist,dir0.1,fedavg,0,75.00",
            "fashion_mnist,dir0.1,fedavg,1,76.00",
            "fashion_mnist,iid,fedavg,0,80.00",
            "mnist,dir0.1,fedavg,0,96.00",
        ],
    )
    write(
        "long/gaps.csv", "method,seed,round,accuracy", ["fedavg,0,50,75.00", "fedavg,1,50,75.50", "fedavg,0,150,80.00"]
    )
    write(
        "epochs/results.csv",
        "method,variant,seed,final_acc",
        ["fedavg,E=1,0,75.00", "fedcm,E=1,0,70.00", "fedavg,E=5,0,83.00"],
    )
    write(
        "ablation/results.csv",
        "method,variant,seed,final_acc",
        ["fedmim,J=0 a=- b=-,0,75.00", 'fedmim,"J=2 a=0.6,0.3 b=0.9,0.1",0,74.00', "fedmim,J=1 a=0.5 b=-,0,76.00"],
    )
    table = _same_cell_table(tmp_path)
    assert "| `small` | `long`, round 50 | FedAvg | 1 of 2 | 0.50 |" in table
    assert "| `small` | `epochs`, E = 1 | FedAvg | 1 of 1 | 0.00 |" in table
    assert "| `long`, round 50 | `ablation`, J = 0 and default rows | FedAvg | 1 of 1 | 0.00 |" in table
    assert table.count("\n") == 2 + 6  # every two of the four presets share a run


def _paper_scale_cost():
    import importlib.util

    path = Path(__file__).parents[1] / "benchmarks" / "paper_scale_cost.py"
    spec = importlib.util.spec_from_file_location("paper_scale_cost", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_edited_gpu_number_changes_the_paper_scale_table():
    """The table renders the committed GPU measurements, so an edited one no longer matches the page; the CPU file
    keeps only measurements (no assumed-rate columns)."""
    from fedweave.experiments.tables import read_csv

    module = _paper_scale_cost()
    cpu, gpu = read_csv(PAGES / "paper-scale.csv"), read_csv(PAGES / "paper-scale-gpu.csv")
    page = (PAGES / "fedmim.md").read_text(encoding="utf-8")
    assert module.page_table(cpu, gpu, "fedmim") in page
    for column in ("gpu_hours", "gpu_ms_per_sample", "device"):
        edited = [dict(row) for row in gpu]
        edited[0][column] = 99.0 if column != "device" else "Another GPU"
        assert module.page_table(cpu, edited, "fedmim") not in page, column
    assert not {"h100_hours_low", "h100_hours_high"} & set(cpu[0])


def test_the_paper_scale_benchmark_without_a_gpu_is_one_line(monkeypatch, capsys, tmp_path):
    import torch

    module = _paper_scale_cost()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "gpu.csv"
    assert module.main(["--device", "cuda", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == "error: --device cuda: no CUDA device here (torch.cuda.is_available() is False)\n"
    assert not out.exists()


def test_zo_hfl_cost_row_of_an_invocation_that_reused_runs_counts_the_runs_it_ran(tmp_path):
    """The wall and CPU time of an invocation that reused earlier runs are those of the runs it ran: its row
    says how many it ran and how many it reused, not only the preset's total (the committed invocation reused
    none: its row is the total)."""
    import json
    import shutil

    from fedweave.reproduce import zo_hfl

    def row(folder: Path) -> str:
        line = next(line for line in zo_hfl.cost_section(folder).splitlines() if "last invocation" in line)
        return line.split(" | ")[1]

    meta = json.loads((PAGES / "zo-hfl" / "claims.json").read_text(encoding="utf-8"))["meta"]
    assert row(PAGES / "zo-hfl") == (
        f"{meta['runs'] - meta['reused']} (and {meta['reused']} reused)" if meta["reused"] else str(meta["runs"])
    )
    for name in ("claims.json", "tune.md", "tune.csv", "table.csv"):
        shutil.copy(PAGES / "zo-hfl" / name, tmp_path / name)
    saved = json.loads((tmp_path / "claims.json").read_text(encoding="utf-8"))
    saved["meta"]["reused"] = 407  # an invocation into the --out of an earlier one that had run 407 of them
    (tmp_path / "claims.json").write_text(json.dumps(saved), encoding="utf-8")
    assert row(tmp_path) == f"{meta['runs'] - 407} (and 407 reused)"


def test_the_zo_hfl_page_names_the_std_its_tables_give():
    # the tables' ± is the population std of the seeds (zo_hfl.TABLE_STATS, ddof=0), as is C4's "one std": a
    # reader recomputing a cell with the sample std would find another number, so the page says which
    import csv

    import numpy as np

    rows = list(csv.DictReader((PAGES / "zo-hfl" / "results.csv").open()))
    cell = [r for r in csv.DictReader((PAGES / "zo-hfl" / "table.csv").open())][0]
    accs = [
        float(r["acc"])
        for r in rows
        if (r["dataset"], r["method"], r["part"]) == (cell["dataset"], cell["method"], "table")
        and float(r["alpha"]) == float(cell["alpha"])
        and float(r["beta"]) == float(cell["beta"])
    ]
    assert float(cell["acc_std"]) == round(float(np.std(accs)), 2) != round(float(np.std(accs, ddof=1)), 2)
    prose = re.sub(r"<!-- generated:.*?<!-- end generated -->", "", (PAGES / "zo-hfl.md").read_text(), flags=re.S)
    assert "mean ± std" not in prose and prose.count("mean ± population std") == 3
