"""fedweave's ServerApp and ClientApp in one process: a stand-in for Flower's Grid delivers each message to the
ClientApp of the node that holds its client, as Flower objects (``Message``, ``Context``, records), and
hands the reply back. No SuperLink, no SuperNodes: a quick check of everything on both sides of the wire,
for every method of a family; ``test_deploy_flower`` runs them across real processes."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("flwr")

from flwr.app import Context, Message, RecordDict  # noqa: E402

from fedweave.config import load  # noqa: E402
from fedweave.deploy import client_app, server_app  # noqa: E402
from fedweave.runner import run  # noqa: E402

CLIENTS = 4


@pytest.fixture(autouse=True)
def _task_identity(monkeypatch):
    """Flower's runtime says which run and node a process serves; here, one process serves them all."""
    from flwr.supercore.task_identity import TaskIdentity

    for attr, value in (("_run_id", 7), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, attr, value)


class InProcessGrid:
    """The Grid calls ``FlowerClients`` makes, answered at once by the nodes' ClientApp in this process."""

    def __init__(self, config_json: str, state_dir) -> None:
        node_config = lambda c: {"partition-id": c, "state-dir": str(state_dir / f"node-{c}")}  # noqa: E731
        run_config = {"fedweave-config": config_json}
        self.contexts = {c + 1: Context(7, c + 1, node_config(c), RecordDict(), run_config) for c in range(CLIENTS)}
        self.replies: dict[str, Message] = {}
        self.messages = 0

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def push_messages(self, msgs: list[Message]) -> list[str]:
        ids = []
        for msg in msgs:
            msg.metadata.__dict__["_message_id"] = msg.object_id  # as the SuperLink does
            reply = client_app.app(msg, self.contexts[msg.metadata.dst_node_id])
            assert not reply.has_error(), reply.error.reason
            self.replies[msg.metadata.message_id] = reply
            ids.append(msg.metadata.message_id)
        self.messages += len(msgs)
        return ids

    def pull_messages(self, ids: list[str]) -> list[Message]:
        return [self.replies.pop(i) for i in ids if i in self.replies]


def deployed(cfg: dict, tmp_path) -> tuple[dict, list[dict]]:
    config_json = json.dumps(load(cfg).to_dict())
    grid = InProcessGrid(config_json, tmp_path)
    run_config = {"fedweave-config": config_json, "run-dir": str(tmp_path / "deployed"), "reply-timeout": 60.0,
                  "node-wait": 5.0, "on-error": "stop"}  # fmt: skip
    server_app.main(grid, Context(7, 0, {}, RecordDict(), run_config))
    out = tmp_path / "deployed"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return json.loads((out / "summary.json").read_text()), rows


def deployed_equals_simulation(cfg: dict, tmp_path) -> dict:
    """Deploy ``cfg``, assert every round's metrics equal the simulation's and the message payloads are the
    ledger's bytes; returns summary.json's flower section."""
    summary, rows = deployed(cfg, tmp_path)
    sim = run(load(cfg), run_dir=tmp_path / "sim").metrics
    assert summary["status"] == "completed" and len(rows) == len(sim) == cfg["rounds"]
    for got, want in zip(rows, sim, strict=True):
        for k, v in want.items():
            if "wall" not in k:
                assert got[k] == pytest.approx(v, rel=1e-6, abs=1e-9), (k, got[k], v)
    fl, ledger = summary["flower"], summary["communication"]
    assert fl["payload_received"] == ledger["bytes_up"] > 0
    assert fl["payload_sent"] == ledger["bytes_down"]
    return fl


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
    assert fl["messages"] == 2 * CLIENTS + 2 * fl["jobs"]  # the start-up queries, the jobs and their replies


CENTRALIZED = ["fedavg", "fedadam", "fedopt", "scaffold", "feddyn", "fedcm", "mofedsam", "fedsam", "fedprox", "fedmim"]


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
    deployed_equals_simulation(cfg, tmp_path)


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
