"""A value a committed report states, read for a page's prose (``pages.stated``): its groups, or one line naming
the file and what it does not state."""

from __future__ import annotations

import re

import pytest

from fedweave.config import ConfigError
from fedweave.experiments.pages import stated


def test_the_groups_of_what_the_file_states(tmp_path):
    report = tmp_path / "table.md"
    report.write_text("# t\n\nScale `small`, seeds [0, 1], wall 1204 s.\nsum of the 12 runs' own CPU times 345 s\n")
    assert stated(report, r"wall (\d+) s\.") == ("1204",)
    assert stated(report, r"sum of the (\d+) runs' own CPU times (\d+) s") == ("12", "345")


def test_a_report_that_states_nothing_is_one_line_naming_it(tmp_path):
    report = tmp_path / "table-digits.md"
    report.write_text("# t\n\nno wall time here\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(report))} states nothing that matches .*wall") as got:
        stated(report, r"wall (\d+) s\.")
    assert "\n" not in str(got.value)


def test_a_page_section_on_a_report_without_its_wall_time_names_the_report(tmp_path):
    from fedweave.reproduce.cse_fsl import wall_section

    (tmp_path / "table-digits.md").write_text("# CSE-FSL reproduction\n\nScale `small`, seeds [0, 1].\n")
    with pytest.raises(ConfigError, match="table-digits.md states nothing"):
        wall_section(tmp_path, "table-digits.md")


def test_a_wall_time_of_an_invocation_that_reused_runs_is_read_with_its_note(tmp_path):
    """A committed table whose invocation reused runs states so beside its wall time; the page's line keeps it
    (before, the note would have stopped the pattern, or a rerun's seconds passed for the runs' own)."""
    from fedweave.experiments.grid import Point
    from fedweave.experiments.study import Plan
    from fedweave.reproduce.cse_fsl import wall_section

    plan = Plan([Point.of({"seed": 0}, "a"), Point.of({"seed": 1}, "b")], reused={"a"})
    assert plan.reused_note() == " (1 of 2 runs reused from an earlier invocation, not in this time)"
    assert Plan([Point.of({"seed": 0}, "a")]).reused_note() == ""
    (tmp_path / "table-x.md").write_text(f"Scale `small`, seeds [0], wall 75 s{plan.reused_note()}.\n")
    assert " ".join(wall_section(tmp_path, "table-x.md").split()) == (  # a paragraph, folded
        "Wall time of the invocation that wrote `cse-fsl/table-x.md`: 75 s (1 min) (1 of 2 runs reused from an "
        "earlier invocation, not in this time)."
    )
