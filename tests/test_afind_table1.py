"""AFIND+ Table 1's centralized FedAvg row: the global model on every client's personalized test set."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import tests.conftest  # noqa: F401  (registers the _toy dataset)
from fedweave.algorithms.base import RunContext, build_algorithm
from fedweave.config import ConfigError, load
from fedweave.execution import evaluate


def _cfg(algo: dict, personal: bool | None = None) -> dict:
    cfg = {
        "name": "t1",
        "seed": 4,
        "rounds": 2,
        "dataset": {"name": "_toy"},
        "partition": {"name": "pathological", "num_clients": 6, "classes_per_client": 2},
        "model": {"name": "logistic"},
        "algorithm": algo,
        "local": {"epochs": 1, "batch_size": 20, "lr": 0.2},
        "output": {"progress": False, "plots": False},
    }
    if personal is not None:
        cfg["eval"] = {"personal_test": personal}
    return cfg


def test_fedavg_personal_test_is_the_mean_of_per_client_accuracies_on_the_dfl_test_sets():
    fed = build_algorithm(RunContext(load(_cfg({"name": "fedavg", "clients_per_round": 3}, True))))
    for r in range(2):
        fed.run_round(r)
    got = fed.evaluate(1)
    # the same per-client test sets as a decentralized run of the same data, partition and seed
    dfl = build_algorithm(RunContext(load(_cfg({"name": "local"}))))
    parts = dfl.test_parts
    assert all(np.array_equal(a, b) for a, b in zip(fed.ctx.personal_test_parts(), parts, strict=True))
    ds = fed.ctx.dataset
    accs = []
    for idx in parts:
        t = torch.as_tensor(idx)
        assert set(ds.test_y[t].tolist()) <= set(ds.train_y[torch.as_tensor(fed.ctx.partition[len(accs)])].tolist())
        accs.append(evaluate(fed.layout, fed.x, ds.test_x[t], ds.test_y[t])[0])
    assert got["test_accuracy"] == pytest.approx(float(np.mean(accs)), abs=1e-12)
    assert got["test_accuracy_min"] == pytest.approx(min(accs), abs=1e-12)
    assert got["test_accuracy_global"] == pytest.approx(evaluate(fed.layout, fed.x, ds.test_x, ds.test_y)[0])


def test_personal_test_off_by_default_and_type_checked():
    fed = build_algorithm(RunContext(load(_cfg({"name": "fedavg", "clients_per_round": 3}))))
    fed.run_round(0)
    out = fed.evaluate(0)
    assert set(out) == {"test_accuracy", "test_loss"}
    with pytest.raises(ConfigError, match="eval.personal_test"):
        load(_cfg({"name": "fedavg"}, "yes"))  # type: ignore[arg-type]


def test_reproduce_smoke_table1_fedavg_row(tmp_path):
    """Table 1 gets the FedAvg row, evaluated on the personalized test sets (seconds; generated data)."""
    import csv

    from fedweave.reproduce.afind_plus import main

    argv = ["--scale", "smoke", "--out", str(tmp_path), "--tables", "1", "--workers", "1", "--only", "FedAvg"]
    assert main(argv) == 0
    rows = {r[0]: r for r in csv.reader((tmp_path / "table1.csv").open())}
    assert rows["FedAvg"][-8:] == ["55.29", "78.24", "59.81", "56.87", "45.42", "46.48", "27.20", "35.29"]
    assert rows["FedAvg"][1] != "-"  # measured
    assert "personal_test: true" in (tmp_path / "runs/synthetic/FedAvg/s0/config.yaml").read_text()
    # one seed: no paired test, so no claim is judged (and the report is still written)
    assert "None judged: every claim's declared rule is a paired test" in (tmp_path / "results.md").read_text()


def test_table4_rows_run_dp_sgd():
    """Table 4 (data-free check of the plan): sigma_2 = 0 is the plain AFIND+ run, the others DP-SGD, C = 1."""
    from fedweave.reproduce.afind_plus import plan, preset, run_config

    p = preset("small")
    jobs, rows = plan(p, 1, {"dp"})
    assert [r for r, _, _ in rows["dp"]] == ["0", *(f"{s:g}" for s in p.dp_sigmas)]
    bases = {s.key: s.base for s in p.settings}
    for j in jobs:
        algo = load(run_config(j, bases[j.setting])).algorithm.options
        if j.label == "AFIND+":
            assert "dp_sigma" not in algo
        else:
            assert algo["dp_mode"] == "sgd" and algo["dp_clip"] == 1.0 and algo["dp_sigma"] in p.dp_sigmas


@pytest.mark.slow  # a table's runs: about 5 s of CPU
def test_a_diverged_run_is_a_table_entry_not_fatal(tmp_path, monkeypatch):
    """A sweep point that diverges (Table 4 at a large sigma_2) is reported as diverged; the reproduction
    goes on and reuses the diverged run on the next invocation."""
    import csv

    from fedweave.reproduce import afind_plus

    real = afind_plus.run_config

    def exploding(job, base):
        cfg = real(job, base)
        return {**cfg, "local": {**cfg["local"], "lr": 1e38}} if "dp" in job.label else cfg

    monkeypatch.setattr(afind_plus, "run_config", exploding)
    argv = ["--scale", "smoke", "--out", str(tmp_path), "--tables", "dp", "--workers", "1"]
    assert afind_plus.main(argv) == 0
    rows = {r[0]: r for r in csv.reader((tmp_path / "dp.csv").open())}
    assert rows["5"][1] == "diverged (1/1)" and rows["0"][1][0].isdigit()
    summary = (tmp_path / "runs/synthetic/AFIND__dp_5/s0/summary.json").read_text()
    assert '"status": "diverged"' in summary
    mtime = (tmp_path / "runs/synthetic/AFIND__dp_5/s0/summary.json").stat().st_mtime
    assert afind_plus.main(argv) == 0
    assert (tmp_path / "runs/synthetic/AFIND__dp_5/s0/summary.json").stat().st_mtime == mtime  # reused


def test_fig5_runs_each_personalised_method_with_and_without_afind_selection():
    from fedweave.config import load
    from fedweave.reproduce.afind_plus import PLUGINS, plan, preset, run_config

    p = preset("small")
    jobs, rows = plan(p, 1, {"fig5"})
    assert [r for r, _, _ in rows["fig5"]] == [m + s for m in PLUGINS for s in ("", " + AFIND+")]
    bases = {s.key: s.base for s in p.settings}
    for j in jobs:
        algo = load(run_config(j, bases[j.setting])).algorithm
        assert algo.name == PLUGINS[j.label.split(" ")[0]] and j.setting == p.primary
        if j.label.endswith("AFIND+"):  # AFIND+'s pool, threshold and Boltzmann weights
            assert algo.options["selection"] == "afind" and algo.options["neighbours"] == p.pool
        else:  # the method's own choice over the random-sampling budget
            assert "selection" not in algo.options and algo.options["neighbours"] == p.budget


def _plugin_result(label: str, seed: int, best: float) -> dict:
    return {"setting": "s", "label": label, "seed": seed, "best": best, "final": best, "selected": 2.0,
            "bytes": 1.0, "overlap_selected": None}  # fmt: skip


def test_fig5_claims_are_judged_by_their_declared_rules_on_the_per_seed_gains():
    """Fig. 5's two claims by their declared rules (95 % paired t over the seeds): every plug-in gains, and the
    mean gain over the plug-ins is within 1.5 points of section 5's +3."""
    from fedweave.reproduce.afind_plus import claim_rows, preset

    p = preset("smoke")
    p.primary = "s"
    gains = {"Ditto": 0.03, "FOMO": 0.01, "DisPFL": -0.005}  # Ditto and FOMO gain 0.1 point more per seed
    results = [_plugin_result(m, s, 0.7) for m in gains for s in (0, 1, 2)]
    for m, g in gains.items():
        results += [_plugin_result(m + " + AFIND+", s, 0.7 + g + 0.001 * s * (m != "DisPFL")) for s in (0, 1, 2)]
    verdicts = dict(claim_rows(results, p))
    every = next(v for c, v in verdicts.items() if c.startswith("Fig. 5"))
    assert every == (
        "all of 3 (points): Ditto +3.10 [2.85, 3.35] held; FOMO +1.10 [0.85, 1.35] held; DisPFL -0.50 [-0.50, -0.50] "
        "did not hold; 95 % paired t, n=3: did not hold"
    )
    about = next(v for c, v in verdicts.items() if c.startswith("Section 5"))
    # per seed (3 + 1 - 0.5) / 3 = 1.17, 1.27, 1.27: 1.77 points below +3, wholly outside +-1.5
    assert about == "-1.77 points from +3 [-1.93, -1.60], 95 % paired t, within ±1.50, n=3: did not hold"


