"""fedweave's ServerApp and ClientApp in one process: a stand-in for Flower's Grid delivers each message to the
ClientApp of the node that holds its client, as Flower objects (``Message``, ``Context``, records), and
hands the reply back. No SuperLink, no SuperNodes: a quick check of everything on both sides of the wire,
for every method of a family; ``test_deploy_flower`` runs them across real processes."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import Array, Context, Message, RecordDict  # noqa: E402

from fedweave.callbacks import Callback  # noqa: E402
from fedweave.config import load  # noqa: E402
from fedweave.deploy import client_app, server_app  # noqa: E402
from fedweave.deploy.wire import from_records, tree_bytes  # noqa: E402
from fedweave.runner import run  # noqa: E402

CLIENTS = 4


@pytest.fixture(autouse=True)
def _task_identity(monkeypatch):
    """Flower's runtime says which run and node a process serves; here, one process serves them all."""
    from flwr.supercore.task_identity import TaskIdentity

    for attr, value in (("_run_id", 7), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, attr, value)


class InProcessGrid:
    """The Grid calls ``FlowerClients`` makes, answered at once by the nodes' ClientApp in this process.
    ``clients``: the clients that have a node; ``errors``: let a node's error reply through (else it fails the
    test); ``offline``: nodes that leave once ``offline_after`` train messages were sent; ``at_release``: the files
    in each node's state directory when the release query at the run's end reached it."""

    def __init__(self, config_json: str, state_dir, clients=range(CLIENTS), errors: bool = False) -> None:
        node_config = lambda c: {"partition-id": c, "state-dir": str(state_dir / f"node-{c}")}  # noqa: E731
        run_config = {"fedweave-config": config_json}
        self.contexts = {c + 1: Context(7, c + 1, node_config(c), RecordDict(), run_config) for c in clients}
        self.replies: dict[str, Message] = {}
        self.messages = self.jobs = 0
        self.errors, self.offline, self.offline_after = errors, set(), 0
        self.at_release: dict[int, list[str]] = {}

    def get_node_ids(self) -> list[int]:
        gone = self.offline if self.jobs >= self.offline_after else set()
        return [n for n in self.contexts if n not in gone]

    def push_messages(self, msgs: list[Message]) -> list[str]:
        ids = []
        for msg in msgs:
            msg.metadata.__dict__["_message_id"] = msg.object_id  # as the SuperLink does
            self.jobs += msg.metadata.message_type == "train"
            node = self.contexts[msg.metadata.dst_node_id]
            if msg.metadata.message_type == "query" and json.loads(from_records(msg.content)[0]).get("release"):
                self.at_release[msg.metadata.dst_node_id] = files_in(node.node_config["state-dir"])
            reply = client_app.app(msg, node)
            assert self.errors or not reply.has_error(), reply.error.reason
            self.replies[msg.metadata.message_id] = reply
            ids.append(msg.metadata.message_id)
        self.messages += len(msgs)
        return ids

    def pull_messages(self, ids: list[str]) -> list[Message]:
        return [self.replies.pop(i) for i in ids if i in self.replies]


def files_in(directory) -> list[str]:
    """The files under ``directory``, as paths relative to it."""
    root = Path(directory)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir())


def deployed(cfg: dict, tmp_path, grid: InProcessGrid | None = None, **app) -> tuple[dict, list[dict]]:
    config_json = json.dumps(load(cfg).to_dict())
    grid = grid or InProcessGrid(config_json, tmp_path)
    run_config = {"fedweave-config": config_json, "run-dir": str(tmp_path / "deployed"), "reply-timeout": 60.0,
                  "node-wait": 5.0, "on-error": "stop", **app}  # fmt: skip
    server_app.main(grid, Context(7, 0, {}, RecordDict(), run_config))
    out = tmp_path / "deployed"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return json.loads((out / "summary.json").read_text()), rows


def deployed_equals_simulation(
    cfg: dict, tmp_path, payload_is_ledger: bool = True, grid: InProcessGrid | None = None
) -> dict:
    """Deploy ``cfg`` (on ``grid``), assert every round's metrics equal the simulation's and (``payload_is_ledger``)
    the message payloads are the ledger's bytes; returns summary.json's flower section."""
    summary, rows = deployed(cfg, tmp_path, grid)
    sim = run(load(cfg), run_dir=tmp_path / "sim").metrics
    assert summary["status"] == "completed" and len(rows) == len(sim) == cfg["rounds"]
    for got, want in zip(rows, sim, strict=True):
        for k, v in want.items():
            if "wall" not in k:
                assert got[k] == pytest.approx(v, rel=1e-6, abs=1e-9), (k, got[k], v)
    fl, ledger = summary["flower"], summary["communication"]
    if payload_is_ledger:
        assert fl["payload_received"] == ledger["bytes_up"] > 0
        assert fl["payload_sent"] == ledger["bytes_down"]
    assert_flower_bytes(fl)
    return fl


def assert_flower_bytes(fl: dict) -> None:
    """Flower's bytes are the payload plus its framing less what it saves by sending identical arrays once;
    the ServerApp's push sends a round's start vector once for all its jobs."""
    for way in ("sent", "received"):
        assert fl[f"framing_{way}"] > 0 and fl[f"deduplicated_{way}"] >= 0
        assert fl[f"bytes_{way}"] == fl[f"payload_{way}"] + fl[f"framing_{way}"] - fl[f"deduplicated_{way}"]
    assert fl["bytes_pushed"] < fl["bytes_sent"]


HIERARCHICAL = {
    "zo_hfl-ball": {"name": "zo_hfl", "constraint": "ball", "radius": 0.5},
    "zo_hfl-box-no-crn": {"name": "zo_hfl", "constraint": "box", "box_low": -0.3, "crn": False},
    "hier_fedavg-server-client": {"name": "hier_fedavg", "server_data": "client"},
    "hier_fedprox": {"name": "hier_fedprox", "mu": 0.5},
    "hier_scaffold-server-client": {"name": "hier_scaffold", "server_data": "client"},
    "hier_scaffold-constant": {"name": "hier_scaffold", "local_schedule": "constant"},
}


