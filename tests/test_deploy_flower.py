"""fedweave on Flower's deployment engine: a real SuperLink and real SuperNode processes on 127.0.0.1.

One federation serves the module: ``flower-superlink --insecure`` and one ``flower-supernode`` per client,
each in its own process group and stopped by a finalizer even when a test fails. The nodes run with
``--isolation process`` and a ``fedweave flower-executor`` each (one warm process that forks a child per
message, instead of a fresh ClientApp process that imports torch again); the node that the fault test
restarts comes back with Flower's default ``--isolation subprocess``, so both ways of running a ClientApp
train and are compared. Clients 0 and 1 derive their partition of the configured dataset
(``partition-id``); client 2's node reads only its own data file (``data``), so every comparison with the
simulation covers both. Each run is an app written with ``fedweave flower-app``'s writer and run with
``flwr run --stream``; its metrics are compared with the simulation's ``loop`` backend (computed while the
run goes on), Flower's payload bytes with the ledger, and its end with what ``flwr list`` reports. One run
shows as many facts as it can (each run costs a ServerApp process and a message per client and round, about
4 s apiece for Flower's polling), and the runs no fault test touches go side by side on the federation, each
test's at once. The fault tests kill, restart or break the node of client 2 and leave it
healthy again for the tests after them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flwr")

from benchmarks.federation import BIN  # noqa: E402
from benchmarks.federation import Federation as LocalFederation  # noqa: E402
from fedweave.callbacks import Callback  # noqa: E402
from fedweave.config import load  # noqa: E402
from fedweave.deploy.node_data import export_clients  # noqa: E402
from fedweave.deploy.project import write_app  # noqa: E402
from fedweave.runner import run  # noqa: E402

CLIENTS = 3
DATA_NODE = 2  # its node holds the client's samples in a file (node data) instead of deriving its partition
pytestmark = pytest.mark.slow


def config(
    algorithm: dict, rounds: int = 2, model: dict | None = None, steps: int | None = 4, per_round: int | None = CLIENTS
) -> dict:
    """Every test's config: the same data, partition and seed (so client 2's one data file serves all)."""
    return {
        "name": f"flower-{algorithm['name']}",
        "seed": 5,
        "rounds": rounds,
        "backend": "loop",
        "dataset": {"name": "digits", "as_image": True},
        "partition": {"name": "dirichlet", "num_clients": CLIENTS, "alpha": 0.5},
        "model": model or {"name": "logistic"},
        "algorithm": {**({"clients_per_round": per_round} if per_round else {}), **algorithm},
        "local": {"steps": steps, "batch_size": 16, "lr": 0.05},
        "output": {"progress": False, "plots": False},
    }


class Federation(LocalFederation):
    """The module's federation (benchmarks/federation.py), its nodes by client, so that a test can kill one."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, task_poll=0.2)
        self.nodes: dict[int, subprocess.Popen] = {}
        self.executors: dict[int, subprocess.Popen] = {}

    def supernode(
        self, client: int, state_dir: Path | None = None, isolation: str = "process", data: str = "data"
    ) -> subprocess.Popen:
        """The node of ``client``; the last client's node reads its own data file (``data``, from the folder
        of that name). ``process``: with a ``fedweave flower-executor`` running its ClientApps;
        ``subprocess``: Flower's default."""
        state_dir = state_dir or self.root / f"state-{client}"
        node_config = f"partition-id={client} state-dir='{state_dir}'"
        if client == DATA_NODE:
            node_config += f" data='{self.root / data / f'client-{client}.npz'}'"
        self.nodes[client], executor = self.start_node(client, node_config, isolation)
        if executor is not None:
            self.executors[client] = executor
        return self.nodes[client]

    def kill(self, client: int) -> None:
        """SIGKILL the node of ``client`` and everything it started (a crash, not a shutdown)."""
        for p in (self.nodes.pop(client), self.executors.pop(client, None)):
            if p is not None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def run_status(self, output: str) -> tuple[str, str]:
        """``flwr list``'s status and status details of the run that ``flwr run``'s ``output`` started."""
        (run_id,) = re.findall(r"Successfully started run (\d+)", output)
        cmd = [str(BIN / "flwr"), "list", "local", "--run-id", run_id, "--format", "json"]
        done = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60, check=True)
        (run,) = json.loads(done.stdout)["runs"]
        return run["status"], run["status-details"]


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    fed = Federation(tmp_path_factory.mktemp("federation"))
    # client 2's samples in its own file, as fedweave flower-app --node-data writes them: every test's config
    # shares the dataset, partition and seed, so the file is the simulation's client 2
    export_clients(load(config({"name": "fedavg"})), fed.root / "data", [DATA_NODE])
    try:
        fed.superlink()
        fed.wait_listening()
        for i in range(CLIENTS):
            fed.supernode(i)
        yield fed
    finally:
        fed.stop()


