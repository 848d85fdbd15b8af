"""The ledger's accounting of what the protocol moves and keeps, counted by hand on the centralized toy (8
clients of 60 samples, 3 a round, a logistic model of 148 float32 parameters, 4 classes): the losses that a
sampler selecting by the clients' context reads, the server state of AFL, IFCA, CFL and FedProto, and
compressed SCAFFOLD's messages beside the dense ones."""

from __future__ import annotations

import numpy as np
import pytest

from tests.test_centralized import D_TOY, _algo, _cfg, _rounds
from tests.test_compression import _with

F32 = 4
MLP = {"name": "mlp", "hidden": [8]}  # 36 -> 8 -> 4: body 36*8 + 8 = 296 values, head 8*4 + 4 = 36


def _storage(algo) -> dict:
    return algo.ledger.summary()["storage_peak_bytes"]


# ---- the losses a context sampler reads --------------------------------------------------------------------
@pytest.mark.parametrize("sampler", [{"name": "power_of_choice", "d": 6}, {"name": "oort"}])
@pytest.mark.parametrize("alg", ["fedavg", "fedper", "pfedme"])
def test_a_context_sampler_bills_each_reporting_clients_loss_and_keeps_the_table(sampler, alg):
    """Each of the 3 reporting clients sends its mean training loss with its upload: 3 float32 up per round,
    no message of its own; the server keeps a float64 loss and an int64 round for each of the 8 clients. The
    three places that feed the table (the template, the personalized one, pFedMe's) all bill it."""
    algo = _algo({**_cfg(alg, rounds=2), "sampler": sampler})
    plain = _algo(_cfg(alg, rounds=2))
    _rounds(algo, 2)
    _rounds(plain, 2)
    for r in (0, 1):
        assert algo.ledger.bytes("up", round=r, kind="train_loss") == 3 * F32
        assert algo.ledger.bytes("up", round=r) == plain.ledger.bytes("up", round=r) + 3 * F32
    assert algo.ledger.count(kind="train_loss") == 0  # it rides in the upload: no message of its own
    assert algo.ledger.count(sender="client") == plain.ledger.count(sender="client") == 2 * 3
    assert _storage(algo)["server"]["client_history"] == 8 * (8 + 8)


def test_a_context_sampler_bills_only_the_clients_that_report():
    algo = _algo({**_cfg("fedavg", rounds=4), "sampler": {"name": "oort"}, "faults": {"dropout": 0.5}})
    for r in range(4):
        algo.run_round(r)
        reported = int(np.count_nonzero(algo.client_history.last_round == r))
        assert algo.ledger.bytes("up", round=r, kind="train_loss") == reported * F32


def test_a_sampler_without_a_context_bills_no_loss_and_keeps_no_table():
    algo = _algo(_cfg("fedavg"))
    _rounds(algo, 2)
    assert algo.ledger.bytes(kind="train_loss") == 0
    assert "client_history" not in _storage(algo).get("server", {})


# ---- server state in the storage figures -------------------------------------------------------------------
def test_afl_keeps_its_mixture_weights_on_the_server():
    algo = _algo(_cfg("afl"))
    assert _storage(algo)["server"] == {"mixture_weights": 8 * F32}  # lambda, one per client


@pytest.mark.parametrize("clusters", [1, 3])
def test_ifca_keeps_its_cluster_models_on_the_server(clusters):
    algo = _algo(_cfg("ifca", clusters=clusters))
    assert _storage(algo)["server"] == {"cluster_models": clusters * D_TOY * F32}


def test_ifca_sharing_its_body_keeps_one_body_and_a_head_per_cluster():
    algo = _algo({**_cfg("ifca", clusters=2, share_body=True), "model": MLP})
    assert _storage(algo)["server"] == {"cluster_models": (296 + 2 * 36) * F32}


def test_cfl_keeps_a_model_per_cluster_at_its_peak_and_each_clients_cluster():
    # every client each round; eps1 above any mean update and eps2 = 0: the one cluster of 8 splits in round 1
    algo = _algo(_cfg("clustered_fl", clients_per_round=8, eps1=1e9, eps2=0.0, warmup=0))
    assert _storage(algo)["server"] == {"cluster_models": D_TOY * F32, "cluster_assignment": 8 * 8}
    out = algo.run_round(0)
    assert out["clusters"] == 2.0
    assert _storage(algo)["server"] == {"cluster_models": 2 * D_TOY * F32, "cluster_assignment": 8 * 8}


def test_fedproto_keeps_its_global_prototypes_on_the_server():
    algo = _algo({**_cfg("fedproto"), "model": MLP})
    # 4 classes x D = 8 float32 values, and one byte per class saying whether it has a prototype yet
    assert _storage(algo)["server"] == {"prototypes": 4 * 8 * F32 + 4}


# ---- compressed SCAFFOLD -----------------------------------------------------------------------------------
def test_compressed_scaffold_counts_the_messages_the_dense_run_counts():
    """SCAFFOLD's client sends (Delta y_i, Delta c_i) in one upload (Alg. 1 line 13), dense or compressed: one
    message per reporting client either way, the compressed one carrying its two encoded tensors (efsign: 32
    bits of scale and a sign per value, each)."""
    dense, packed = _algo(_cfg("scaffold")), _algo(_with(_cfg("scaffold"), "efsign"))
    _rounds(dense, 2)
    _rounds(packed, 2)
    kind = "update+control_delta"
    assert packed.ledger.count(kind=kind) == dense.ledger.count(kind=kind) == 2 * 3
    assert dense.ledger.bytes("up", round=1) == 3 * 2 * D_TOY * F32
    assert packed.ledger.bytes("up", round=1) == 3 * 2 * ((32 + D_TOY + 7) // 8)


def test_fedasync_keeps_the_version_each_client_in_flight_was_sent():
    # concurrency 2: two clients in flight, an int64 version tau each, which their staleness t - tau reads
    algo = _algo(_cfg("fedasync", concurrency=2))
    _rounds(algo, 2)
    assert _storage(algo)["server"] == {"in_flight_versions": 2 * 8}


def test_fedbuff_keeps_its_buffer_of_k_updates_and_the_versions_in_flight():
    # K = 2 updates of D_TOY float32 values in the buffer; 3 clients in flight (clients_per_round), a version each
    algo = _algo(_cfg("fedbuff", buffer_size=2))
    _rounds(algo, 2)
    assert _storage(algo)["server"] == {"update_buffer": 2 * D_TOY * F32, "in_flight_versions": 3 * 8}