@pytest.mark.parametrize("name", HIERARCHICAL)
def test_hierarchical_runs_deployed_in_process_equal_the_simulation(tmp_path, name):
    """The hierarchical family through the ServerApp and the nodes' ClientApp: the nodes derive the
    hierarchy's split, the decaying step size travels as a named schedule and the lower level's projection
    as data, the server's own share trains in the ServerApp, hier_scaffold's c_i stay on the nodes, ZO-HFL
    sends two jobs per client. Every metric equals the simulation's and the payload is the ledger's."""
    cfg = {
        "name": "h", "seed": 2, "rounds": 3, "backend": "loop", "dataset": {"name": "digits"},
        "partition": {"name": "dirichlet", "num_clients": CLIENTS, "alpha": 0.5}, "model": {"name": "logistic"},
        "algorithm": {"tau": 2, "participation": 0.75, **HIERARCHICAL[name]},
        "local": {"batch_size": 16, "lr": 0.1}, "output": {"progress": False, "plots": False},
    }  # fmt: skip
    fl = deployed_equals_simulation(cfg, tmp_path)
    per_client = 2 if name.startswith("zo_hfl") else 1  # ZO-HFL: the + and - solves
    assert fl["jobs"] == 3 * 3 * per_client  # 3 of 4 clients a round
    # the start-up queries, the jobs and the release queries at the end, and their replies
    assert fl["messages"] == 2 * CLIENTS + 2 * fl["jobs"] + 2 * CLIENTS


def _deployable(family: str) -> list[str]:
    """Every registered method of ``family`` that the deployment does not refuse (so a new one is covered)."""
    from fedweave.deploy.support import unsupported
    from fedweave.registry import ALGORITHMS

    names = [n for n in ALGORITHMS.names() if not n.startswith("_") and ALGORITHMS.get(n).family == family]
    synchronous = [n for n in names if not getattr(ALGORITHMS.get(n), "asynchronous", False)]  # fedasync, fedbuff
    return [n for n in synchronous if not unsupported(n, family, "stop")]


CENTRALIZED = _deployable("centralized")
REFUSED_CENTRALIZED = {  # a method computing on the clients' data outside their jobs, and why, in its line
    "perfedavg": "its evaluation adapts the global model on every client's data in the simulation",
}


@pytest.mark.parametrize("evaluation", [{"per_client": True}, {"personal_test": True, "holdout": 0.25}])
def test_an_evaluation_on_the_clients_own_samples_is_refused(evaluation):
    """``eval.per_client`` and ``eval.holdout`` evaluate on the clients' training samples, which only the nodes
    hold; deployed, the ServerApp had evaluated on its copy of the partition."""
    from fedweave.config import ConfigError
    from fedweave.deploy.support import check_deployable

    key = "eval.per_client" if "per_client" in evaluation else "eval.holdout"
    with pytest.raises(ConfigError, match=f"^{key} evaluates on the clients' own training samples"):
        check_deployable(load({**small("fedavg"), "eval": evaluation}), "stop")
    check_deployable(load({**small("fedavg"), "eval": {"personal_test": True}}), "stop")  # the test split's draws


def test_the_deployment_tests_cover_every_method_it_carries():
    """A method the deployment does not refuse is in this file's equality tests: a new one fails here first."""
    assert set(_deployable("decentralized")) == {a["name"] for a in DECENTRALIZED.values()}
    assert set(_deployable("hierarchical")) == {a["name"] for a in HIERARCHICAL.values()}


def test_every_centralized_method_deploys_or_is_refused_in_one_line():
    """A method that computes on its clients' data outside their jobs (Per-FedAvg's adaptation before evaluation)
    would run that in the ServerApp, on its copy of the partition: it is refused before anything is written.
    AFL's and q-FFL's losses and FedLC's margins are computed on the nodes (they are in CENTRALIZED)."""
    from fedweave.config import ConfigError
    from fedweave.deploy.support import check_deployable

    carried = {"fedavg", "scaffold", "fedmim", "fednova", "fedexp", "moon", "fedyogi", "afl", "qffl", "fedlc"}
    assert carried <= set(CENTRALIZED)
    for name, why in REFUSED_CENTRALIZED.items():
        assert name not in CENTRALIZED
        with pytest.raises(ConfigError, match=f"^algorithm '{name}' \\(centralized\\) cannot be deployed"):
            check_deployable(load(small(name, per_round=3)), "stop")
        with pytest.raises(ConfigError, match=re.escape(why)):
            check_deployable(load(small(name, per_round=3)), "stop")


@pytest.mark.parametrize("name", CENTRALIZED)
def test_centralized_runs_deployed_in_process_equal_the_simulation(tmp_path, name):
    """Every centralized method through the ServerApp and the nodes' ClientApp equals the simulation, and the
    arrays its messages carry are the ledger's bytes (a rule tensor equal to the job's start, FedProx's
    anchor, travels once)."""
    cfg = {
        "name": "c", "seed": 2, "rounds": 2, "backend": "loop", "dataset": {"name": "digits"},
        "partition": {"name": "dirichlet", "num_clients": CLIENTS, "alpha": 0.5}, "model": {"name": "logistic"},
        "algorithm": {"name": name, "clients_per_round": 3}, "local": {"steps": 3, "batch_size": 16, "lr": 0.1},
        "output": {"progress": False, "plots": False},
    }  # fmt: skip
    fl = deployed_equals_simulation(cfg, tmp_path)
    # FedMIM's first round: its two momentum combinations are both zero (no history yet), one array (650
    # float32 parameters and its header) in the wire for each of the 3 jobs; every other message has distinct
    # arrays
    zeros = tree_bytes(Array(np.zeros(650, np.float32)))
    assert fl["deduplicated_sent"] == (3 * zeros if name == "fedmim" else 0)
    assert fl["deduplicated_received"] == 0


@pytest.mark.parametrize(
    ("opts", "billed"),
    [({"alpha": [0.5], "beta": [0.0]}, 2), ({}, 3), ({"alpha": [0.5, 0.2, 0.1], "beta": [0.3, 0.2, 0.1]}, 4)],
    ids=["J1", "J2", "J3"],
)
def test_fedmim_jobs_carry_two_momentum_vectors_whatever_deltas_the_ledger_bills(tmp_path, opts, billed):
    """docs/deployment.md: a deployed FedMIM job carries x_t, m_alpha and m_beta (3 vectors) where the ledger
    bills x_t and one delta per j with a non-zero alpha_j or beta_j: the same bytes for the default J = 2, one
    vector more than the ledger for J = 1 (FedCM's case), one fewer for J = 3."""
    cfg = {
        "name": "c", "seed": 2, "rounds": 2, "backend": "loop", "dataset": {"name": "digits"},
        "partition": {"name": "dirichlet", "num_clients": CLIENTS, "alpha": 0.5}, "model": {"name": "logistic"},
        "algorithm": {"name": "fedmim", "clients_per_round": 3, **opts},
        "local": {"steps": 3, "batch_size": 16, "lr": 0.1}, "output": {"progress": False, "plots": False},
    }  # fmt: skip
    summary, _ = deployed(cfg, tmp_path)
    jobs, d = 2 * 3, 650 * 4  # rounds x clients; the logistic model's float32 bytes
    assert summary["communication"]["bytes_down"] == jobs * billed * d
    assert summary["flower"]["payload_sent"] == jobs * 3 * d