def write(cfg: dict, tmp_path: Path, **app) -> tuple[Path, Path]:
    run_dir = tmp_path / "deployed"
    app = {"node_wait": 90.0, "reply_timeout": 150.0, **app}
    write_app(load(cfg), tmp_path / "app", run_dir=str(run_dir), **app)
    return tmp_path / "app", run_dir


def results(run_dir: Path, output: str, fed: Federation) -> tuple[dict, list[dict]]:
    summary = run_dir / "summary.json"
    assert summary.is_file(), f"flwr run: {output}\n{fed.logs()}"
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    return json.loads(summary.read_text()), rows


def deployed(fed: Federation, cfg: dict, tmp_path: Path, **app) -> tuple[dict, list[dict], str]:
    tmp_path.mkdir(exist_ok=True)
    app_dir, run_dir = write(cfg, tmp_path, **app)
    done = fed.flwr_run(app_dir)
    output = done.stdout + done.stderr
    return (*results(run_dir, output, fed), output)


def simulated(cfg: dict, tmp_path: Path, dropped: dict[str, list[int]] | None = None) -> list[dict]:
    """The ``loop`` simulation of ``cfg``; ``dropped[str(round)]``: clients that deliver nothing in that round
    (1-based), as ``faults.dropout`` would decide."""
    gone = {int(r) - 1: c for r, c in (dropped or {}).items()}

    class Drop(Callback):
        def on_build(self, run_state) -> None:
            algo = run_state.algo
            reporting = algo.reporting

            def without(r, clients):
                kept = reporting(r, clients)
                return kept[~np.isin(kept, gone.get(r, []))]

            algo.reporting = without

    return run(load(cfg), run_dir=tmp_path / "sim", callbacks=[Drop()] if gone else ()).metrics


def assert_same_metrics(rows: list[dict], sim: list[dict], but: tuple[str, ...] = ()) -> None:
    """Every metric of every round, but the wall-clock time (and ``but``), equals the simulation's (to float
    tolerance: the nodes' processes may use other thread counts)."""
    assert len(rows) == len(sim)
    for got, want in zip(rows, sim, strict=True):
        assert {"test_accuracy", "test_loss", "bytes_up", "bytes_down"} <= set(want)
        for k, v in want.items():
            if k != "wall_seconds" and k not in but:
                assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-6), (k, got, want)


def assert_payload_is_the_ledger(summary: dict) -> None:
    """Both byte counts: the arrays the messages carry are the ledger's protocol, byte for byte; Flower's
    serialised messages are that plus its framing, less what it saves by sending identical arrays of a
    message once (which can outweigh the framing: FedMIM's first round, docs/deployment.md)."""
    fl, ledger = summary["flower"], summary["communication"]
    assert fl["payload_received"] == ledger["bytes_up"]
    assert fl["payload_sent"] == ledger["bytes_down"]
    for way, direction in (("sent", "bytes_down"), ("received", "bytes_up")):
        assert fl[f"framing_{way}"] > 0 and fl[f"deduplicated_{way}"] >= 0
        assert fl[f"bytes_{way}"] == ledger[direction] + fl[f"framing_{way}"] - fl[f"deduplicated_{way}"]
    assert fl["overhead_bytes"] == fl["bytes_sent"] + fl["bytes_received"] - ledger["bytes_total"]


