"""fedweave on Flower's deployment engine: a real SuperLink and real SuperNode processes on 127.0.0.1.

Each test run starts ``flower-superlink --insecure`` and one ``flower-supernode`` per client (its own
process group, stopped by a finalizer even when the test fails), writes the app with ``fedweave flower-app``,
runs it with ``flwr run --stream`` and compares the run's metrics with the simulation's ``loop`` backend.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from fedweave.config import load  # noqa: E402
from fedweave.deploy.project import write_app  # noqa: E402
from fedweave.runner import run  # noqa: E402

BIN = Path(sys.executable).parent
CLIENTS = 3
pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config(algorithm: dict) -> dict:
    return {
        "name": f"flower-{algorithm['name']}",
        "seed": 5,
        "rounds": 3,
        "backend": "loop",
        "dataset": {"name": "digits"},
        "partition": {"name": "dirichlet", "num_clients": CLIENTS, "alpha": 0.5},
        "model": {"name": "logistic"},
        "algorithm": {**algorithm, "clients_per_round": CLIENTS},
        "local": {"steps": 4, "batch_size": 16, "lr": 0.05},
        "output": {"progress": False, "plots": False},
    }


class Federation:
    """A SuperLink and SuperNodes as process groups; ``stop`` kills every one of them."""

    def __init__(self, root: Path) -> None:
        self.root, self.procs = root, []
        self.port = free_port()
        # the SuperLink and SuperNodes start Flower's other executables (flower-superexec, ...) from PATH
        path = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"
        self.env = {**os.environ, "FLWR_HOME": str(root / "flwr-home"), "PATH": path}
        home = root / "flwr-home"
        home.mkdir()
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = "127.0.0.1:{self.port}"\ninsecure = true\n'
        )

    def start(self, name: str, *args: str) -> subprocess.Popen:
        with open(self.root / f"{name}.log", "ab") as log:  # the child keeps its own copy of the descriptor
            p = subprocess.Popen([str(BIN / args[0]), *args[1:]], env=self.env, cwd=self.root, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        self.procs.append(p)
        return p

    def superlink(self) -> None:
        self.start("superlink", "flower-superlink", "--insecure", "--host", "127.0.0.1", "--port", str(self.port),
                   "--database", str(self.root / "state.db"), "--disable-runtime-dependency-installation")  # fmt: skip

    def wait_listening(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.2)
        raise TimeoutError(f"the SuperLink did not listen on port {self.port}:\n{self.logs()}")

    def supernode(self, partition: int) -> subprocess.Popen:
        return self.start(
            f"supernode-{partition}", "flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{self.port}",
            "--port", str(free_port()),
            "--node-config", f"partition-id={partition} state-dir='{self.root / f'state-{partition}'}'",
        )  # fmt: skip

    def flwr_run(self, app: Path, timeout: float = 240) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "flwr"), "run", str(app), "local", "--stream"], env=self.env,
                              capture_output=True, text=True, timeout=timeout)  # fmt: skip

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def logs(self) -> str:
        return "\n".join(f"--- {f.name}\n{f.read_text(errors='replace')[-3000:]}" for f in self.root.glob("*.log"))


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    fed = Federation(tmp_path_factory.mktemp("federation"))
    try:
        fed.superlink()
        fed.wait_listening()
        for i in range(CLIENTS):
            fed.supernode(i)
        yield fed
    finally:
        fed.stop()


def deployed(fed: Federation, cfg: dict, tmp_path: Path) -> dict:
    run_dir = tmp_path / "deployed"
    write_app(load(cfg), tmp_path / "app", run_dir=str(run_dir), node_wait=60.0, reply_timeout=120.0)
    done = fed.flwr_run(tmp_path / "app")
    summary = run_dir / "summary.json"
    assert summary.is_file(), f"flwr run: {done.stdout}\n{done.stderr}\n{fed.logs()}"
    return json.loads(summary.read_text()), [
        json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]


@pytest.mark.parametrize(
    "algorithm",
    [{"name": "fedavg"}, {"name": "scaffold"}, {"name": "fedmim"}],
    ids=lambda a: a["name"],
)
def test_deployed_run_equals_simulation(federation, tmp_path, algorithm):
    cfg = config(algorithm)
    summary, rows = deployed(federation, cfg, tmp_path)
    sim = run(load(cfg), run_dir=tmp_path / "sim")
    assert len(rows) == len(sim.metrics) == 3
    for got, want in zip(rows, sim.metrics, strict=True):
        for k in ("train_loss", "test_accuracy", "test_loss", "bytes_up", "bytes_down"):
            assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-6), (k, got, want)
    assert summary["execution"]["backend"] == "flower"
    # both byte counts: the ledger's payload and Flower's serialised messages (payload + framing)
    fl, ledger = summary["flower"], summary["communication"]
    assert fl["bytes_sent"] > ledger["bytes_down"]
    assert fl["bytes_received"] > ledger["bytes_up"]
    # the arrays the messages carry are the ledger's protocol: SCAFFOLD's nodes keep c_i and send up
    # Delta y_i and Delta c_i, and receive x and c
    assert fl["payload_received"] == ledger["bytes_up"]
    assert fl["payload_sent"] == ledger["bytes_down"]
    assert fl["overhead_bytes"] == fl["bytes_sent"] + fl["bytes_received"] - ledger["bytes_total"]
    assert fl["messages"] >= 2 * 3 * CLIENTS