def gossip(algorithm: dict, rounds: int = 3, **more) -> dict:
    return {
        "name": "g", "seed": 2, "rounds": rounds, "backend": "loop", "dataset": {"name": "digits"},
        "partition": {"name": "dirichlet", "num_clients": CLIENTS, "alpha": 0.5}, "model": {"name": "logistic"},
        "algorithm": algorithm, "local": {"steps": 3, "batch_size": 16, "lr": 0.1},
        "output": {"progress": False, "plots": False}, **more,
    }  # fmt: skip


DECENTRALIZED = {
    "dfedavg": {"name": "dfedavg"},
    "dfedavgm-metropolis": {"name": "dfedavgm", "mixing": "metropolis"},
    "gossip-no-finetuning": {"name": "gossip", "finetune_epochs": 0},
    "fedavg_ft": {"name": "fedavg_ft"},
}
MODEL_BYTES = 650 * 4  # the logistic model on digits: 64 x 10 weights and 10 biases, float32


@pytest.mark.parametrize("name", DECENTRALIZED)
def test_gossip_runs_deployed_in_process_equal_the_simulation(tmp_path, name):
    """The decentralized family through the ServerApp that relays the gossip: every peer trains on its node,
    each round from the model the ServerApp mixed for it and, before each evaluation, a throw-away copy for
    the fine-tuning; the ServerApp keeps the peers' models and mixes them. Every metric equals the simulation,
    and each job carries one model down and one up (the ledger counts the peer-to-peer messages instead)."""
    algorithm = DECENTRALIZED[name]
    fl = deployed_equals_simulation(gossip(algorithm), tmp_path, payload_is_ledger=False)
    finetuning = 0 if algorithm.get("finetune_epochs") == 0 else 3 * CLIENTS  # an evaluation a round
    assert fl["jobs"] == 3 * CLIENTS + finetuning
    assert fl["payload_sent"] == fl["payload_received"] == fl["jobs"] * MODEL_BYTES


def test_a_peer_lost_while_the_run_evaluates_stops_it_in_one_line(tmp_path):
    """The gossip family's evaluation sends jobs too (each peer's fine-tuning): a peer whose node leaves after
    round 1's training stops the run with its results so far, as a lost job of a round does."""
    cfg = gossip({"name": "dfedavg"}, rounds=2)
    grid = InProcessGrid(json.dumps(load(cfg).to_dict()), tmp_path)
    grid.offline, grid.offline_after = {CLIENTS}, CLIENTS  # client 3's node, once round 1's training went out
    with pytest.raises(server_app.RunFailed, match=r"^fedweave run stopped: round 1: client 3: no SuperNode holding"):
        deployed(cfg, tmp_path, grid)
    summary = json.loads((tmp_path / "deployed" / "summary.json").read_text())
    assert summary["status"] == "stopped" and "a node lost while the run evaluates" in summary["error"]
    assert summary["flower"]["jobs"] == CLIENTS + CLIENTS - 1  # round 1's training, then the fine-tuning sent


def test_byzantine_peers_and_dropouts_in_deployed_gossip_equal_the_simulation(tmp_path):
    """Robust gossip deployed: the attacker's messages are forged in the ServerApp, as the star's attacks
    are, each peer's median is taken there, and a peer that drops out trains nothing that round."""
    faults = {"byzantine": {"clients": [1], "attack": "sign_flip"}, "dropout": 0.3}
    cfg = gossip({"name": "dfedavg", "finetune_epochs": 0}, rounds=4, faults=faults, aggregator={"name": "median"})
    fl = deployed_equals_simulation(cfg, tmp_path, payload_is_ledger=False)
    assert 0 < fl["jobs"] < 4 * CLIENTS  # the dropouts' jobs were not sent


@pytest.mark.parametrize(
    "algorithm, match",
    [
        ({"name": "afind_plus"}, r"'afind_plus' \(decentralized\) cannot be deployed on Flower yet: each peer scores"),
        ({"name": "pens"}, r"scores its neighbours' models on its own data"),
        ({"name": "choco_sgd"}, r"so the wire would carry dense models"),
        ({"name": "dispfl"}, r"sparse masks from gradients on their own data"),
        ({"name": "ditto"}, r"personal models never leave their peers"),
        ({"name": "local"}, r"there is no gossip to relay"),
        ({"name": "dfedavg", "selection": "topk"}, r"^algorithm.selection: 'topk' scores the neighbours' models"),
        ({"name": "dfedavg", "dp_sigma": 1.0, "dp_mode": "exchange"}, r"^algorithm.dp_mode: exchange cannot be"),
    ],
)
def test_gossip_the_relay_cannot_carry_is_refused_in_one_line(algorithm, match):
    from fedweave.config import ConfigError
    from fedweave.deploy.support import check_deployable

    with pytest.raises(ConfigError, match=match):
        check_deployable(load(gossip(algorithm)), "stop")
    with pytest.raises(ConfigError, match=r"on-error drop is not built for the decentralized family yet"):
        check_deployable(load(gossip({"name": "dfedavg"})), "drop")


SAMPLE_DP = {"level": "sample", "noise_multiplier": 1.0, "clip": 1.0}
PRIVATE = {
    "fedavg": lambda: {**small("fedavg", per_round=3), "privacy": {**SAMPLE_DP, "amplification": "none"}},
    "fedprox": lambda: {**small("fedprox", per_round=3), "privacy": {**SAMPLE_DP, "amplification": "none"}},
    "fedavg-user-level": lambda: {
        **small("fedavg", per_round=3),
        "privacy": {"noise_multiplier": 1.0, "clip": 1.0, "amplification": "none"},
    },  # fmt: skip
    "moon-user-level": lambda: {  # its clients' previous models stay on their nodes
        **small("moon", per_round=3, rounds=3),
        "privacy": {"noise_multiplier": 1.0, "clip": 1.0, "amplification": "none"},
    },  # fmt: skip
    "dfedavg-privacy": lambda: gossip({"name": "dfedavg"}, privacy=SAMPLE_DP),
    "dfedavg-dp_sigma": lambda: gossip({"name": "dfedavg", "dp_sigma": 1.0, "dp_clip": 1.0}),
}


