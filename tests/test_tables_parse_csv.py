"""``tables.parse_csv``: CSV text read back as ``read_csv`` reads the written file."""

from __future__ import annotations

import math

from fedweave.experiments.tables import csv_text, parse_csv, read_csv, write_csv


def test_parse_csv_gives_what_the_written_file_reads_back(tmp_path):
    rows = [{"name": "a", "acc": 86.78571428571429, "seed": 0, "ok": True, "paper": None, "loss": math.nan}]
    text = csv_text(rows, float_format=".6g")
    write_csv(tmp_path / "r.csv", rows, float_format=".6g")
    got = parse_csv(text)
    assert got[0]["acc"] == 86.7857 and got[0]["seed"] == 0 and got[0]["ok"] is True and got[0]["paper"] is None
    assert math.isnan(got[0]["loss"]) and got[0]["name"] == "a"
    assert repr(got) == repr(read_csv(tmp_path / "r.csv"))


def test_a_text_cell_is_text_unless_it_is_a_number_as_csv_text_writes_one(tmp_path):
    # int() and float() read each of these labels as a number (1_000 as 1000); csv_text never writes a number so
    labels = ["1_000", "1_0.5", "007", " 7", "+1", "1e5", "Infinity", "NaN", "١٢"]
    numbers = [0, -3, 1000, 2**70, 0.1, -2.5, 1e22, 1e-05, 123456.789, -0.0, math.inf, -math.inf]
    rows = [{"label": s, "value": v} for s, v in zip(labels * 2, numbers, strict=False)]
    for fmt in (None, ".6g", ".3f", ".4e"):
        text = csv_text(rows, float_format=fmt)
        got = parse_csv(text)
        assert [r["label"] for r in got] == [r["label"] for r in rows], fmt
        want = [v if isinstance(v, int) or fmt is None else float(format(v, fmt)) for v in numbers]
        assert [r["value"] for r in got] == want, fmt
        if fmt is None:  # written in full: each number comes back as the type it was
            assert [type(r["value"]) for r in got] == [type(v) for v in numbers]
        write_csv(tmp_path / "r.csv", rows, float_format=fmt)
        assert repr(read_csv(tmp_path / "r.csv")) == repr(got)
    assert math.isnan(parse_csv(csv_text([{"x": math.nan}]))[0]["x"])