def test_the_page_names_a_missing_committed_records_file(tmp_path):
    """The page's sections are rendered from the committed records beside it: a missing file is one line."""
    from fedweave.config import ConfigError
    from fedweave.reproduce.afind_plus import sections

    with pytest.raises(ConfigError, match=r"^\S+/results.json is missing: the page's generated sections are rendered"):
        sections(tmp_path)


def test_table4_exchange_rows_put_the_noise_on_the_messages():
    """Table 4 with the paper's mechanism (``--tables dpx``): the local steps stay plain SGD and every tensor a
    client sends gets N(0, (sigma_2 C / L)^2 I), C = 1; sigma_2 = 0 is the plain AFIND+ run."""
    from fedweave.reproduce.afind_plus import plan, preset, run_config

    p = preset("small")
    jobs, rows = plan(p, 1, {"dpx"})
    assert p.dpx_sigmas == [2.0, 5.0] and [r for r, _, _ in rows["dpx"]] == ["0", "2", "5"]
    bases = {s.key: s.base for s in p.settings}
    modes = {}
    for j in jobs:
        algo = load(run_config(j, bases[j.setting])).algorithm.options
        modes[j.label] = (algo.get("dp_mode"), algo.get("dp_sigma"), algo.get("dp_clip"))
    assert modes == {
        "AFIND+": (None, None, None),
        "AFIND+ exchange dp=2": ("exchange", 2.0, 1.0),
        "AFIND+ exchange dp=5": ("exchange", 5.0, 1.0),
    }