@pytest.mark.parametrize("name", PRIVATE)
def test_private_runs_deployed_equal_the_simulation(tmp_path, name):
    """``privacy.level: sample`` (and the decentralized ``dp_sigma``) deployed: each job carries DP-SGD's clip and
    sigma, the node runs DP-SGD around the rule it rebuilds with the noise of the job's own stream, and the
    server's accountant counts the steps the nodes report. Every metric, epsilon included, equals the
    simulation (before, the nodes trained with plain SGD and the run reported epsilon 0). User-level DP-FedAvg,
    which the ServerApp applies to the nodes' updates, too."""
    cfg = PRIVATE[name]()
    deployed_equals_simulation(cfg, tmp_path, payload_is_ledger="privacy" in cfg and "dfedavg" not in name)
    rows = [json.loads(line) for line in (tmp_path / "deployed" / "metrics.jsonl").read_text().splitlines()]
    assert ("epsilon" in rows[-1]) == ("privacy" in cfg)
    assert rows[-1].get("epsilon", 1.0) > 0
    algorithm = {k: v for k, v in cfg["algorithm"].items() if not k.startswith("dp_")}
    plain = {**{k: v for k, v in cfg.items() if k != "privacy"}, "algorithm": algorithm}
    plain = run(load(plain), run_dir=tmp_path / "plain").metrics
    assert rows[-1]["test_loss"] != plain[-1]["test_loss"]  # the noise is there


def test_dp_sgd_on_the_nodes_refuses_a_malformed_dp_sgd_field():
    from fedweave.config import LocalConfig
    from fedweave.deploy.jobs import MalformedJobError, decode_job, encode_header, encode_job
    from fedweave.execution.job import PLAIN, LocalCall

    call = LocalCall(torch.zeros(1, 3), [0], 0, PLAIN, 0.1, 1, ())
    header, tensors = encode_job(call, 0, local=LocalConfig(steps=1), dp=(1.0, 0.5))
    assert decode_job(encode_header(header), tensors).dp == (1.0, 0.5)
    for bad in ({"clip": 0.0, "sigma": 1.0}, {"clip": 1.0, "sigma": -1.0}, {"clip": "x", "sigma": 1.0}, {"sigma": 1}):
        with pytest.raises(MalformedJobError, match=r"^malformed fedweave job message: .*dp_sgd"):
            decode_job(encode_header({**header, "dp_sgd": bad}), tensors)


@pytest.mark.parametrize("precision", ["float64", "bf16-mixed"])
def test_the_nodes_train_in_the_runs_precision(tmp_path, precision):
    """A node trains with the run's placement: float64 parameters and data, or bf16 autocast in its forward
    pass, exactly as the simulation does (the wire carries the run's dtype)."""
    cfg = {
        "name": "p", "seed": 2, "rounds": 2, "backend": "loop", "dataset": {"name": "digits"},
        "precision": precision, "model": {"name": "mlp", "hidden": [16]},
        "partition": {"name": "dirichlet", "num_clients": CLIENTS, "alpha": 0.5},
        "algorithm": {"name": "scaffold", "clients_per_round": 3}, "local": {"steps": 3, "batch_size": 16, "lr": 0.1},
        "output": {"progress": False, "plots": False},
    }  # fmt: skip
    deployed_equals_simulation(cfg, tmp_path)


def _on(kind: str):
    """A device of this machine of ``kind`` as a parameter (skipped where there is none)."""
    from fedweave.execution.placement import available_devices

    present = [d for d in available_devices() if d.split(":")[0] == kind]
    return pytest.param(present[0] if present else kind, marks=pytest.mark.skipif(not present, reason=f"no {kind}"))


@pytest.mark.parametrize("device", [_on("cpu"), _on("cuda")])
@pytest.mark.parametrize("name", ["scaffold", "dfedavg", "fedavg-dp-sgd"])
def test_the_nodes_train_on_the_runs_device(tmp_path, device, name):
    """A node follows the run's ``device``: it moves what arrives onto it and trains there (a stateful client
    with its state, a gossip peer, DP-SGD's per-sample gradients), and the deployed run equals its simulation
    on that device."""
    if name == "fedavg-dp-sgd":
        cfg = {**small("fedavg", per_round=3), "privacy": {"level": "sample", "noise_multiplier": 1.0, "clip": 1.0,
                                                            "amplification": "none"}}  # fmt: skip
    else:
        cfg = small(name) if name == "scaffold" else gossip({"name": name})
    deployed_equals_simulation({**cfg, "device": device}, tmp_path, payload_is_ledger=name != "dfedavg")


def small(name: str, rounds: int = 2, per_round: int = CLIENTS) -> dict:
    return {
        "name": "f", "seed": 2, "rounds": rounds, "backend": "loop", "dataset": {"name": "digits"},
        "partition": {"name": "dirichlet", "num_clients": CLIENTS, "alpha": 0.5}, "model": {"name": "logistic"},
        "algorithm": {"name": name, "clients_per_round": per_round},
        "local": {"steps": 2, "batch_size": 16, "lr": 0.1}, "output": {"progress": False, "plots": False},
    }  # fmt: skip


def test_an_injected_dropout_is_billed_its_download_but_sent_no_job(tmp_path):
    """``faults.dropout`` deployed: the run equals the simulation, whose ledger bills each dropout the model it
    received before it failed; the ServerApp sends a dropout no job, so Flower's payload down is the reporting
    clients' models only, below the ledger by the dropouts' downloads (docs/deployment.md, "Byte counts")."""
    cfg = {**small("fedavg", rounds=3, per_round=3), "faults": {"dropout": 0.3}}
    fl = deployed_equals_simulation(cfg, tmp_path, payload_is_ledger=False)
    rows = [json.loads(line) for line in (tmp_path / "deployed" / "metrics.jsonl").read_text().splitlines()]
    reported = sum(int(r["reported_clients"]) for r in rows)
    ledger = json.loads((tmp_path / "deployed" / "summary.json").read_text())["communication"]
    assert 0 < reported < 3 * 3 and fl["jobs"] == reported  # some clients dropped; no job for them
    assert fl["payload_sent"] == fl["payload_received"] == ledger["bytes_up"] == reported * MODEL_BYTES
    assert ledger["bytes_down"] == 3 * 3 * MODEL_BYTES > fl["payload_sent"]


RELEASED = {  # method, compression.upload
    "scaffold": ("scaffold", None),
    "scaffold-efsign": ("scaffold", "efsign"),
    "fedavg-topk-ef": ("fedavg", {"name": "topk", "ratio": 0.1}),
}