SPLIT_MODEL = {"name": "split_small", "aux": "mlp", "width": 4, "hidden": 16}
CENTRALIZED = {name: config({"name": name}, rounds=3) for name in ("fedavg", "scaffold", "fedmim")}
SPLIT = {  # name: (algorithm, local steps, clients per round)
    "cse_fsl": ({"name": "cse_fsl", "h": 2}, 4, CLIENTS),
    "fsl_an": ({"name": "fsl_an"}, 2, CLIENTS),
    "fsl_mc": ({"name": "fsl_mc"}, 2, CLIENTS),
    "fsl_oc": ({"name": "fsl_oc"}, 2, 2),
}
SPLIT_RUNS = {  # the split family trains in its own loop: it reads (and takes) no backend
    name: {key: v for key, v in config(a, model=SPLIT_MODEL, steps=k, per_round=n).items() if key != "backend"}
    for name, (a, k, n) in SPLIT.items()
}


class Deployed:
    """A run on the federation: the app, its results directory and, once it ended, ``flwr run``'s output."""

    def __init__(self, fed: Federation, cfg: dict, root: Path, **app) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.fed, self.cfg, self.root = fed, cfg, root
        self.app, self.run_dir = write(cfg, root, **app)
        self.proc = fed.flwr_run(self.app, wait=False)
        self.output = ""

    def wait(self, timeout: float = 600) -> Deployed:
        try:
            self.output, _ = self.proc.communicate(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        return self

    def results(self) -> tuple[dict, list[dict]]:
        return results(self.run_dir, self.output, self.fed)


def deployed_and_simulated(fed: Federation, cfg: dict, root: Path) -> tuple[Deployed, list[dict]]:
    """Deploy ``cfg`` and compute its simulation while the run goes on."""
    run = Deployed(fed, cfg, root)
    sim = simulated(cfg, root)
    return run.wait(), sim


def all_deployed_and_simulated(
    fed: Federation, cfgs: dict[str, dict], root: Path
) -> dict[str, tuple[Deployed, list[dict]]]:
    """Deploy every config of ``cfgs`` at once on the federation (a SuperLink serves several runs, and a node
    keeps each run's client state apart, in a folder per run), compute their simulations while they go on, then
    wait for each: by name, the run (in ``root/<name>``) and its simulation. Most of a deployed run's time is
    Flower's polling, so runs side by side take little longer than one."""
    runs = {name: Deployed(fed, cfg, root / name) for name, cfg in cfgs.items()}
    sims = {name: simulated(cfg, root / name) for name, cfg in cfgs.items()}
    return {name: (run.wait(), sims[name]) for name, run in runs.items()}


GOSSIP = {"dfedavg": config({"name": "dfedavg"}, per_round=None)}  # the decentralized family, relayed by the ServerApp
DP_SGD = {  # privacy.level sample: DP-SGD on the nodes
    "fedavg-dp-sgd": {
        **config({"name": "fedavg"}),
        "privacy": {"level": "sample", "noise_multiplier": 1.0, "clip": 1.0, "amplification": "none"},
    }
}


def test_deployed_runs_equal_simulation(federation, tmp_path):
    """FedAvg (the plain rule), SCAFFOLD (c_i kept on the nodes across rounds) and FedMIM (a rule with
    tensors: its two momentum combinations) on the nodes, 3 rounds, each equal to its simulation. Flower
    records each run completed, and ``flwr run --stream`` shows fedweave's lines: a line per round trained and
    evaluated, and the completion line. At the same time, 2 rounds each: DFedAvg, each peer training on its
    SuperNode (its round's local steps, and before each evaluation the fine-tuning of a copy) from the model the
    ServerApp that relays the gossip mixed for it, one model each way per job while the ledger counts the
    peer-to-peer messages; and FedAvg with privacy.level sample, DP-SGD on the nodes, accounted from the steps
    they report, epsilon equal to the simulation's."""
    runs = all_deployed_and_simulated(federation, {**CENTRALIZED, **GOSSIP, **DP_SGD}, tmp_path)
    for name, (dep, sim) in runs.items():
        summary, rows = dep.results()
        assert summary["status"] == "completed", name
        assert_same_metrics(rows, sim)
        fl = summary["flower"]
        if name in GOSSIP:
            assert len(rows) == 2 and fl["jobs"] == 2 * 2 * CLIENTS  # each peer's training and its fine-tuning
            assert fl["payload_sent"] == fl["payload_received"] == fl["jobs"] * 650 * 4  # the logistic model
            assert summary["communication"]["bytes_lateral"] > 0 == summary["communication"]["bytes_up"]
            continue
        assert_payload_is_the_ledger(summary)
        if name in DP_SGD:
            assert len(rows) == 2 and rows[-1]["epsilon"] == sim[-1]["epsilon"] > 0
            continue
        assert len(rows) == 3, name
        assert summary["execution"]["backend"] == "flower"
        assert fl["jobs"] == 3 * CLIENTS
        assert fl["messages"] >= 2 * (3 * CLIENTS) + 2 * CLIENTS  # jobs, replies and the queries
        assert fl["dropped"] == {}
        for r in (1, 2, 3):
            assert f"fedweave round {r}/3 trained: train_loss" in dep.output, dep.output
            assert f"fedweave round {r}/3 evaluated: test_accuracy" in dep.output, dep.output
        assert f"fedweave run in {dep.run_dir}: completed" in dep.output
        assert dep.fed.run_status(dep.output)[0] == "finished:completed"


COMPRESSED = {  # compression.upload across real processes
    "fedavg-topk-ef": {
        **config({"name": "fedavg"}, rounds=3),
        "compression": {"upload": {"name": "topk", "ratio": 0.1}},
    },
    "scaffold-qsgd": {
        **config({"name": "scaffold"}, rounds=3),
        "compression": {"upload": {"name": "qsgd", "levels": 4}},
    },
}


def test_deployed_compressed_uploads_equal_simulation(federation, tmp_path):
    """Compressed uploads across real processes (both runs at once): each SuperNode encodes its client's upload
    (top-k with its error-feedback residual kept in the node's state directory; QSGD's draws from the client's
    stream, SCAFFOLD's two messages each), the replies carry only the encoded bytes, the ServerApp decodes them.
    Every metric equals the simulation and the reply arrays are the ledger's encoded bytes. At each run's end
    its nodes removed what it wrote (top-k's residuals, SCAFFOLD's c_i, the trial nodes' samples)."""
    earlier_runs = {c: set((federation.root / f"state-{c}").glob("run-*")) for c in range(CLIENTS)}
    for name, (dep, sim) in all_deployed_and_simulated(federation, COMPRESSED, tmp_path).items():
        summary, rows = dep.results()
        assert len(rows) == 3, name
        assert_same_metrics(rows, sim)
        assert_payload_is_the_ledger(summary)  # the ledger bills the encoded size: the replies' arrays are that
        assert 3 * summary["flower"]["payload_received"] < summary["flower"]["payload_sent"], name
        assert dep.fed.run_status(dep.output)[0] == "finished:completed"
    for c in range(CLIENTS):  # no directory of these runs is left on any node
        assert set((federation.root / f"state-{c}").glob("run-*")) <= earlier_runs[c], c


@pytest.mark.parametrize("names", [("fsl_oc",), ("cse_fsl", "fsl_an", "fsl_mc")], ids=["fsl_oc", "the_others"])
def test_deployed_split_learning_equals_simulation(federation, tmp_path, names):
    """The split family (FSL_OC alone, its clients' messages one after another; the three others at once): each
    client's side runs on its node, the main and fed servers in the ServerApp. CSE-FSL and FSL_AN: one message
    per client and round (x_c, a_c down; x_c, a_c, the smashed batches and their labels up). FSL_MC and FSL_OC:
    one message per batch (the first carries x_c down, the next ones the server's gradient of the last smashed
    batch; the replies the next smashed batch, finally x_c), the client kept in its node's state directory
    between them; FSL_OC serves its clients one after another. Every metric equals the simulation, and the
    messages carry the ledger's bytes both ways."""
    cfgs = {name: SPLIT_RUNS[name] for name in names}
    for name, (dep, sim) in all_deployed_and_simulated(federation, cfgs, tmp_path).items():
        algorithm, steps, per_round = SPLIT[name]
        summary, rows = dep.results()
        assert len(rows) == 2, name
        assert_same_metrics(rows, sim)
        uploads = steps // algorithm.get("h", 1)  # smashed batches per client and round
        assert rows[-1]["server_steps"] == per_round * uploads, name
        fl, ledger = summary["flower"], summary["communication"]
        assert summary["execution"]["backend"] == "flower", name  # (before: the config's, though no trainer ran)
        assert ledger["by_transfer"]["client->server:smashed"]["count"] == 2 * per_round * uploads, name
        assert fl["payload_received"] == ledger["bytes_up"], name
        assert fl["payload_sent"] == ledger["bytes_down"], name
        if name in ("fsl_mc", "fsl_oc"):  # a gradient down after every batch: a message per batch
            assert ledger["by_transfer"]["server->client:gradient"]["count"] == 2 * per_round * steps, name
            assert fl["jobs"] == 2 * per_round * (steps + 1), name
        else:
            assert fl["jobs"] == 2 * per_round, name


def run_killing_node_2(federation, app: Path, run_dir: Path) -> tuple[dict, list[dict], str]:
    """Run ``app`` (4 rounds, ``on-error: drop``), SIGKILL the node of client 2 once round 1 is done and restart it
    with its state directory (Flower's default isolation: a fresh ClientApp process per message); summary.json,
    the metrics rows and ``flwr run``'s output. Client 2 is a dropout of round 2 only: it took part before, and
    from round 3 its restarted node (a new id) takes part again."""
    flwr = federation.flwr_run(app, wait=False)
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "metrics.jsonl").is_file() and time.monotonic() < deadline and flwr.poll() is None:
            time.sleep(0.2)
        federation.kill(2)
        federation.supernode(2, isolation="subprocess")  # the same partition and state-dir: a new node id
        output, _ = flwr.communicate(timeout=400)
    finally:
        if flwr.poll() is None:
            flwr.kill()
    summary, rows = results(run_dir, output, federation)
    dropped = summary["flower"]["dropped"]
    assert dropped.get("2") == [2], (dropped, output)
    assert "1" not in dropped and "4" not in dropped, dropped
    assert rows[1]["reported_clients"] == CLIENTS - 1 and rows[-1]["reported_clients"] == CLIENTS
    return summary, rows, output