def test_fig5b_runs_the_plugins_on_the_pathological_setting():
    from fedweave.reproduce.afind_plus import PLUGINS, plan, preset

    p = preset("small")
    jobs, rows = plan(p, 3, {"fig5b"})
    assert [r for r, _, _ in rows["fig5b"]] == [m + s for m in PLUGINS for s in ("", " + AFIND+")]
    assert len(jobs) == 18 and {j.setting for j in jobs} == {"mnist-path2"}
    part = {s.key: s.base for s in p.settings}["mnist-path2"]["partition"]
    assert part == {"name": "pathological", "num_clients": 20, "classes_per_client": 2}
    _, fig5 = plan(p, 3, {"fig5"})  # the same methods and options as Fig. 5(a)
    assert [(r, lb) for r, _, lb in rows["fig5b"]] == [(r, lb) for r, _, lb in fig5["fig5"]]


def test_fig5b_needs_the_pathological_setting(capsys):
    from fedweave.cli import main

    argv = ["reproduce", "afind", "--tables", "fig5b", "--primary-only", "--out", "unused"]
    assert main(argv) == 2
    assert "--primary-only leaves out the pathological setting" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value", "line"),
    [
        ("--tables", ",", "--tables: unknown [','];"),
        ("--tables", "", "--tables: unknown [''];"),
        ("--only", ",", "--only: unknown [','];"),
        ("--only", "Gossip,Foo", "--only: unknown ['Foo']; allowed Gossip, Local, AFIND+, FedAvg"),
    ],
)
def test_an_empty_or_unknown_list_is_one_line_naming_its_flag(flag, value, line, tmp_path, capsys):
    """``--tables ,`` (or an empty ``--tables``) ran nothing, wrote an empty report and exited 0; ``--only``'s
    refusal named no allowed label."""
    from fedweave.cli import main

    argv = ["reproduce", "afind", "--scale", "smoke", "--tables", "1", flag, value, "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and line in err and not (tmp_path / "o").exists()


def test_table_3_and_fedavg_below_local_are_judged_by_declared_rules():
    """The page's verdicts on Table 3's ordering and on FedAvg below Local (pathological) were read from the
    means; each is now a declared rule on the committed per-seed records."""
    from pathlib import Path

    from fedweave.reproduce import afind_plus as af

    folder = Path(__file__).parents[1] / "docs" / "reproductions" / "afind"
    rows = {c: v for sub in ("", "table3-dp") for c, v in af.claim_rows(*af.committed(folder / sub))}
    t3 = next(v for c, v in rows.items() if c.startswith("Table 3, each client linked to half"))
    assert "FedeRiCo > PENS +3.67 [0.31, 7.03] held" in t3 and t3.endswith("n=3: inconclusive")
    local = next(v for c, v in rows.items() if c.startswith("FedAvg below Local on the pathological split"))
    assert local.endswith("95 % paired t, n=5: held")


def test_a_budget_that_runs_out_counts_the_runs_that_finished_and_names_the_others(tmp_path):
    """results.md's "N runs" counts the runs of its tables (before: the planned runs, "2 runs" after none had
    run) and names the runs the time budget left unrun."""
    from fedweave.reproduce.afind_plus import main

    argv = ["--scale", "smoke", "--out", str(tmp_path), "--tables", "1", "--workers", "1", "--only", "FedAvg,Local"]
    assert main([*argv, "--budget-minutes", "0"]) == 0
    md = (tmp_path / "results.md").read_text()
    assert md.splitlines()[2].startswith("0 runs, 1 seed(s), ")
    assert md.endswith("\nNot run (time budget reached): synthetic-Local-0, synthetic-FedAvg-0\n")


# ---- a run that diverged before evaluating: untestable claims, no made-up table values ---------------------------
AFIND_PAGE = Path(__file__).parents[1] / "docs" / "reproductions" / "afind"
BIG = "Table 4: the largest sigma_2 run above 5 hurts more than each sigma_2 <= 5"


def _unevaluated(setting: str, label: str, seed: int) -> dict:
    """The record ``collect`` keeps of a run that diverged before its first evaluation."""
    nan = math.nan
    return {"setting": setting, "label": label, "seed": seed, "status": "diverged", "best": nan, "final": nan,
            "selected": nan, "overlap_selected": nan, "bytes": nan, "wall": 1.0}  # fmt: skip


def test_a_cell_whose_every_seed_diverged_before_evaluating_leaves_its_claim_untestable_not_out():
    """Every seed of the preset's sigma_2 = 50 run diverged before evaluating: the claim that it hurts more than
    each sigma_2 <= 5 vanished from the claims (no record of that side left to pair, so the rule returned
    nothing); the preset ran the cell, so it is untestable and says why. The other claims are as before."""
    from fedweave.reproduce import afind_plus as af

    results, p = af.committed(AFIND_PAGE)
    assert 50.0 in p.dp_sigmas and not any(r["label"] == "AFIND+ dp=50" for r in results)
    before = dict(af.claim_rows(results, p))
    assert BIG not in before  # the committed folder ran no sigma_2 above 5
    seeds = sorted({r["seed"] for r in results if r["label"] == "AFIND+"})
    got = dict(af.claim_rows(results + [_unevaluated(p.primary, "AFIND+ dp=50", s) for s in seeds], p))
    why = (
        f"untestable: 0 seeds with both sides run (AFIND+ dp=50: {len(seeds)} of {len(seeds)} diverged before "
        "evaluating); a paired t test needs 2"
    )
    assert (
        got.pop(BIG) == f"all of 2 (points): sigma 50 vs 2 {why}; sigma 50 vs 5 {why}; 95 % paired t, n=0: untestable"
    )
    assert got == before
    # one seed evaluated: still untestable, and the line says why the others are no pair
    one = [_unevaluated(p.primary, "AFIND+ dp=50", s) for s in seeds[1:]]
    one.append({**one[0], "seed": seeds[0], "status": "completed", "best": 0.1, "final": 0.1})
    line = dict(af.claim_rows(results + one, p))[BIG]
    assert f"untestable: 1 seed with both sides run (AFIND+ dp=50: {len(seeds) - 1} of {len(seeds)}" in line


def test_a_run_that_diverged_before_evaluating_adds_no_value_to_mean_selected_or_mb_sent():
    """``collect`` of a run with no metric rows (diverged before evaluating) gave "mean selected" a made-up 0 and
    "MB sent" the bytes of its partial run, unmarked; it now gives NaN, and the table marks the cell as it marks
    best and final ("(k/n diverged)"). A run that evaluated but selects no one (Local) still has 0 selected."""
    from fedweave.reproduce import afind_plus as af

    p = af.preset("smoke")
    jobs, rows = af.plan(p, 2, {"tau"})
    point = next(pt for pt in af.points(jobs, p) if dict(pt.values)["label"] == "AFIND+" and pt.seed == 1)
    summary = {"status": "diverged", "best_test_accuracy": None, "final_test_accuracy": None, "wall_seconds": 1.0}
    summary["communication"] = {"bytes_total": 3 * 2**20}
    gone = af.collect(point, SimpleNamespace(metrics=[], summary=summary))
    assert gone["status"] == "diverged" and all(math.isnan(gone[k]) for k in ("best", "selected", "bytes"))
    one_row = [{"round": 1, "test_accuracy": 0.5}]
    local = af.collect(point, SimpleNamespace(metrics=one_row, summary={**summary, "status": "completed"}))
    assert (local["selected"], local["bytes"]) == (0.0, 3 * 2**20)
    done = {"best": 0.5, "final": 0.5, "selected": 3.0, "overlap_selected": 0.8, "bytes": 2**20, "status": "completed"}
    results = [{"setting": s, "label": lb, "seed": seed, **done} for _, s, lb in rows["tau"] for seed in (0, 1)]
    results = [gone if (r["label"], r["seed"]) == ("AFIND+", 1) else r for r in results]
    header, body = af.tables(results, rows, p)["tau"]
    cells = dict(zip(header, next(b for b in body if b[0] == "0.5")))
    assert cells["best"] == "50.00 (1/2 diverged)"
    assert cells["mean selected"] == "3.00 (1/2 diverged)" and cells["MB sent"] == "1.00 (1/2 diverged)"
    assert cells["label overlap of selected"] == "0.80 (1/2 diverged)"


def test_the_smoke_preset_runs_table_3_on_its_partial_topology(tmp_path):
    """The smoke preset's 6 clients gave each a 2-regular 'half' graph, below PENS's m_top of 2: ``--tables 3``
    at smoke scale failed in its PENS run; its 8 clients give each 3 neighbours."""
    from fedweave.cli import main

    out = tmp_path / "o"
    assert main(["reproduce", "afind", "--scale", "smoke", "--tables", "3", "--seeds", "1", "--out", str(out)]) == 0
    assert "PENS" in (out / "table3.csv").read_text(encoding="utf-8")


def test_an_unknown_scale_is_a_config_error_not_an_exit():
    """``preset`` of an unknown scale (a committed results.md naming one) raised SystemExit, ending the caller."""
    from fedweave.config import ConfigError
    from fedweave.reproduce import afind_plus as af

    with pytest.raises(ConfigError, match=r"^--scale must be smoke, small or paper; got 'big'$"):
        af.preset("big")


def test_a_diverged_seed_of_a_plugin_gain_is_named_not_printed_as_nan():
    """Fig. 5's per-seed gains printed ``(nan, 0.63)`` for a seed whose run without AFIND+ diverged."""
    from fedweave.reproduce import afind_plus as af

    plain = [{"seed": 0, "best": math.nan}, {"seed": 1, "best": 0.60}]
    plug = [{"seed": 0, "best": 0.62}, {"seed": 1, "best": 0.6063}]
    assert af.seed_gains(plain, plug, "best") == "diverged, 0.63"


def test_primary_only_with_fig5b_runs_where_the_pathological_setting_is_the_primary(tmp_path):
    """At smoke scale the pathological setting is the primary one: ``--primary-only --tables fig5b`` was refused for
    leaving it out."""
    from fedweave.reproduce import afind_plus as af

    opts = SimpleNamespace(scale="smoke", rounds=None, tables="fig5b", primary_only=True, seeds=1, only=None,
                           collect=False, out=str(tmp_path))  # fmt: skip
    assert len(af.study_plan(opts).points) == 2 * len(af.PLUGINS)  # each plug-in method without and with AFIND+


def test_the_smoke_scale_runs_on_the_workers_given_with_the_same_numbers(tmp_path, capsys):
    """``--workers 2`` at smoke scale runs on two workers, as its header says (before: one, whatever --workers
    said, and the header ``1 worker(s)``), and its records and tables are those of one worker, wall times aside."""
    import json

    from fedweave.reproduce.afind_plus import main

    got = {}
    for workers in ("1", "2"):
        out = tmp_path / workers
        argv = ["--scale", "smoke", "--out", str(out), "--tables", "1", "--seeds", "2", "--only", "FedAvg,Local"]
        assert main([*argv, "--workers", workers]) == 0
        assert f": 4 runs, {workers} worker(s) -> {out}" in capsys.readouterr().out
        records = [{k: v for k, v in r.items() if k != "wall"} for r in json.loads((out / "results.json").read_text())]
        got[workers] = records, (out / "table1.csv").read_bytes()
    assert got["2"] == got["1"] and len(got["1"][0]) == 4