@pytest.mark.parametrize("name", RELEASED)
def test_the_release_at_a_runs_end_removes_every_file_the_run_wrote_on_its_nodes(tmp_path, name):
    """A node writes files for its client in ``<state-dir>/run-<id>``: a trial's samples (``client-<c>/samples.npz``),
    a stateful client's versions (SCAFFOLD's ``c_i``, ``client-<c>/round-<r>.npz``) and error-feedback residuals
    (``residuals/client-<c>/round-<r>.npz``); every run left them on a long-lived node. The ServerApp's release
    at the run's end removes all of them and the directories that this empties, and nothing else: a file in the
    run's directory that the run did not write (client 1's node), another run's directory (client 2's node) and
    a node's own ``data`` file (client 0's) stay."""
    from fedweave.deploy.node_data import export_clients

    method, upload = RELEASED[name]
    cfg = small(method) if upload is None else {**small(method), "compression": {"upload": upload}}
    config_json = json.dumps(load(cfg).to_dict())
    grid = InProcessGrid(config_json, tmp_path)
    (own,) = export_clients(load(cfg), tmp_path / "data", [0])
    grid.contexts[1].node_config["data"] = str(own)
    notes = tmp_path / "node-1" / "run-7" / "client-1" / "notes.txt"
    other_run = tmp_path / "node-2" / "run-6" / "client-2" / "round-1.npz"
    for f in (notes, other_run):
        f.parent.mkdir(parents=True)
        f.write_text("not this run's")
    before = {c: files_in(tmp_path / f"node-{c}") for c in range(CLIENTS)}
    summary, _ = deployed(cfg, tmp_path, grid)
    assert summary["status"] == "completed"
    for c in range(CLIENTS):
        written = sorted(set(grid.at_release[c + 1]) - set(before[c]))  # what the run wrote, as the release found it
        state = [f"run-7/client-{c}/round-0.npz", f"run-7/client-{c}/round-1.npz"] if method == "scaffold" else []
        residuals = [f"run-7/residuals/client-{c}/round-{r}.npz" for r in (0, 1)] if upload is not None else []
        samples = [f"run-7/client-{c}/samples.npz"] if c != 0 else []  # client 0's node reads its own data
        assert written == sorted(state + residuals + samples), (c, written)
        assert files_in(tmp_path / f"node-{c}") == before[c], c  # all of it gone, nothing else
    assert sorted(p.name for p in (tmp_path / "node-1" / "run-7").rglob("*")) == ["client-1", "notes.txt"]
    assert not (tmp_path / "node-3" / "run-7").exists() and own.is_file()
    fl = summary["flower"]
    # the start-up queries, the jobs, the release queries at the end, and the answers to each
    assert fl["messages"] == 2 * CLIENTS + 2 * fl["jobs"] + 2 * CLIENTS


def test_a_refused_or_stopped_run_raises_so_that_flower_records_it_as_failed(tmp_path):
    """Flower marks a run failed (``flwr list``: ``finished:failed``, the message as its details) only when
    the ServerApp's main raises. A run refused at start (no node holds client 3) raises before writing
    anything; a run stopped under ``on-error: stop`` (client 2's node cannot write its state: error 105)
    raises once its results so far, with the flower section, are written."""
    cfg = small("scaffold")
    config_json = json.dumps(load(cfg).to_dict())
    grid = InProcessGrid(config_json, tmp_path, clients=range(CLIENTS - 1))
    with pytest.raises(server_app.RunFailed, match=r"^fedweave run not started: no SuperNode holds clients \[3\]"):
        deployed(cfg, tmp_path / "refused", grid, **{"node-wait": 0.1})
    assert not (tmp_path / "refused").exists()

    (tmp_path / "node-2").write_text("")  # a file where the node's state directory should be
    grid = InProcessGrid(config_json, tmp_path, errors=True)
    with pytest.raises(server_app.RunFailed, match=r"^fedweave run stopped: round 1: client 2: error 105: cannot"):
        deployed(cfg, tmp_path, grid)
    summary = json.loads((tmp_path / "deployed" / "summary.json").read_text())
    assert summary["status"] == "stopped" and "client 2: error 105" in summary["error"]
    assert summary["flower"]["jobs"] == CLIENTS


def test_a_diverged_run_raises_once_its_results_and_flower_section_are_written(tmp_path):
    """A deployed run that diverged let the runner's ``DivergenceError`` through the ServerApp: a traceback of its
    own in the stream and a summary.json without the ``flower`` section. It is ``RunFailed`` now, as a stopped run
    is, once both are written."""
    cfg = {**small("fedavg"), "local": {"steps": 2, "batch_size": 16, "lr": 1e38}}
    with pytest.raises(server_app.RunFailed, match=r"^fedweave run diverged: round 1: .* is not finite") as e:
        deployed(cfg, tmp_path)
    assert str(e.value).endswith(f"Results so far are in {tmp_path / 'deployed'}")
    summary = json.loads((tmp_path / "deployed" / "summary.json").read_text())
    assert summary["status"] == "diverged" and summary["flower"]["jobs"] == CLIENTS
    assert summary["execution"]["backend"] == "flower"


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("on-error", "dorp", r"app config on-error must be one of stop, drop, got 'dorp'$"),
        ("reply-timeout", "abc", r"app config reply-timeout must be a number of seconds > 0, got 'abc'$"),
        ("reply-timeout", -1.0, r"app config reply-timeout must be a number of seconds > 0, got -1.0$"),
        ("node-wait", 0, r"app config node-wait must be a number of seconds > 0, got 0$"),
        ("run-dir", 5, r"app config run-dir must be a path as a string \('': the config's\), got 5$"),
        ("run-dir", True, r"app config run-dir must be a path as a string \('': the config's\), got True$"),
    ],
)
def test_a_bad_app_setting_is_refused_at_start_in_one_line(tmp_path, key, value, match):
    """``flwr run --run-config`` can set the app's keys to anything of TOML's types, past ``fedweave flower-app``'s
    checks: the ServerApp refuses a bad one as it refuses any run at start (``RunFailed``, one line naming the key
    and what is allowed), before it writes anything."""
    with pytest.raises(server_app.RunFailed, match=r"^fedweave run not started: " + match):
        deployed(small("fedavg", rounds=1), tmp_path, **{key: value})
    assert not (tmp_path / "deployed").exists()


@pytest.mark.parametrize(
    "value, match",
    [
        ("{rounds: 1", r"app config fedweave-config is not the run config as JSON \(Expecting property name"),
        ("[1, 2]", r"app config fedweave-config must be a mapping of the config's sections, got list$"),
        (7, r"app config fedweave-config must be the run config as a JSON string, got 7$"),
        ('{"rounds": 0}', r"rounds must be"),
    ],
)
def test_a_bad_app_config_is_refused_at_start_in_one_line(tmp_path, value, match):
    """The run config itself is an app config key (``fedweave-config``, which ``--run-config`` can replace): one
    that is not JSON, not a mapping, or not a valid config is refused like any run at start (``RunFailed``, one
    line), not with a traceback of the JSON decoder or the config loader as the run's status details."""
    with pytest.raises(server_app.RunFailed, match=r"^fedweave run not started: ") as e:
        deployed(small("fedavg", rounds=1), tmp_path, **{"fedweave-config": value})
    assert re.search(match, str(e.value)) and "\n" not in str(e.value)
    assert not (tmp_path / "deployed").exists()