def test_a_killed_node_is_a_dropout_and_rejoins_with_its_state(federation, tmp_path):
    """SCAFFOLD under ``on-error: drop``. SIGKILL the node of client 2 once round 1 is done; restart it with its
    state directory (and Flower's default isolation: a fresh ClientApp process per message). Round 2 goes on
    without client 2 (SCAFFOLD's dropout semantics: it delivers nothing, c moves by the others' Delta c_i
    only), and from the next round the restarted node trains again from its persisted c_2: the whole run
    equals the simulation in which client 2 drops out of exactly the rounds it missed. The messages carry the
    paper's protocol (x and c down, Delta y_i and Delta c_i up; the c_i stay on the nodes), byte for byte. At
    the run's end every node removed the run's files, the restarted node also those its killed self wrote."""
    cfg = config({"name": "scaffold"}, rounds=4)
    app, run_dir = write(cfg, tmp_path, on_error="drop")
    earlier_runs = {c: set((federation.root / f"state-{c}").glob("run-*")) for c in range(CLIENTS)}  # others' runs
    summary, rows, _ = run_killing_node_2(federation, app, run_dir)
    dropped = summary["flower"]["dropped"]
    sim = simulated(cfg, tmp_path, dropped)
    # a lost job sent to the killed node is a download in both runs; one never sent (the node was not
    # connected when the round began) is in the simulation's ledger only
    download = summary["communication"]["by_transfer"]["server->client:model+control"]
    unsent = sum(len(cs) for cs in summary["flower"]["unsent"].values())
    assert sim[-1]["bytes_down"] - rows[-1]["bytes_down"] == unsent * download["bytes"] // download["count"]
    assert_same_metrics(rows, sim, but=("bytes_down", "bytes_total") if unsent else ())
    assert summary["status"] == "completed"
    assert_payload_is_the_ledger(summary)  # a lost job's download is in both counts if sent, its reply in neither
    for c in range(CLIENTS):  # the c_i were on the nodes until the run's end (the run equals the simulation)
        assert set((federation.root / f"state-{c}").glob("run-*")) <= earlier_runs[c], c


