"""``faults.work_unit`` (docs/reliability.md): the unit of the simulated clock, the deadline and the arrival times.

``round`` (the default) times a client's work relative to the run's mean client round; ``step`` times one local
step of a median-speed client, so methods of different local work compare on one clock. Hand-computed clocks
(speed_sigma 0: every client's time per unit is exactly 1), a deadline against ``Faults.arrival_times``, the
asynchronous FedBuff's events, ProxSkip's K_r, CSE-FSL's timed uploads, refusals and the unchanged default.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import fedweave
from fedweave.algorithms.base import RunContext, build_algorithm
from fedweave.config import ConfigError, from_dict, load
from fedweave.faults import Faults
from fedweave.registry import PARTITIONERS
from fedweave.runner import run as run_config
from fedweave.seeding import Seeds
from tests.test_async import _three
from tests.test_centralized import _algo, _cfg
from tests.test_faults_split import B, cfg_dict, make

STEPS = np.array([1.0, 2.0, 3.0])  # the _thirds clients' local steps (one epoch of 1/6, 2/6, 3/6 of the data)


def _clocked(alg: str, unit: str | None, local: dict | None = None, rounds: int = 3, opts=None, **faults) -> dict:
    """``alg`` (its options ``opts``) on the synchronous star's clock, ``faults.work_unit`` = ``unit`` (None: the
    key left out)."""
    cfg = _cfg(alg, rounds=rounds, local=local, **(opts or {}))
    cfg["faults"] = {"sim_time": True, "speed_sigma": 0.0, **faults, **({"work_unit": unit} if unit else {})}
    return cfg


def _thirds(unit: str, **faults) -> dict:
    """FedAvg on the three clients of 1, 2 and 3 local steps, all three every round, on the clock."""
    cfg = _clocked("fedavg", unit, local={"epochs": 1, "batch_size": 80, "lr": 0.1}, rounds=4, **faults)
    cfg["partition"] = {"name": "_thirds", "num_clients": 3}
    cfg["algorithm"]["clients_per_round"] = 3
    return cfg


@pytest.mark.parametrize("unit", ["round", "step"])
def test_fedavg_rounds_last_their_local_steps_in_step_units_and_one_round_else(unit):
    """Equal speeds (speed_sigma 0), every client of a round takes local.steps: with ``step`` a round of 5 steps
    lasts 5 and one of 1 step lasts 1; with ``round`` both last 1 (each client's work is the mean's)."""
    times = {}
    for k in (1, 5):
        local = {"steps": k, "batch_size": 16, "lr": 0.2}
        algo = _algo(_clocked("fedavg", unit, local=local))
        times[k] = [algo.run_round(r)["sim_time"] for r in range(3)]
    if unit == "step":
        assert times[1] == [1.0, 2.0, 3.0] and times[5] == [5.0, 10.0, 15.0]
    else:
        assert times[1] == times[5] == [1.0, 2.0, 3.0]


def test_a_deadline_in_steps_drops_exactly_the_clients_whose_steps_times_speed_exceed_it():
    """Clients of 1, 2 and 3 steps at speeds exp(0.5 z_i + 0.3 z_ir): with ``step`` client i is late when
    steps_i * speed_ir (its arrival time, from Faults.arrival_times at one unit of work) passes the deadline; a
    round lasts its slowest client's time, at most the deadline. (Seed 4: steps x speed are 0.81, 2.12, 4.95;
    0.54, 1.09, 5.65; 0.95, 2.48, 7.20; 0.95, 1.37, 5.49, so a deadline of 2 keeps client 0, then 0 and 1, 0,
    0 and 1; the ``round`` unit, steps over their mean 2, would keep 0 and 1 in every round.)"""
    deadline = 2.0
    cfg = _thirds("step", speed_sigma=0.5, speed_jitter=0.3, deadline=deadline)
    algo, faults = _algo(cfg), Faults(load(cfg).faults, Seeds(cfg["seed"]))
    clients, now, kept = np.arange(3), 0.0, []
    for r in range(4):
        times = STEPS * faults.arrival_times(r, clients, 1.0)  # steps x the client's time per step
        on_time = clients[times <= deadline].tolist()
        assert algo.reporting(r, clients).tolist() == on_time
        row = algo.run_round(r)
        now += min(float(times.max()), deadline)
        assert row["reported_clients"] == len(on_time) and row["sim_time"] == now
        kept.append(on_time)
    assert kept == [[0], [0, 1], [0], [0, 1]]  # the hand-computed sets above


def test_fedbuff_clock_in_steps_matches_hand_computed_events():
    """Clients of 1, 2 and 3 steps at equal speeds, all three in flight, a server step every 2 arrivals. t=0: jobs
    0, 1, 2 (clients 0, 1, 2, due 1, 2, 3). t=1: client 0 arrives, restarts (due 2). t=2: client 1 arrives: step 0
    at 2; client 0 arrives; clients 0 and 1 restart (due 3 and 4). t=3: client 2: step 1 at 3; client 0, restarts
    with 2 (due 4 and 6). t=4: client 1: step 2 at 4; client 0, restarts with 1 (due 5 and 6). t=5: client 0: step
    3 at 5, restarts (due 6). t=6: clients 2 and 1: step 4 at 6; client 0 arrives, all restart (due 7, 8, 9).
    t=7: client 0: step 5 at 7, restarts (due 8). t=8: clients 1 and 0: step 6 at 8."""
    cfg = _three("fedbuff", buffer_size=2, staleness="constant")
    cfg["faults"] = {**cfg["faults"], "work_unit": "step"}
    algo = _algo(cfg)
    assert [algo.run_round(r)["sim_time"] for r in range(7)] == [2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    arrivals = [(t, c) for t, e, c, *_ in algo.events if e == "arrive"]
    assert arrivals == [(1.0, 0), (2.0, 1), (2.0, 0), (3.0, 2), (3.0, 0), (4.0, 1), (4.0, 0), (5.0, 0),
                        (6.0, 2), (6.0, 1), (6.0, 0), (7.0, 0), (8.0, 1), (8.0, 0)]  # fmt: skip


def test_a_proxskip_round_lasts_its_k_r_steps():
    """Every client takes the round's K_r ~ Geometric(p) steps: at equal speeds a round lasts K_r in step units
    (K_r p, the steps over their mean 1/p, in round units)."""
    local = {"batch_size": 16, "lr": 0.1}
    for unit, scale in (("step", 1.0), ("round", 0.3)):
        algo = _algo(_clocked("proxskip", unit, local=local, opts={"clients_per_round": 8, "p": 0.3}))
        now, steps = 0.0, []
        for r in range(8):
            row = algo.run_round(r)
            assert row["sim_time"] - now == pytest.approx(row["local_steps"] * scale, rel=1e-12)
            if unit == "step":  # whole numbers: exact
                assert row["sim_time"] - now == row["local_steps"]
            now = row["sim_time"]
            steps.append(row["local_steps"])
        assert len(set(steps)) > 1  # the rounds' lengths differ


if "_split_blocks_with_empty" not in PARTITIONERS._items:

    @PARTITIONERS.register("_split_blocks_with_empty")
    def _split_blocks_with_empty(labels, num_clients, rng, *, users=None):
        """Blocks of B, 3 B, 0 and the rest of the rows: 1, 3, 0 and 36 batches of B on 400 rows."""
        return list(np.split(np.arange(len(labels)), [B, 4 * B, 4 * B]))


def test_the_split_familys_unit_is_the_mean_batches_of_a_client_with_data():
    """Under ``round`` a split client's work is its local batches over the mean client's: batches (1, 3, 0, 36)
    make it round(40 / 3) = 13 over the clients that train, as the star family's mean_round_steps (the empty
    client's 0 made it round(40 / 4) = 10); the empty client's 0 batches are 0 work."""
    cfg = cfg_dict({"name": "fsl_mc"}, {"work_unit": "round"}, clients=4)
    cfg["partition"] = {"name": "_split_blocks_with_empty", "num_clients": 4}
    algo = build_algorithm(RunContext(from_dict(cfg)))
    assert [algo.batcher.num_steps(c) for c in range(4)] == [1, 3, 0, 36]
    assert algo.reference_batches == 13
    np.testing.assert_array_equal(algo.relative_work(algo.client_steps(0, np.arange(4))), np.array([1, 3, 0, 36]) / 13)


def test_cse_fsl_times_its_uploads_in_batches():
    """CSE-FSL with a deadline: the upload after local batch m arrives at (m + 1) times the client's time per
    batch in step units ((m + 1) over the mean batches in round units), plus the latency."""
    faults = {"deadline": 4.0, "speed_sigma": 0.6, "work_unit": "step"}
    algo = make({"name": "cse_fsl", "h": 2}, faults)
    speed = Faults(algo.config.faults, Seeds(0)).arrival_times(0, [3], 1.0)[0]
    got = algo.upload_times(0, 3, [0, 1, 3])
    assert got.tolist() == (np.array([1.0, 2.0, 4.0]) * speed + algo.hp.latency).tolist()
    assert algo.finish_time(0, 3, algo.batcher.num_steps(3)) == algo.batcher.num_steps(3) * speed
    rounds = make({"name": "cse_fsl", "h": 2}, {**faults, "work_unit": "round"})
    assert rounds.upload_times(0, 3, [1]).tolist() == [2.0 / algo.reference_batches * speed + algo.hp.latency]


def test_the_default_unit_is_round_and_written_only_when_step(tmp_path):
    """The key left out and ``work_unit: round`` are the same run, with the same rows and the same config.yaml
    (which names the key only for ``step``, so the runs and checkpoints written before it stay as they were)."""
    cfg = _thirds(None, speed_sigma=0.5, deadline=1.2, dropout=0.2)
    plain = fedweave.run(cfg, run_dir=tmp_path / "plain")
    named = fedweave.run({**cfg, "faults": {**cfg["faults"], "work_unit": "round"}}, run_dir=tmp_path / "named")
    drop = ("wall_seconds",)
    assert [{k: v for k, v in m.items() if k not in drop} for m in plain.metrics] == [
        {k: v for k, v in m.items() if k not in drop} for m in named.metrics
    ]
    assert (tmp_path / "plain" / "config.yaml").read_text() == (tmp_path / "named" / "config.yaml").read_text()
    assert "work_unit" not in (tmp_path / "plain" / "config.yaml").read_text()
    assert load(_thirds("step")).to_dict()["faults"]["work_unit"] == "step"


def test_a_bad_unit_and_a_family_without_steps_are_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^faults.work_unit must be one of \['round', 'step'\], got 'steps'$"):
        load(_thirds("steps"))
    cfg = {**_clocked("fedavg", "step"), "algorithm": {"name": "gossip"}}
    cfg["faults"].pop("sim_time")
    with pytest.raises(
        ConfigError,
        match=r"^faults.work_unit: step: algorithm 'gossip' \(decentralized family\) counts no local steps per "
        r"client; the unit step is the star, split and hierarchical families'; use round",
    ):
        run_config(load(cfg), run_dir=tmp_path / "g")
    assert not any(tmp_path.iterdir())  # refused before anything is written


def test_the_unit_cannot_change_at_a_resume(tmp_path):
    cfg = {**_thirds(None, speed_sigma=0.5), "output": {"progress": False, "plots": False, "checkpoint_every": 2}}
    fedweave.run({**cfg, "rounds": 2}, run_dir=tmp_path / "r")
    with pytest.raises(ConfigError, match="faults changed since the checkpoint was written"):
        fedweave.resume(tmp_path / "r", ["rounds=4", "faults.work_unit=step"])
    resumed = fedweave.resume(tmp_path / "r", ["rounds=4"])  # the unchanged default resumes
    assert len(resumed.metrics) == 4


@pytest.mark.parametrize(
    ("alg", "opts", "extra"),
    [
        ("ditto_star", {"personal_epochs": 2}, [2.0, 4.0, 6.0]),  # lines 6-7: 2 epochs of 1, 2, 3 batches
        ("fedrep", {"head_epochs": 3}, [3.0, 6.0, 9.0]),  # lines 6-8: the head's 3 epochs
        ("apfl", {}, [1.0, 1.0, 1.0]),  # line 6: the personal pass, as long as the global one
    ],
)
@pytest.mark.parametrize("unit", ["round", "step"])
def test_personal_passes_are_local_work_on_the_clock(alg, opts, extra, unit):
    """Ditto, FedRep and APFL train a personal model (or head) each round besides the trainer's local steps (1
    here): the clock counts those steps too, so with ``step`` a round lasts the slowest client's total, and with
    ``round`` each client's total over the mean client's (rounded, as reference_steps is)."""
    cfg = _thirds(unit)
    cfg["local"] = {"steps": 1, "batch_size": 80, "lr": 0.1}
    cfg["algorithm"] = {**cfg["algorithm"], "name": alg, **opts}
    cfg["model"] = {"name": "mlp", "hidden": [8]}  # a body and a head (FedRep's)
    algo = _algo(cfg)
    total = 1.0 + np.array(extra)
    want = total if unit == "step" else total / round(total.mean())
    np.testing.assert_array_equal(algo.client_work(0, np.arange(3)), want)
    assert algo.run_round(0)["sim_time"] == want.max()  # speed_sigma 0: the slowest client's work


def test_runs_on_different_clock_units_get_no_plot_against_simulated_time(tmp_path, caplog):
    """A mean client's round and a local step are not one axis: ``fedweave plot`` and ``fedweave report`` of runs
    under ``round`` and ``step`` draw no figure against simulated time (a warning says why); runs of one unit do,
    the axis naming the unit under ``step``."""
    from fedweave.experiments.report import build_report
    from fedweave.plots import plot_runs

    for unit in ("round", "step"):
        cfg = _clocked("fedavg", unit, local={"steps": 5, "batch_size": 16, "lr": 0.2})
        fedweave.run(cfg, run_dir=tmp_path / unit)
    runs = [tmp_path / "round", tmp_path / "step"]
    with caplog.at_level("WARNING", logger="fedweave"):
        written = plot_runs(runs, tmp_path / "both")
        assert "different units (faults.work_unit: round, step)" in caplog.text
        assert not any(p.name.endswith("_vs_sim_time.png") for p in written)
        assert "test_accuracy_vs_sim_time.png" not in build_report(runs)
    assert tmp_path / "one" / "test_accuracy_vs_sim_time.png" in plot_runs(runs[1:], tmp_path / "one")
    from fedweave.plots import clock_label

    assert clock_label(runs[:1]) == "simulated time" and "local steps" in clock_label(runs[1:])


def test_the_warning_that_step_changes_nothing_names_only_keys_the_family_takes(tmp_path, caplog):
    """Without a deadline (or the star's clock) ``step`` changes nothing, and the warning says what would: the
    star's ``faults.deadline or faults.sim_time``, the split family's ``faults.deadline`` alone (it refuses
    ``faults.sim_time``)."""
    from tests.test_faults_split import cfg_dict, opts

    with caplog.at_level("WARNING", logger="fedweave"):
        fedweave.run(_cfg("fedavg", rounds=1) | {"faults": {"work_unit": "step"}}, run_dir=tmp_path / "star")
        assert "work_unit changes nothing in fedavg without faults.deadline or faults.sim_time" in caplog.text
        caplog.clear()
        cfg = cfg_dict(opts("cse_fsl"), {"work_unit": "step"}) | {"output": {"progress": False, "plots": False}}
        fedweave.run(cfg, run_dir=tmp_path / "split")
        assert "work_unit changes nothing in cse_fsl without faults.deadline\n" in caplog.text + "\n"
        assert "sim_time" not in caplog.text


def test_the_report_shows_the_default_unit_config_yaml_leaves_out(tmp_path):
    """``config.yaml`` leaves out ``work_unit: round`` (and ``sim_time: false``), so that older runs keep their
    files; the report's table of runs shows those defaults where the runs differ, not the "-" of a missing key."""
    from fedweave.experiments.report import build_report

    for unit in ("round", "step"):
        fedweave.run(_clocked("fedavg", unit, rounds=1), run_dir=tmp_path / unit)
    fedweave.run(_cfg("fedavg", rounds=1), run_dir=tmp_path / "plain")  # no clock: sim_time left out as well
    page = build_report([tmp_path / "round", tmp_path / "step", tmp_path / "plain"])
    cells = {}
    for table in re.findall(r'class="runs">(.*?)</table>', page):  # one table per run given
        heads = re.findall(r"<th>([^<]*)</th>", table)
        row = re.findall(r"<td[^>]*>(.*?)</td>", table)
        cells[row[0]] = dict(zip(heads, row))
    assert {name: (c["faults.work_unit"], c["faults.sim_time"]) for name, c in cells.items()} == {
        "round": ("round", "true"),
        "step": ("step", "true"),
        "plain": ("round", "false"),
    }