def test_a_run_dir_holding_a_finished_run_is_refused_at_start_in_one_line(tmp_path):
    """An app with a fixed ``run-dir`` (``fedweave flower-app --run-dir``) run a second time: the results directory
    holds the first run, which the ServerApp refuses as any run at start (``RunFailed``, one line), not with the
    results' own exception as the run's status details; the first run's results stay as they were."""
    cfg = small("fedavg", rounds=1)
    deployed(cfg, tmp_path)
    summary = (tmp_path / "deployed" / "summary.json").read_bytes()
    with pytest.raises(server_app.RunFailed, match=r"^fedweave run not started: .* already holds a finished run") as e:
        deployed(cfg, tmp_path)
    assert "\n" not in str(e.value)
    # the ways out of the command line (--out, --overwrite) and Python's are not a deployed run's: another run-dir
    assert str(e.value).endswith("already holds a finished run; give another run-dir, e.g. flwr run ... --run-config "
                                 "\"run-dir='DIR'\"")  # fmt: skip
    assert (tmp_path / "deployed" / "summary.json").read_bytes() == summary


def test_a_config_problem_found_while_building_is_refused_at_start_in_one_line(tmp_path):
    """A config passes ``fedweave flower-app`` with what only building the run checks (a partitioner's option):
    the ServerApp refuses it as a run refused at start, one line naming the key, before it writes anything."""
    cfg = small("fedavg", rounds=1)
    cfg["partition"] = {**cfg["partition"], "alpha": -1.0}
    with pytest.raises(server_app.RunFailed, match=r"^fedweave run not started: partition") as e:
        deployed(cfg, tmp_path)
    assert "\n" not in str(e.value) and "alpha" in str(e.value)
    assert not (tmp_path / "deployed").exists()


def test_the_servers_progress_and_completion_lines_go_through_flowers_logger(tmp_path):
    """Flower forwards what its logger prints in the ServerApp's process to ``flwr run --stream``: fedweave's
    lines (a line per round trained and evaluated, the completion line) go there, once each."""
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append
    flower = logging.getLogger("flwr")
    flower.addHandler(handler)
    try:
        deployed(small("fedavg"), tmp_path)
    finally:
        flower.removeHandler(handler)
    lines = [r.getMessage() for r in seen if r.getMessage().startswith("fedweave")]
    assert [line.split(":")[0] for line in lines] == [
        "fedweave round 1/2 trained", "fedweave round 1/2 evaluated",
        "fedweave round 2/2 trained", "fedweave round 2/2 evaluated", f"fedweave run in {tmp_path / 'deployed'}",
    ]  # fmt: skip
    assert "test_accuracy" in lines[1] and lines[-1].endswith(": completed")
    assert logging.getLogger("fedweave").handlers == []  # given back after the run


def test_a_client_whose_node_is_offline_is_a_dropout_that_received_nothing(tmp_path):
    """``on-error: drop``: client 3's node leaves after round 1, so its jobs of rounds 2 and 3 are never sent.
    It is a dropout of those rounds (every metric but the downloads equals the simulation in which it drops
    out), and the ledger counts only the downloads that left: equal to Flower's payload. Gone at the run's end,
    it keeps its files, which the ServerApp says in a warning."""
    cfg = small("scaffold", rounds=3)
    grid = InProcessGrid(json.dumps(load(cfg).to_dict()), tmp_path)
    grid.offline, grid.offline_after = {CLIENTS}, CLIENTS  # client 3's node, once round 1's jobs went out
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append
    logging.getLogger("flwr").addHandler(handler)
    try:
        summary, rows = deployed(cfg, tmp_path, grid, **{"on-error": "drop"})
    finally:
        logging.getLogger("flwr").removeHandler(handler)
    # it is gone at the run's end, so it keeps its files: said in a warning (docs/deployment.md), not in silence
    gone = [r.getMessage() for r in seen if r.levelno == logging.WARNING and "not connected at the run's end" in
            r.getMessage()]  # fmt: skip
    assert gone == [
        "the SuperNodes of clients [3] are not connected at the run's end; they keep the files of this run in "
        "their state directories"
    ]
    fl, ledger = summary["flower"], summary["communication"]
    assert fl["dropped"] == fl["unsent"] == {"2": [3], "3": [3]} and fl["jobs"] == CLIENTS + 2 * (CLIENTS - 1)
    assert fl["payload_sent"] == ledger["bytes_down"] and fl["payload_received"] == ledger["bytes_up"]
    assert ledger["by_transfer"]["server->client:model+control"]["count"] == fl["jobs"]

    class Drop(Callback):  # the simulation: client 3 delivers nothing in rounds 2 and 3
        def on_build(self, state) -> None:
            algo, reporting = state.algo, state.algo.reporting
            algo.reporting = lambda r, c: (lambda kept: kept[~np.isin(kept, [3] if r > 0 else [])])(reporting(r, c))

    sim = run(load(cfg), run_dir=tmp_path / "sim", callbacks=[Drop()]).metrics
    for got, want in zip(rows, sim, strict=True):
        for k, v in want.items():
            if "wall" not in k and k not in ("bytes_down", "bytes_total"):
                assert got[k] == pytest.approx(v, rel=1e-6, abs=1e-9), (k, got[k], v)
    download = ledger["bytes_down"] // fl["jobs"]  # the simulation's dropout did receive its download
    assert sim[-1]["bytes_down"] - rows[-1]["bytes_down"] == 2 * download