def test_an_error_reply_stops_the_run_under_policy_stop_and_flower_records_it_failed(federation, tmp_path):
    """The node of client 2 cannot write its state (its state-dir is a file): it answers SCAFFOLD's job
    with error 105; under ``on-error: stop`` the run ends with ``status: stopped`` and its results so far, and
    the ServerApp raises so that Flower records the run as failed, the reason as its status details."""
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    federation.kill(2)
    federation.supernode(2, state_dir=blocked, isolation="subprocess")
    try:
        summary, rows, output = deployed(federation, config({"name": "scaffold"}, rounds=1), tmp_path, on_error="stop")
    finally:
        federation.kill(2)
        federation.supernode(2)
    assert summary["status"] == "stopped" and rows == []
    assert "round 1: client 2: error 105: cannot read or write the client state" in summary["error"]
    assert summary["flower"]["jobs"] == CLIENTS
    lines = [line for line in output.splitlines() if "fedweave run stopped" in line]
    assert len(lines) == 1 and "client 2: error 105" in lines[0], output  # the exception's line, once
    assert "ServerApp raised an exception" in output and "RunFailed: fedweave run stopped" in lines[0]
    status, details = federation.run_status(output)
    assert status == "finished:failed", (status, details)
    assert details.startswith("ServerApp failed with exception: fedweave run stopped: round 1: client 2: error 105")


