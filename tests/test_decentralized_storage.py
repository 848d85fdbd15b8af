"""What a decentralized peer holds beyond its model: ledger storage of role ``client``, per peer, the peak over
peers and rounds, checked against hand computations from the model size P, the graph's degrees, the neighbour
budget and the run's width (4 bytes a value in float32, 8 in float64)."""

from __future__ import annotations

import json

import pytest

import fedweave
from fedweave.algorithms.base import RunContext, build_algorithm
from fedweave.config import load
from tests.test_decentralized import config

WIDTH = {"float32": 4, "float64": 8}
INT64 = 8  # PENS's counts c_ij are int64
HOST = 8  # scores, weights and affinities are float64 host bookkeeping in either precision


def _built(name: str, precision: str, rounds: int = 1, **opts):
    cfg = config(name, **opts)
    cfg["precision"] = precision
    algo = build_algorithm(RunContext(load(cfg)))
    for r in range(rounds):
        algo.run_round(r)
    return algo, algo.ledger.summary()["storage_peak_bytes"].get("client", {})


def _star_and_ring(tmp_path) -> str:
    """8 clients on a ring plus spokes from client 0: client 0 has degree 7, clients 1 and 7 degree 2, the rest 3."""
    f = tmp_path / "star_ring.txt"
    ring = [f"{i} {(i + 1) % 8}" for i in range(8)]
    spokes = [f"0 {i}" for i in range(2, 7)]
    f.write_text("\n".join(ring + spokes) + "\n")
    return str(f)


@pytest.mark.parametrize("precision", ["float32", "float64"])
def test_dfedavgm_summary_holds_the_momentum_buffer_and_the_sampled_neighbours_models(precision, tmp_path):
    cfg = {**config("dfedavgm", topology="random_regular", degree=5, neighbours=3), "precision": precision}
    fedweave.run(cfg, run_dir=tmp_path / "run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    storage = summary["communication"]["storage_peak_bytes"]["client"]
    P = build_algorithm(RunContext(load(cfg))).layout.numel
    w = WIDTH[precision]
    assert storage == {"momentum": P * w, "received_models": 3 * P * w}  # 3 of 5 neighbours a round


@pytest.mark.parametrize("precision", ["float32", "float64"])
def test_dfedavg_with_metropolis_mixing_receives_from_every_neighbour_and_no_momentum(precision):
    algo, storage = _built("dfedavg", precision, topology="random_regular", degree=3, mixing="metropolis")
    assert storage == {"received_models": 3 * algo.layout.numel * WIDTH[precision]}


@pytest.mark.parametrize("precision", ["float32", "float64"])
def test_choco_copies_scale_with_the_graphs_max_degree(precision, tmp_path):
    runs = {
        "ring": _built("choco_sgd", precision, topology="ring"),  # every degree 2
        "star_ring": _built("choco_sgd", precision, topology="edgelist", edge_file=_star_and_ring(tmp_path)),
        "full": _built("choco_sgd", precision, topology="full"),  # every degree 7
    }
    for graph, max_degree in {"ring": 2, "star_ring": 7, "full": 7}.items():
        algo, storage = runs[graph]
        row = algo.layout.numel * WIDTH[precision]
        assert storage == {"public_copy": row, "neighbour_copies": max_degree * row}, graph


@pytest.mark.parametrize("precision", ["float32", "float64"])
def test_ditto_holds_its_personal_model_and_the_models_it_mixes(precision):
    algo, storage = _built("ditto", precision, topology="ring")
    row = algo.layout.numel * WIDTH[precision]
    assert storage == {"personal_model": row, "received_models": 2 * row}


@pytest.mark.parametrize("precision", ["float32", "float64"])
def test_dispfl_holds_its_mask_at_the_stores_dtype_and_the_received_masks(precision):
    algo, storage = _built("dispfl", precision, topology="random_regular", degree=3)
    row = algo.layout.numel * WIDTH[precision]
    # the mask its model is on (sent with it) and the evolved one it applies at the next aggregation
    assert storage == {"mask": row, "next_mask": row, "received_models": 3 * row, "received_masks": 3 * row}


@pytest.mark.parametrize("precision", ["float32", "float64"])
def test_pens_counts_follow_the_max_degree_and_phase_one_scores_every_sampled_model(precision, tmp_path):
    edges = _star_and_ring(tmp_path)
    algo, storage = _built("pens", precision, topology="edgelist", edge_file=edges, neighbours=3, m_top=1)
    row = algo.layout.numel * WIDTH[precision]
    assert storage == {"counts": 7 * INT64, "received_models": 3 * row, "scores": 3 * HOST}


def test_afind_plus_holds_the_pool_its_proxies_scores_and_the_coreset(tmp_path):
    algo, storage = _built("afind_plus", "float64", topology="random_regular", degree=5, neighbours=4, tau=0.0)
    row, d_phi = algo.layout.numel * 8, algo.proxy.size
    # tau 0: theta_i = 0 keeps the whole pool of 4; the scores are F_j(w_i) of i and the pool (5), s_ij and
    # p_ij over the pool (4 + 4) and F~ of the 4 selected and i itself (5)
    assert storage == {
        "selection_state": HOST,
        "feature_proxies": 5 * d_phi * 8,
        "requested_model": row,
        "received_models": 4 * row,
        "scores": (5 + 4 + 4 + 5) * HOST,
    }


def test_local_holds_only_the_buffer_of_its_heavy_ball_local_steps():
    cfg = config("local")
    cfg["local"] = {**cfg["local"], "momentum": 0.5}
    algo = build_algorithm(RunContext(load(cfg)))
    algo.run_round(0)
    storage = algo.ledger.summary()["storage_peak_bytes"]
    assert storage == {"client": {"momentum": algo.layout.numel * 4}}  # and nothing beside it


def test_fomo_with_the_afind_plugin_scores_no_boltzmann_weights_it_would_not_read():
    """FOMO weighs what it receives by its own u~: the plug-in's Boltzmann losses F_i(w_j) of i and the selected
    were computed all the same and counted in ``scores`` ((2 * 4 + 1 + 4) * 8 bytes with the whole pool of 4 kept);
    now a peer holds s_ij and p_ij over the pool (4 + 4), above FOMO's own u over itself and the selected (5)."""
    algo, storage = _built("fomo", "float32", topology="random_regular", degree=5, neighbours=4, selection="afind")
    assert algo.selector.last_sizes == [4] * 8  # round 0: theta_i = 0 keeps the whole pool
    assert storage["scores"] == (4 + 4) * HOST