def test_a_node_refuses_a_job_whose_settings_or_tensors_are_not_the_runs(tmp_path):
    """The node checks what it receives before training: the job's settings (kinds and ranges, as the config
    checks them) and every tensor (the model's vector in the run's dtype). A job that fails gets one error
    reply, 102, naming what is wrong; a good job of the same run trains."""
    from fedweave.config import LocalConfig
    from fedweave.deploy.jobs import encode_job
    from fedweave.deploy.wire import to_records
    from fedweave.execution.local import PLAIN, LocalCall

    config_json = json.dumps(load(small("fedavg")).to_dict())
    node = Context(
        7, 1, {"partition-id": 0, "state-dir": str(tmp_path)}, RecordDict(), {"fedweave-config": config_json}
    )
    start = torch.zeros(650)  # the logistic model on digits: 64 * 10 + 10 float32 parameters

    def reply(header: dict, tensors: dict) -> Message:
        msg = Message(to_records(header, tensors), dst_node_id=1, message_type="train")
        msg.metadata.__dict__["_message_id"] = msg.object_id
        return client_app.app(msg, node)

    def job(**change) -> tuple[dict, dict]:
        local = LocalConfig(steps=2, batch_size=16, lr=0.1)
        call = LocalCall(start[None], [0], 0, PLAIN, 0.1, 2, (1,))
        header, tensors = encode_job(call, 0, local=local, num_classes=10)
        return {**header, **change}, tensors

    assert not reply(*job()).has_error()
    header, tensors = job()
    cases = [
        (job(steps="2"), "the job's steps must be an integer, got '2'"),
        (job(round=-1), "the job's round must be >= 0, got -1"),
        (job(lr=float("nan")), "the job's lr must be a finite number >= 0, got nan"),
        (job(local={**header["local"], "batch_size": 0}), "the job's local.batch_size must be >= 1, got 0"),
        (job(client=True), "the job's client must be an integer, got True"),
        ((header, {"start": tensors["start"].double()}), "'start' is torch.float64; the run's parameters are"),
        ((header, {"start": start.reshape(2, 325)}), "job tensor 'start' has shape (2, 325); the run's model has 650"),
    ]  # fmt: skip
    for (h, t), why in cases:
        got = reply(h, t)
        assert got.has_error() and got.error.code == client_app.MALFORMED, why
        assert got.error.reason.startswith("malformed fedweave job message: "), got.error.reason
        assert why in got.error.reason, got.error.reason
        assert got.error.reason.count("malformed fedweave job message") == 1
    got = reply({"kind": "split_epoch", "client": "0"}, {})  # a split job: its client is checked first
    assert got.has_error() and got.error.code == client_app.MALFORMED
    assert got.error.reason == "malformed fedweave split job message: the job's client must be an integer, got '0'"


def test_a_node_trains_with_the_runs_threads(tmp_path):
    """The simulation's runner sets ``threads`` (``torch.set_num_threads``); the node trained on torch's default,
    and a deployed ``threads: 1`` run differed from its simulation in the 8th digit of every loss. Each job now
    sets the run's count, a star job and a split one alike."""
    from fedweave.config import LocalConfig
    from fedweave.deploy.jobs import encode_job
    from fedweave.deploy.wire import to_records
    from fedweave.execution.local import PLAIN, LocalCall

    def node(cfg: dict) -> Context:
        config_json = json.dumps(load(cfg).to_dict())
        return Context(
            7, 1, {"partition-id": 0, "state-dir": str(tmp_path)}, RecordDict(), {"fedweave-config": config_json}
        )

    def send(context: Context, header: dict, tensors: dict) -> Message:
        msg = Message(to_records(header, tensors), dst_node_id=1, message_type="train")
        msg.metadata.__dict__["_message_id"] = msg.object_id
        return client_app.app(msg, context)

    call = LocalCall(torch.zeros(650)[None], [0], 0, PLAIN, 0.1, 2, (1,))
    star = encode_job(call, 0, local=LocalConfig(steps=2, batch_size=16, lr=0.1), num_classes=10)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 1):
            torch.set_num_threads(3 - threads)
            assert not send(node({**small("fedavg"), "threads": threads}), *star).has_error()
            assert torch.get_num_threads() == threads
        torch.set_num_threads(2)
        split = {"kind": "split_epoch", "client": 0}  # refused as malformed after the run's threads are set
        assert send(node({**small("fedavg"), "threads": 1}), split, {}).has_error()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    "node_config, why",
    [
        ({}, "SuperNode --node-config must name 'partition-id=N' (the fedweave client it holds)"),
        ({"partition-id": 1.5}, "SuperNode --node-config partition-id must be a whole number >= 0, got 1.5"),
        ({"partition-id": "x"}, "SuperNode --node-config partition-id must be a whole number >= 0, got 'x'"),
        ({"partition-id": True}, "SuperNode --node-config partition-id must be a whole number >= 0, got True"),
        ({"partition-id": -1}, "SuperNode --node-config partition-id must be a whole number >= 0, got -1"),
    ],
)
def test_a_node_without_a_whole_partition_id_answers_the_query_with_one_line(tmp_path, node_config, why):
    """The start-up query asks a node which client it holds: a node config without ``partition-id``, or with one
    that is not a whole number >= 0 (Flower's ``--node-config`` parses ``1.5``, ``'x'`` and ``true`` as such),
    is error 107 with one line naming the key, not a client it was not meant to hold (``int(1.5)`` is 1) nor
    Flower's wrapping of an exception; the ServerApp names the line when it gives up waiting."""
    from fedweave.deploy.wire import to_records

    config_json = json.dumps(load(small("fedavg")).to_dict())
    node = Context(7, 1, {"state-dir": str(tmp_path), **node_config}, RecordDict(), {"fedweave-config": config_json})
    msg = Message(to_records({}, {}), dst_node_id=1, message_type="query")
    msg.metadata.__dict__["_message_id"] = msg.object_id
    got = client_app.app(msg, node)
    assert got.has_error() and got.error.code == client_app.NODE_CONFIG
    assert got.error.reason == why


def test_a_node_holding_no_client_of_the_run_is_named_when_the_run_is_refused(tmp_path):
    """A node whose ``partition-id`` is past the run's clients (``partition-id=4`` of clients 0 .. 3): the
    refusal names that node and its partition-id beside the clients nobody holds."""
    cfg = small("fedavg")
    grid = InProcessGrid(json.dumps(load(cfg).to_dict()), tmp_path, clients=range(CLIENTS - 1))
    grid.contexts[CLIENTS - 1].node_config["partition-id"] = CLIENTS  # node 3 (client 2's), one past the last
    with pytest.raises(server_app.RunFailed) as e:
        deployed(cfg, tmp_path, grid, **{"node-wait": 0.1})
    assert str(e.value).startswith("fedweave run not started: no SuperNode holds clients [2, 3] after waiting")
    assert f"node {CLIENTS - 1}: partition-id {CLIENTS} is not a client of the run (0 .. {CLIENTS - 1})" in str(e.value)


COMPRESSED = {  # method, compression.upload
    "fedavg-topk-ef": ("fedavg", {"name": "topk", "ratio": 0.1}),
    "fedadam-qsgd": ("fedadam", {"name": "qsgd", "levels": 4}),
    "fedprox-randk-ef": ("fedprox", {"name": "randk", "k": 60, "error_feedback": True}),
    "scaffold-efsign": ("scaffold", "efsign"),
    "feddyn-int8-ef": ("feddyn", {"name": "int8", "error_feedback": True}),
    "hier_scaffold-randk": ("hier_scaffold", {"name": "randk", "ratio": 0.2}),
    "hier_fedavg-topk-ef": ("hier_fedavg", {"name": "topk", "k": 40}),
}