def test_deployed_hierarchical_runs_equal_simulation(federation, tmp_path):
    """ZO-HFL and hier_fedavg on one hierarchical split: the nodes hold the clients' parts (client 2's node
    its own file of its part, as ``fedweave flower-app --node-data`` writes it for this family), the
    server's share stays with the ServerApp. ZO-HFL sends each client two jobs a round (the + and - solves,
    the decaying step size as a named schedule and the ball projection as data); hier_fedavg trains the
    server's own share in the ServerApp (``server_data: client``). Both equal the simulation, and the
    messages carry the ledger's bytes (x and v_i down as the two input points, y+ and y- up)."""
    hierarchy = {"tau": 1.0, "participation": 1.0, "server_share": 0.3}
    runs = [{"name": "zo_hfl", "constraint": "ball", "radius": 2.0, **hierarchy},
            {"name": "hier_fedavg", "server_data": "client", **hierarchy}]  # fmt: skip
    export_clients(load(config(runs[0], per_round=None)), federation.root / "hierarchy", [DATA_NODE])
    federation.kill(DATA_NODE)
    federation.supernode(DATA_NODE, data="hierarchy")
    try:
        cfgs = {a["name"]: config(a, steps=None, per_round=None) for a in runs}  # H_{i,r} steps (tau)
        for name, (dep, sim) in all_deployed_and_simulated(federation, cfgs, tmp_path).items():  # both at once
            summary, rows = dep.results()
            assert len(rows) == 2 and summary["status"] == "completed", name
            assert_same_metrics(rows, sim)
            assert_payload_is_the_ledger(summary)
            per_client = 2 if name == "zo_hfl" else 1  # ZO-HFL: the + and - solves
            assert summary["flower"]["jobs"] == 2 * CLIENTS * per_client  # 2 rounds
    finally:
        federation.kill(DATA_NODE)
        federation.supernode(DATA_NODE)


def _secure_run(federation, tmp_path, name: str, rounds: int):
    """A run of ``name`` (equal weights) under SecAgg+ deployed and simulated: its config, both runs, and the
    algorithm state of each one's last checkpoint."""
    from fedweave.checkpoints import read_checkpoint

    cfg = config({"name": name, "weighting": "uniform"}, rounds=rounds)
    cfg["secure_aggregation"] = {"num_shares": 1.0, "max_weight": 1.0, "clipping_range": 1.0}
    cfg["output"] = {**cfg["output"], "checkpoint_every": 1}
    run, sim = deployed_and_simulated(federation, cfg, tmp_path)
    states = [read_checkpoint(d / "checkpoint.pt")["algorithm"] for d in (run.run_dir, tmp_path / "sim")]
    return cfg, run, sim, states


