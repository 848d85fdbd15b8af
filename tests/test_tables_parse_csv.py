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