@pytest.mark.parametrize("name", COMPRESSED)
def test_compressed_uploads_travel_encoded_and_equal_the_simulation(tmp_path, name):
    """compression.upload deployed: each node encodes its upload (a stateful client message by message), keeps
    its error-feedback residuals in its state directory and replies with the encoded bytes only; the server
    decodes them (random-k's coordinates from the client's stream). Every metric equals the simulation's, and
    the arrays of the replies are exactly the bytes the ledger bills for the uploads."""
    method, upload = COMPRESSED[name]
    hierarchical = method.startswith("hier")
    per_round = {"tau": 2, "participation": 0.75, "server_data": "client"} if hierarchical else {"clients_per_round": 3}
    cfg = {
        "name": "z", "seed": 2, "rounds": 3, "backend": "loop", "dataset": {"name": "digits"},
        "partition": {"name": "dirichlet", "num_clients": CLIENTS, "alpha": 0.5}, "model": {"name": "logistic"},
        "algorithm": {"name": method, **per_round},
        "local": {"steps": 3, "batch_size": 16, "lr": 0.1}, "compression": {"upload": upload},
        "output": {"progress": False, "plots": False},
    }  # fmt: skip
    if hierarchical:
        del cfg["local"]["steps"]
    grid = InProcessGrid(json.dumps(load(cfg).to_dict()), tmp_path)
    fl = deployed_equals_simulation(cfg, tmp_path, grid=grid)  # the reply arrays are the ledger's bytes_up
    assert 3 * fl["payload_received"] < fl["payload_sent"]  # no dense model came back (one went out per job)
    rows = [(tmp_path / d / "metrics.jsonl").read_text().splitlines() for d in ("deployed", "sim")]
    numbers = [[(m["train_loss"], m["test_loss"], m["test_accuracy"]) for m in map(json.loads, r)] for r in rows]
    assert numbers[0] == numbers[1]  # bit for bit
    residuals = [f for f in grid.at_release[1] if f.startswith("run-7/residuals/")]
    ef = name.endswith("-ef") or upload == "efsign"
    assert bool(residuals) == ef  # error feedback: the node keeps its residuals, until the run's end
    assert not (tmp_path / "node-0" / "run-7").exists()


def test_a_compressed_reply_the_server_did_not_use_leaves_the_nodes_residual_as_it_was(tmp_path):
    """Error feedback on the nodes under ``on-error: drop``: client 3's node trains in round 2 and writes its new
    residual, but its reply is lost; the server names round 1's residual version in client 3's round-3 job, so
    the run equals the simulation in which client 3 drops out of round 2 (its residual unchanged), bit for bit."""
    from flwr.app import Error

    cfg = {**small("fedavg", rounds=3), "compression": {"upload": {"name": "topk", "ratio": 0.05}}}

    class LosesOneReply(InProcessGrid):
        sent_to_3 = 0

        def push_messages(self, msgs):
            ids = super().push_messages(msgs)
            for msg, i in zip(msgs, ids, strict=True):
                if msg.metadata.dst_node_id == CLIENTS and msg.metadata.message_type == "train":
                    self.sent_to_3 += 1
                    if self.sent_to_3 == 2:  # round 2's reply of client 3: trained, then lost
                        self.replies[i] = Message(Error(999, "the reply was lost"), reply_to=msg)
            return ids

    grid = LosesOneReply(json.dumps(load(cfg).to_dict()), tmp_path, errors=True)
    summary, rows = deployed(cfg, tmp_path, grid, **{"on-error": "drop"})
    assert summary["flower"]["dropped"] == {"2": [3]}
    residuals = [f for f in grid.at_release[CLIENTS] if f.startswith("run-7/residuals/")]
    assert residuals == ["run-7/residuals/client-3/round-0.npz", "run-7/residuals/client-3/round-2.npz"]  # 1's, 3's

    class Drop(Callback):  # the simulation: client 3 delivers nothing in round 2
        def on_build(self, state) -> None:
            algo, reporting = state.algo, state.algo.reporting
            algo.reporting = lambda r, c: (lambda kept: kept[~np.isin(kept, [3] if r == 1 else [])])(reporting(r, c))

    sim = run(load(cfg), run_dir=tmp_path / "sim", callbacks=[Drop()]).metrics
    assert [(m["train_loss"], m["test_loss"]) for m in rows] == [(m["train_loss"], m["test_loss"]) for m in sim]
    ledger = summary["communication"]
    assert summary["flower"]["payload_received"] == ledger["bytes_up"]  # the lost reply carried no upload


@pytest.mark.parametrize(
    "method, attack",
    [
        ("fedavg", "label_flip"),
        ("hier_fedavg", "label_flip"),
        ("hier_scaffold", "alie"),
        ("fedavg", "sign_flip"),
        ("fedlc", "label_flip"),
        ("afl", "label_flip"),
    ],
)
def test_byzantine_clients_deployed_equal_the_simulation(tmp_path, method, attack):
    """``faults.byzantine`` deployed: an attack on the updates runs in the ServerApp (the star's and the
    hierarchical edge step's stage 1), and a label-flipping client's node derives its part of the data with the
    attack's labels, as the simulation's trainer has them (a trial: a node with its own data file trains on
    what the file holds). FedLC's margins and AFL's losses of a label-flipping client come from its flipped
    labels, on its node as in the simulation."""
    hierarchical = method.startswith("hier")
    per_round = {"tau": 2, "participation": 1.0} if hierarchical else {"clients_per_round": 4}
    cfg = {
        "name": "b", "seed": 2, "rounds": 2, "backend": "loop", "dataset": {"name": "digits"},
        "partition": {"name": "dirichlet", "num_clients": CLIENTS, "alpha": 0.5}, "model": {"name": "logistic"},
        "algorithm": {"name": method, **per_round},
        "local": {"batch_size": 16, "lr": 0.1, **({} if hierarchical else {"steps": 3})},
        "faults": {"byzantine": {"clients": [1, 2], "attack": attack}}, "output": {"progress": False, "plots": False},
    }  # fmt: skip
    deployed_equals_simulation(cfg, tmp_path)
    clean = run(load({**cfg, "faults": {}}), run_dir=tmp_path / "clean").metrics
    attacked = [json.loads(line) for line in (tmp_path / "deployed" / "metrics.jsonl").read_text().splitlines()]
    assert [m["test_loss"] for m in attacked] != [m["test_loss"] for m in clean]
    assert [m["byzantine_clients"] for m in attacked] == [2.0, 2.0]