def test_deployed_secure_aggregation_is_the_simulation_within_the_quantization_bound(federation, tmp_path):
    """Flower's SecAgg+ across the real processes (fedweave.deploy.secure): the SuperLink carries the four
    stages' messages, each node's ClientApp runs Flower's secaggplus_mod. The round's model equals the
    simulation's within SecAgg+'s quantization bound (and not bit for bit: it quantizes); no reply carries an
    array of fedweave's (the updates travel masked, as integers in Z_R inside the protocol's records); the
    ledger bills the protocol, not a dense upload."""
    import torch

    from fedweave.deploy.secure import error_bound

    cfg, run, sim, (deployed, simulated) = _secure_run(federation, tmp_path, "fedavg", rounds=1)
    summary, rows = run.results()
    assert summary["status"] == "completed" and len(rows) == 1
    deployed_x, sim_x = deployed["x"].double(), simulated["x"].double()
    bound = error_bound(load(cfg).secure_aggregation, np.ones(CLIENTS))  # 2c / R for equal weights
    assert 0 < (deployed_x - sim_x).abs().max().item() <= bound + 1e-6  # + float32 rounding of mean and model
    assert not torch.equal(deployed_x, sim_x)
    fl, ledger = summary["flower"], summary["communication"]["by_transfer"]
    assert fl["payload_received"] == 0  # no tensors of fedweave's in any reply: the server holds no update
    assert "client->server:model" not in ledger and ledger["client->server:secagg_masked_input"]["count"] == CLIENTS
    assert rows[0]["test_accuracy"] == pytest.approx(sim[0]["test_accuracy"], abs=0.01)


def test_deployed_scaffold_under_secure_aggregation_keeps_its_state_on_the_nodes(federation, tmp_path):
    """SCAFFOLD under SecAgg+ across the real processes: each node keeps its c_i in its state directory between
    the rounds and masks Delta y_i and Delta c_i as one vector; two rounds, so that the second starts from the
    state each node wrote in the first. The server's x and c equal the simulation's within the quantization
    (two rounds of it), and no reply carries an array of fedweave's."""
    _, run, _, (deployed, simulated) = _secure_run(federation, tmp_path, "scaffold", rounds=2)
    summary, rows = run.results()
    assert summary["status"] == "completed" and len(rows) == 2
    for name in ("x", "c"):
        diff = (deployed[name].double() - simulated[name].double()).abs().max().item()
        assert 0 < diff <= 1e-4, name  # quantized, and within two rounds of SecAgg+'s bound
    assert summary["flower"]["payload_received"] == 0
    assert summary["communication"]["by_transfer"]["client->server:secagg_masked_input"]["count"] == 2 * CLIENTS


def test_a_node_killed_under_secure_aggregation_is_a_dropout_of_the_sum_secagg_recovered(federation, tmp_path):
    """FedAvg under SecAgg+ and ``on-error: drop``: SIGKILL the node of client 2 once round 1 is done and restart
    it. Round 2's protocol goes on without it (its stages sent to the killed node get no answer; SecAgg+ unmasks
    the others' sum), client 2 is a dropout of that round, and the round takes the recovered mean rather than run
    the protocol a second time; from the next round the restarted node (a new id) takes part again. The server's
    model equals the simulation in which client 2 drops out of exactly the rounds it missed, within SecAgg+'s
    quantization."""
    from fedweave.checkpoints import read_checkpoint
    from fedweave.deploy.secure import error_bound

    cfg = config({"name": "fedavg", "weighting": "uniform"}, rounds=4)
    cfg["secure_aggregation"] = {"num_shares": 1.0, "reconstruction_threshold": 0.5, "max_weight": 1.0,
                                 "clipping_range": 1.0}  # fmt: skip
    cfg["output"] = {**cfg["output"], "checkpoint_every": 1}
    app, run_dir = write(cfg, tmp_path, on_error="drop")  # a stage stops waiting once the node joined again
    summary, rows, _ = run_killing_node_2(federation, app, run_dir)
    assert summary["status"] == "completed" and len(rows) == 4
    dropped = summary["flower"]["dropped"]
    masked = summary["communication"]["by_transfer"]["client->server:secagg_masked_input"]["count"]
    assert masked == 4 * CLIENTS - sum(map(len, dropped.values()))  # one protocol a round: nothing sent twice
    simulated(cfg, tmp_path, dropped)
    deployed, sim = (
        read_checkpoint(d / "checkpoint.pt")["algorithm"]["x"].double() for d in (run_dir, tmp_path / "sim")
    )
    bound = 4 * error_bound(load(cfg).secure_aggregation, np.ones(CLIENTS)) + 1e-6  # 4 rounds, float32 rounding
    assert 0 < (deployed - sim).abs().max().item() <= bound
