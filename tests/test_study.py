"""The Study pipeline of fedweave.experiments.study: declarative claims, one front end for every reproduction,
and solver runs (not runner runs) kept per point and reused on a second call."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from fedweave.config import ConfigError
from fedweave.experiments.study import Claim, Plan, Study, Verdict, judge


def test_claims_are_rules_computing_their_verdicts_from_the_table():
    table = {"a": 3.0, "b": 1.0}
    claims = [
        Claim("C1 a beats b", lambda t, ctx: (f"{t['a']:.1f} vs {t['b']:.1f}", t["a"] > t["b"])),
        Claim(lambda t, ctx: f"C2 a reaches {ctx}", lambda t, ctx: (f"{t['a']:.1f}", None)),  # untestable
        Claim("C3 needs c", lambda t, ctx: None if "c" not in t else ("", True)),  # not testable at all: left out
    ]
    verdicts = judge(claims, table, 5)
    assert verdicts == [Verdict("C1 a beats b", "3.0 vs 1.0", True), Verdict("C2 a reaches 5", "3.0", None)]
    assert [tuple(v) for v in verdicts][0] == ("C1 a beats b", "3.0 vs 1.0", True)
    assert judge(claims, {**table, "a": 0.5}, 5)[0].held is False


@pytest.mark.parametrize("name", ["fedmim", "zo-hfl", "afind", "cse-fsl", "cfl-saga"])
def test_every_reproduction_has_the_common_front_end(name):
    from fedweave.cli import Parser
    from fedweave.config import positive_int
    from fedweave.reproduce import study

    parser = Parser(prog=f"fedweave reproduce {name}")
    study(name).add_arguments(parser, positive_int)
    opts = parser.parse_args(["--seeds", "2", "--workers", "3", "--out", "o", "--budget-minutes", "1.5"])
    assert (opts.seeds, opts.workers, opts.out, opts.budget_minutes) == (2, 3, "o", 1.5)
    assert opts.scale in study(name).scales


def test_a_bad_afind_table_list_is_one_line_and_status_2(capsys):
    from fedweave.cli import main

    assert main(["reproduce", "afind", "--tables", "1,9", "--out", "unused"]) == 2
    assert "--tables: unknown ['9']; allowed 1, 2, 3, tau, dp, fig5" in capsys.readouterr().err


def test_a_python_caller_gets_a_usage_error_as_one_config_error():
    from fedweave.reproduce.cse_fsl import main

    with pytest.raises(ConfigError, match="--workers: '0' is not a whole number >= 1"):
        main(["--workers", "0"])


# ---- solver runs: kept per point, reused on a second call -------------------------------------------------
@dataclass
class Square:
    x: float
    seed: int
    power: int = 2  # not in the slug: two scales with other powers name the same runs

    @property
    def slug(self) -> str:
        return f"x{self.x:g}/s{self.seed}"


def _solve(point: Square) -> dict:
    return {"x": point.x, "y": point.x**point.power, "_curve": (np.arange(3.0) * point.x, np.ones(2))}


def _study(seen: list) -> Study:
    def report(records, plan, opts, wall):
        seen.append((records, set(plan.reused)))
        return 0

    def plan(opts):
        power = 3 if opts.scale == "small" else 2
        return Plan([Square(float(x), 0, power) for x in opts.xs.split(",")], solve=_solve)

    from fedweave.experiments.study import option

    return Study("squares", "test", ("smoke",), plan, lambda p, r, plan: r, report, "smoke", options=(option("--xs"),))


def test_solver_runs_are_kept_and_reused_on_a_second_call(tmp_path):
    seen: list = []
    s = _study(seen)
    assert s.main(["--xs", "2,3", "--out", str(tmp_path), "--workers", "1"]) == 0
    first, reused = seen[-1]
    assert [r["y"] for r in first] == [4.0, 9.0] and reused == set()
    kept = tmp_path / "runs" / "x2" / "s0" / "record.json"
    mtime = kept.stat().st_mtime_ns
    assert s.main(["--xs", "2,5", "--out", str(tmp_path), "--workers", "1"]) == 0
    second, reused = seen[-1]
    assert reused == {"x2/s0"} and kept.stat().st_mtime_ns == mtime  # read back, not solved again
    assert [r["y"] for r in second] == [4.0, 25.0]
    np.testing.assert_array_equal(second[0]["_curve"][0], first[0]["_curve"][0])
    assert isinstance(second[0]["_curve"], tuple) and len(second[0]["_curve"]) == 2


def test_a_kept_record_of_another_point_is_solved_again(tmp_path):
    seen: list = []
    s = _study(seen)
    s.main(["--xs", "2", "--out", str(tmp_path), "--workers", "1"])
    record = tmp_path / "runs" / "x2" / "s0" / "record.json"
    record.write_text(record.read_text().replace('"x": 2.0, "seed"', '"x": 7.0, "seed"'))
    s.main(["--xs", "2", "--out", str(tmp_path), "--workers", "1"])
    assert seen[-1][1] == set() and seen[-1][0][0]["y"] == 4.0


def test_execute_keeps_the_command_line_for_the_report(tmp_path):
    seen: list = []
    s = _study(seen)
    opts = argparse.Namespace(scale="smoke", seeds=None, workers=1, out=str(tmp_path), budget_minutes=None, xs="1")
    s.report = lambda records, plan, o, wall: seen.append(o.argv) or 0
    assert s.execute(opts, ["--xs", "1"]) == 0 and seen == [["--xs", "1"]]


def test_solver_runs_keep_to_the_time_budget(tmp_path):
    seen: list = []
    s = _study(seen)
    s.main(["--xs", "2", "--out", str(tmp_path), "--workers", "1"])
    assert s.main(["--xs", "2,3", "--out", str(tmp_path), "--workers", "1", "--budget-minutes", "0"]) == 0
    records, reused = seen[-1]
    assert [r["y"] for r in records] == [4.0] and reused == {"x2/s0"}  # the kept run counts, the new one waits
    assert not (tmp_path / "runs" / "x3").exists()


def test_a_report_only_call_makes_no_runs_directory(tmp_path):
    seen: list = []
    s = _study(seen)
    s.plan = lambda opts: Plan([])  # no points, as cfl-saga --report-only
    assert s.main(["--out", str(tmp_path), "--workers", "1"]) == 0
    assert seen == [([], set())] and not (tmp_path / "runs").exists()


def test_verdict_table_and_the_records_grouped_over_seeds():
    from fedweave.experiments.aggregate import group, seed_gaps
    from fedweave.experiments.study import HELD, verdict_table

    verdicts = [Verdict("C1", "3 vs 1", True), Verdict("C2", "-", None)]
    assert verdict_table(verdicts).splitlines()[2:] == ["| C1 | 3 vs 1 | yes |", "| C2 | - | untestable |"]
    table = verdict_table(verdicts, ["claim", "verdict", "measured"], HELD)
    assert table.splitlines()[0] == "| claim | verdict | measured |" and "| C2 | untestable | - |" in table
    records = [{"m": "b", "seed": 1, "acc": 2.0}, {"m": "a", "seed": 0, "acc": 1.0}, {"m": "b", "seed": 0, "acc": 4.0}]
    assert list(group(records, lambda r: r["m"])) == ["b", "a"]  # in order of first appearance
    assert seed_gaps([records[1]], [records[2], records[0]], "acc") == [3.0]  # only the seeds both ran


def test_grouped_table_lays_out_column_groups_and_marks_the_missing_cells():
    from fedweave.experiments.tables import grouped_table

    cells = {("x", "iid"): [1, 2], ("y", "dir"): [3, 4]}
    header, body = grouped_table("method", ["x", "y", "z"], ["iid", "dir"], ["ours", "rank"],
                                 lambda k, g: cells.get((k, g)), str.upper, drop_empty=True)  # fmt: skip
    assert header == ["method", "iid: ours", "rank", "dir: ours", "rank"]
    assert body == [["X", 1, 2, "–", "–"], ["Y", "–", "–", 3, 4]]  # z ran nowhere: left out
    header, _ = grouped_table("method", ["x"], ["iid"], [""], lambda k, g: ["c"], group_label=str.title)
    assert header == ["method", "Iid"]  # a single unnamed column is headed by its group


def test_records_are_kept_with_their_arrays_and_read_back(tmp_path):
    from fedweave.experiments.study import load_records, not_run, save_records

    rows = [{"a": 1, "_c": (np.arange(3), np.ones(2))}, {"a": 2}]
    save_records(tmp_path / "raw.json", tmp_path / "c.npz", rows, "_c", "xy")
    assert (tmp_path / "raw.json").read_text() == '[\n {\n  "a": 1\n },\n {\n  "a": 2\n }\n]\n'
    back = load_records(tmp_path / "raw.json", tmp_path / "c.npz", "_c", "xy")
    assert back[1] == {"a": 2} and [list(a) for a in back[0]["_c"]] == [[0, 1, 2], [1.0, 1.0]]
    (tmp_path / "c.npz").unlink()
    assert load_records(tmp_path / "raw.json", tmp_path / "c.npz", "_c", "xy") == [{"a": 1}, {"a": 2}]
    assert not_run([]) == ""


@pytest.mark.parametrize("bad", ["-3", "nan", "inf", "soon"])
def test_a_negative_or_non_finite_time_budget_is_one_line_and_status_2(bad, capsys):
    from fedweave.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["reproduce", "fedmim", "--budget-minutes", bad, "--out", "unused"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--budget-minutes" in err[0] and "minutes >= 0" in err[0]


def test_the_pipeline_writes_the_pages_generated_sections(tmp_path):
    from fedweave.experiments.pages import fill

    seen: list = []
    s = _study(seen)
    s.sections = lambda folder: {"claims": f"| claim |\n|---|\n| {(folder / 'x.txt').read_text()} |\n"}
    (tmp_path / "page").mkdir()
    (tmp_path / "page" / "x.txt").write_text("C1 held")
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n<!-- generated: claims -->\nold\n<!-- end generated -->\n\nprose\n")
    assert s.main(["--xs", "1", "--out", str(tmp_path / "out"), "--workers", "1", "--page", str(page)]) == 0
    table = "| claim |\n|---|\n| C1 held |\n"
    assert page.read_text() == f"# Page\n\n<!-- generated: claims -->\n{table}<!-- end generated -->\n\nprose\n"
    with pytest.raises(ConfigError, match="no section renders the generated block 'other'"):
        fill("<!-- generated: other -->\n<!-- end generated -->\n", {})
    with pytest.raises(ConfigError, match="has no block '<!-- generated: claims -->'"):
        fill("no blocks\n", {"claims": ""})


def test_a_page_that_is_not_a_file_is_one_line_before_anything_runs(tmp_path, capsys):
    from fedweave.cli import main

    assert main(["reproduce", "zo-hfl", "--page", str(tmp_path / "nope.md"), "--out", str(tmp_path / "o")]) == 2
    assert "--page: " in capsys.readouterr().err and not (tmp_path / "o").exists()


# ---- --out: checked before any run, never another scale's runs replaced -------------------------------------
def test_an_out_that_is_a_file_or_under_a_file_is_one_line_naming_out(tmp_path, capsys):
    from fedweave.cli import main

    (tmp_path / "f").write_text("mine")
    for out in (tmp_path / "f", tmp_path / "f" / "sub"):
        assert main(["reproduce", "fedmim", "--scale", "smoke", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--out: {out} " in err and "give a folder this user can write" in err
    assert (tmp_path / "f").read_text() == "mine"


def test_another_scales_runs_in_out_are_refused_not_replaced(tmp_path):
    seen: list = []
    s = _study(seen)
    s.scales = ("smoke", "small")
    assert s.main(["--xs", "2", "--out", str(tmp_path), "--workers", "1"]) == 0
    kept = tmp_path / "runs" / "x2" / "s0" / "record.json"
    before = kept.read_bytes()
    # the same run names at another scale, of another config (power 3): its run would replace the kept one
    with pytest.raises(ConfigError, match=r"--out: .* holds the runs of 'fedweave reproduce squares --scale smoke'"):
        s.main(["--xs", "2", "--scale", "small", "--out", str(tmp_path), "--workers", "1"])
    assert kept.read_bytes() == before and len(seen) == 1
    assert s.main(["--xs", "2,3", "--out", str(tmp_path), "--workers", "1"]) == 0  # the same scale goes on
    assert s.main(["--xs", "2", "--scale", "small", "--out", str(tmp_path / "other"), "--workers", "1"]) == 0


def test_a_folder_of_the_users_files_is_refused_not_written_into(tmp_path):
    """A folder with files but no reproduction's mark is the user's, a runs/ of its own too (before: taken for a
    reproduction's): the report's files would land among theirs and replace those of the same name (before: a
    user's table.md and results.csv were replaced in silence). An empty folder, or an earlier reproduction's (its
    mark), is written into."""
    seen: list = []
    s = _study(seen)
    mine = tmp_path / "notes"
    mine.mkdir()
    for name in ("table.md", "results.csv"):
        (mine / name).write_text("mine")
    with pytest.raises(ConfigError) as e:
        s.main(["--xs", "2", "--out", str(mine), "--workers", "1"])
    assert str(e.value) == (
        f"--out: {mine} holds files but no reproduction's mark .reproduction (results.csv, table.md), which its "
        "report could replace; give a new or empty folder, or an earlier reproduction's"
    )
    assert sorted(p.name for p in mine.iterdir()) == ["results.csv", "table.md"] and not seen
    assert (mine / "table.md").read_text() == "mine"
    s.plan = lambda opts: Plan([])  # a report from records given elsewhere (baselines' --from-records): refused too
    with pytest.raises(ConfigError, match="holds files but no reproduction's mark"):
        s.main(["--xs", "2", "--out", str(mine), "--workers", "1"])
    (mine / "runs" / "myexp").mkdir(parents=True)  # fedweave run's own default folder is not a reproduction's
    with pytest.raises(ConfigError, match=r"holds files but no reproduction's mark .reproduction \(results.csv, runs"):
        s.main(["--xs", "2", "--out", str(mine), "--workers", "1"])
    assert (mine / "table.md").read_text() == "mine" and not seen
    s.plan = lambda opts: Plan([], rebuilds_out=True)  # from an earlier invocation's records there (--report-only)
    assert s.main(["--xs", "2", "--out", str(mine), "--workers", "1"]) == 0 and len(seen) == 1
    seen.clear()
    s.plan = _study(seen).plan
    (tmp_path / "empty").mkdir()
    for _ in range(2):  # an empty folder, then the reproduction's own (its runs/)
        assert s.main(["--xs", "2", "--out", str(tmp_path / "empty"), "--workers", "1"]) == 0
    assert len(seen) == 2


def test_without_out_each_scale_writes_into_its_own_folder(tmp_path, monkeypatch):
    seen: list = []
    s = _study(seen)
    s.scales = ("smoke", "small")
    monkeypatch.chdir(tmp_path)
    assert s.main(["--xs", "2", "--workers", "1"]) == 0  # the default scale: runs/reproduce-squares
    assert s.main(["--xs", "2", "--scale", "small", "--workers", "1"]) == 0  # not refused: a folder of its own
    assert (tmp_path / "runs" / "reproduce-squares" / "runs" / "x2" / "s0" / "record.json").is_file()
    assert (tmp_path / "runs" / "reproduce-squares-small" / "runs" / "x2" / "s0" / "record.json").is_file()
    assert [[r["y"] for r in records] for records, _ in seen] == [[4.0], [8.0]]


@pytest.mark.parametrize(
    "argv, flag",
    [(["cse-fsl", "--dataset", "foo"], "--dataset"), (["fedmim", "--datasets", "mnist", "foo"], "--datasets")],
)
def test_an_unknown_dataset_is_one_line_naming_its_option_before_anything_runs(argv, flag, tmp_path, capsys):
    from fedweave.cli import main

    out = tmp_path / "o"
    assert main(["reproduce", *argv, "--scale", "smoke", "--workers", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{flag}: unknown dataset 'foo'" in err and "mnist" in err
    assert not (out / "runs").exists()  # no run was started (and failed) in OUT


@pytest.mark.parametrize(
    "argv, line",
    [
        # the smoke preset has one dataset: the names after the first replaced none and were dropped
        (["--datasets", "mnist", "fashion_mnist"], "--datasets: 2 names, but preset 'smoke' has 1 dataset(s) (mnist)"),
        # a method the preset does not run was dropped: with none left, the report was written with empty tables
        (["--methods", "fedavg", "scaffold"], "--methods: preset 'smoke' runs no scaffold; it runs fedavg, fedmim"),
    ],
)
def test_a_fedmim_name_the_preset_does_not_take_is_one_line_before_anything_runs(argv, line, tmp_path, capsys):
    from fedweave.cli import main

    out = tmp_path / "o"
    assert main(["reproduce", "fedmim", "--scale", "smoke", *argv, "--workers", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and line in err
    assert not out.exists() or not any(out.iterdir())  # nothing run, no report written


def test_a_runner_point_its_run_would_refuse_is_refused_before_any_run_starts(tmp_path):
    # a study's points are runner runs too: the 2nd names a model no run accepts; before, the 1st point's run was
    # run to its end before the 2nd's failed
    from fedweave.experiments.grid import GridError, Point
    from tests.conftest import TOY_CONFIG

    configs = [{**TOY_CONFIG, "rounds": 1, "model": {"name": m}} for m in ("logistic", "logistik", "mlp")]
    plan = Plan([Point.of(c, name=f"m{i}", model=c["model"]["name"]) for i, c in enumerate(configs)])
    s = Study("toys", "test", ("smoke",), lambda opts: plan, lambda p, r, plan: r, lambda *a: 0, "smoke")
    with pytest.raises(GridError, match=r"^reproduction point m1 \(model=logistik\): unknown model 'logistik'"):
        s.records(plan, tmp_path / "o", workers=1)
    assert not (tmp_path / "o").exists()


def test_another_studys_page_is_one_line_naming_page_before_anything_runs(tmp_path, capsys):
    """``--page`` with another paper's page rendered this study's sections from that page's records after every
    run: a KeyError or TypeError traceback (fedmim, zo-hfl), or an Errno line not naming --page (cse-fsl)."""
    from fedweave.cli import main

    pages = Path(__file__).resolve().parents[1] / "docs" / "reproductions"
    for study, other in (("fedmim", "zo-hfl"), ("zo-hfl", "fedmim"), ("cse-fsl", "cfl-saga")):
        out = tmp_path / study
        assert (
            main(["reproduce", study, "--scale", "smoke", "--out", str(out), "--page", str(pages / f"{other}.md")]) == 2
        )
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--page: {pages / other}.md is not a page that '{study}' renders" in err
        assert not out.exists()
