"""Deployment overhead: seconds per round of a run deployed on real Flower processes over its simulation.

Starts a ``flower-superlink`` and one ``flower-supernode`` per client on 127.0.0.1 (``--isolation process`` with
a warm ``fedweave flower-executor`` each, as docs/deployment.md recommends; ``--isolation subprocess`` for
Flower's default), runs a FedAvg app written by ``fedweave flower-app``'s writer with ``flwr run``, runs the same
config in simulation (``loop`` backend, the backend the nodes train with), and prints both runs' seconds per
round (median of rounds 2..R: round 1 pays the nodes' first job, which derives their data) and the difference.

Every line the Flower processes print is stamped with the time it arrived, and so is every metrics row the
ServerApp writes (at the end of each round, after its evaluation), so each deployed round is split into:
- the previous round's row -> the nodes log ``Receiving``; and, per node, its previous reply sent -> its
  next ``Receiving``: a SuperNode looks for a message right after sending a reply, finds none (the round has
  not ended), and sleeps 3 s (a ``time.sleep(3)`` in Flower 1.42's ``start_client_internal``, with no option or
  setting to change it), so each node takes its next job 3 s after its reply (6 s if the job was not there
  yet), whatever the ServerApp does in between;
- ``Receiving`` -> ``Sending`` at each node: the message's objects pulled (to ``Received successfully``), the
  executor taking the task (it asks every ``executor.POLL`` s) and the forked ClientApp process (Flower's
  ``run_clientapp`` around fedweave's ``train``; it ends with a line of the executor's), then the node's own
  look for the reply (every 0.5 s, Flower's);
- the round's last ``Sending`` -> its row: the reply pushed, the ServerApp's look for replies (every
  ``server_app.POLL`` s), aggregation, evaluation.
The federation's CPU seconds, idle and during the run, show what the looks for work cost.

Usage (from the checkout, its source first on the path):
  PYTHONPATH=src python benchmarks/deploy_overhead.py --rounds 8
  PYTHONPATH=src python benchmarks/deploy_overhead.py --rounds 4 --isolation subprocess   # a process a message
Needs the ``flower`` extra (pip install 'fedweave[flower]').
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ``benchmarks`` importable when run as a script
from benchmarks.federation import BIN  # noqa: E402
from benchmarks.federation import Federation as LocalFederation  # noqa: E402
from fedweave.memory import process_tree  # noqa: E402

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
IDLE = 10.0  # seconds of an idle federation whose CPU is measured before the run (the looks for work)
CLIENTS = 3


def config(rounds: int, model: str) -> dict:
    """FedAvg over the three nodes' clients, every client every round, on the bundled digits set."""
    return {
        "name": "deploy-overhead",
        "seed": 0,
        "rounds": rounds,
        "backend": "loop",
        "threads": 1,  # the simulation and the ServerApp: two spinning threads per process on a shared 2-core machine
        "dataset": {"name": "digits", "as_image": True},
        "partition": {"name": "dirichlet", "num_clients": CLIENTS, "alpha": 0.5},
        "model": {"name": model},
        "algorithm": {"name": "fedavg", "clients_per_round": CLIENTS},
        "local": {"epochs": 1, "batch_size": 16, "lr": 0.05},
        "output": {"progress": False, "plots": False},
    }


class Federation(LocalFederation):
    """The federation of benchmarks/federation.py, each process's output lines time-stamped as they arrive."""

    def __init__(self, root: Path, isolation: str) -> None:
        super().__init__(root, task_poll=0.1)
        self.isolation = isolation
        self.names: list[str] = []  # of ``procs``, in order
        self.lines: list[tuple[float, str, str]] = []
        self.lock = threading.Lock()

    def start(self, name: str, *args: str) -> subprocess.Popen:
        """``popen`` with each output line kept in ``lines`` with its arrival time and ``name``."""
        p = self.popen(args, subprocess.PIPE)
        self.names.append(name)
        threading.Thread(target=self._read, args=(name, p), daemon=True).start()
        return p

    def _read(self, name: str, p: subprocess.Popen) -> None:
        for raw in p.stdout:
            with self.lock:
                self.lines.append((time.time(), name, raw.decode(errors="replace").rstrip()))

    def logs(self) -> str:
        """The last 100 time-stamped lines (the processes write no log files here)."""
        with self.lock:
            return "\n".join(f"{t:.3f} {n}: {line}" for t, n, line in self.lines[-100:])

    def up(self) -> None:
        """The SuperLink, then a node per client (``node-<client>``: ``breakdown`` and ``cpu`` read the names)."""
        self.superlink()
        self.wait_listening(timeout=120)
        for client in range(CLIENTS):
            node_config = f"partition-id={client} state-dir='{self.root / str(client)}'"
            self.start_node(client, node_config, self.isolation, name="node")

    def cpu(self) -> dict[str, float]:
        """CPU seconds (user + system, with finished children) so far of each kind of process tree: the
        SuperLink (and the ServerApp it starts), the nodes, the executors (and their forked ClientApps)."""
        tick = os.sysconf("SC_CLK_TCK")
        out = {"superlink": 0.0, "node": 0.0, "executor": 0.0}
        for name, p in zip(self.names, self.procs):
            for pid in process_tree(p.pid):
                try:
                    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                out[name.split("-")[0]] += sum(int(v) for v in f[11:15]) / tick
        return out


def per_round(rows: list[dict]) -> list[float]:
    """Seconds of each round from the cumulative ``wall_seconds`` of the metrics rows (round 0: the start)."""
    walls = [r["wall_seconds"] for r in rows]
    if rows[0]["round"] != 0:
        walls = [0.0, *walls]
    return [b - a for a, b in zip(walls, walls[1:])]


def watch_rows(path: Path, seen: list[float], stop: threading.Event) -> None:
    """Append to ``seen`` the time at which each new metrics row of the deployed run appeared (the ServerApp
    rewrites ``metrics.jsonl`` at the end of every round, after the evaluation)."""
    while not stop.is_set():
        try:
            rows = path.read_text().count("\n")
        except OSError:
            rows = 0
        seen.extend([time.time()] * (rows - len(seen)))
        time.sleep(0.01)


def _mean(xs: list[float]) -> float:
    return statistics.mean(xs) if xs else float("nan")


def _min(xs: list[float]) -> float:
    return min(xs) if xs else float("nan")


def breakdown(lines: list[tuple[float, str, str]], row_times: list[float]) -> list[dict[str, float]]:
    """Rounds 2..R split in four (the module docstring): from the previous round's row to the nodes' Receiving,
    Receiving to Sending at each node, and from the round's last Sending to its row."""
    recv: dict[str, list[float]] = {}
    sent: dict[str, list[float]] = {}
    done: dict[str, list[float]] = {}  # the reply's "Sent successfully"
    got: dict[str, list[float]] = {}  # the job's "Received successfully" (its objects pulled)
    ended: dict[str, list[float]] = {}  # the lines of a node's executor: its forked ClientApps end with one
    for t, name, line in lines:
        if name.startswith("executor-"):
            ended.setdefault(name.replace("executor", "node"), []).append(t)
        if name.startswith("node-") and "Receiving: train message" in line:
            recv.setdefault(name, []).append(t)
        elif (
            name.startswith("node-")
            and "Received successfully" in line
            and len(recv.get(name, [])) > len(got.get(name, []))
        ):
            got.setdefault(name, []).append(t)
        elif name.startswith("node-") and "Sending: train message" in line:
            sent.setdefault(name, []).append(t)
        elif (
            name.startswith("node-")
            and "Sent successfully" in line
            and len(sent.get(name, [])) > len(done.get(name, []))
        ):
            done.setdefault(name, []).append(t)
    out = []
    for r in range(1, len(row_times)):  # round r + 1 runs from row_times[r - 1] to row_times[r]
        if any(len(recv.get(n, [])) <= r or len(sent.get(n, [])) <= r for n in recv) or not recv:
            break
        start, end = row_times[r - 1], row_times[r]
        pick = [recv[n][r] - start for n in recv]
        node = [sent[n][r] - recv[n][r] for n in recv]
        last = max(sent[n][r] for n in sent)
        idle = [recv[n][r] - done[n][r - 1] for n in recv if len(done.get(n, [])) >= r]
        pulled = [got[n][r] - recv[n][r] for n in recv if len(got.get(n, [])) > r]
        child = {  # the executor's line that ends the node's ClientApp process of this job
            n: min((t for t in ended.get(n, []) if got[n][r] < t <= sent[n][r]), default=None)
            for n in recv
            if len(got.get(n, [])) > r
        }
        app = [t - got[n][r] for n, t in child.items() if t is not None]  # the executor's pick-up and the ClientApp
        look = [sent[n][r] - t for n, t in child.items() if t is not None]  # the node's look for the reply
        out.append({"round": end - start, "pickup_max": max(pick), "pickup_min": min(pick), "node_max": max(node),
                    "node_mean": statistics.mean(node), "back": end - last, "idle_min": _min(idle),
                    "idle_max": -_min([-x for x in idle]), "pulled": _mean(pulled), "app": _mean(app),
                    "look": _mean(look)})  # fmt: skip
    return out


def stop_on_sigterm() -> None:
    """Turn SIGTERM (``timeout``, ``kill``) into ``SystemExit(143)``, so that the ``finally`` around the federation
    stops its processes: under Python's default action the script ended at once and left the SuperLink, the
    SuperNodes, their executors and the ServerApp running, orphaned."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--model", default="logistic", choices=["logistic", "mlp"])
    ap.add_argument("--isolation", default="process", choices=["process", "subprocess"])
    ap.add_argument("--keep", type=Path, help="keep the federation's files and time-stamped logs in this new folder")
    args = ap.parse_args()
    if args.rounds < 2:
        ap.exit(2, "deploy_overhead.py: error: --rounds must be at least 2 (round 1 pays the nodes' first job)\n")
    if args.keep is not None and args.keep.exists():
        ap.exit(2, f"deploy_overhead.py: error: --keep {args.keep} exists; give a new folder\n")
    if args.keep is not None and (file := next((p for p in args.keep.parents if p.exists() and not p.is_dir()), None)):
        ap.exit(2, f"deploy_overhead.py: error: --keep {args.keep}: {file} is a file, not a folder\n")
    # checked first: without the extra the SuperLink died at once and the run ended a minute later in a traceback
    missing = [m for m in ("flwr", "tomli_w") if importlib.util.find_spec(m) is None]
    if missing or not (BIN / "flower-superlink").exists():
        what = ", ".join(missing) if missing else f"flower-superlink in {BIN}"
        ap.exit(2, f"deploy_overhead.py: error: this environment lacks {what}: pip install 'fedweave[flower]'\n")

    from fedweave.config import load
    from fedweave.deploy.project import write_app
    from fedweave.runner import run

    root = Path(tempfile.mkdtemp(prefix="deploy-overhead-")) if args.keep is None else args.keep
    root.mkdir(parents=True, exist_ok=True)
    cfg = load(config(args.rounds, args.model))
    stop_on_sigterm()
    fed = Federation(root, args.isolation)
    row_times: list[float] = []
    stop = threading.Event()
    metrics = root / "deployed" / "metrics.jsonl"
    threading.Thread(target=watch_rows, args=(metrics, row_times, stop), daemon=True).start()
    try:
        t0 = time.time()
        fed.up()
        write_app(cfg, root / "app", run_dir=str(root / "deployed"), node_wait=120.0, reply_timeout=300.0)
        time.sleep(5)  # the nodes and executors have started and are idle
        idle0 = fed.cpu()
        time.sleep(IDLE)
        idle1 = fed.cpu()
        done = fed.flwr_run(root / "app", timeout=120 + 120 * args.rounds)
        output = done.stdout + done.stderr
        total = time.time() - t0
        busy = fed.cpu()
    finally:
        stop.set()
        fed.stop()
        (root / "lines.txt").write_text("".join(f"{t:.3f} {n}: {line}\n" for t, n, line in fed.lines))
    if not metrics.is_file():
        sys.exit(f"the deployed run wrote no metrics (logs in {root}):\n{output[-3000:]}")
    deployed = [json.loads(line) for line in metrics.read_text().splitlines()]
    simulated = run(cfg, run_dir=root / "sim").metrics
    d, s = per_round(deployed), per_round(simulated)
    dm, sm = statistics.median(d[1:]), statistics.median(s[1:])
    load_avg = os.getloadavg()
    print(f"## FedAvg, {CLIENTS} nodes on 127.0.0.1, {args.model} on digits, {args.rounds} rounds, "
          f"--isolation {args.isolation}; load average {load_avg[0]:.1f} (1 min) after the runs")  # fmt: skip
    print()
    print("| | round 1 (s) | rounds 2..R, each (s) | median of rounds 2..R (s) |")
    print("|---|---|---|---|")
    for name, v, m in (("simulated", s, sm), ("deployed", d, dm)):
        print(f"| {name} | {v[0]:.3f} | {', '.join(f'{x:.3f}' for x in v[1:])} | {m:.3f} |")
    print()
    print(f"Deployed - simulated per round: {dm - sm:.3f} s (median of rounds 2..R); whole deployed run with "
          f"start-up {total:.1f} s. Same accuracy at the end: {deployed[-1]['test_accuracy']:.4f} deployed, "
          f"{simulated[-1]['test_accuracy']:.4f} simulated.")  # fmt: skip
    parts = breakdown(fed.lines, row_times)
    if parts:
        med = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
        print()
        print(f"Where a deployed round's time goes (median over rounds 2..R, measured from the time-stamped logs; "
              f"the round from row to row: {med['round']:.3f} s):")  # fmt: skip
        print(
            f"- previous round's row written -> the nodes log Receiving (the ServerApp's next push, then the "
            f"nodes' idle look every 3 s): last node {med['pickup_max']:.3f} s, first {med['pickup_min']:.3f} s"
        )
        print(
            f"- at a node, its previous reply sent (Sent successfully) -> its next Receiving: {med['idle_min']:.3f} "
            f"to {med['idle_max']:.3f} s (the node found nothing right after sending, then slept 3 s)"
        )
        print(f"- at a node, Receiving -> Sending (the message's objects pulled, the executor's task, the forked "
              f"ClientApp, the node's look for the reply every 0.5 s): slowest {med['node_max']:.3f} s, mean "
              f"{med['node_mean']:.3f} s, of which the objects pulled (Receiving -> Received successfully) "
              f"{med['pulled']:.3f} s, the executor's pick-up and the ClientApp process (to its last line) "
              f"{med['app']:.3f} s, the node's look for the reply {med['look']:.3f} s")  # fmt: skip
        print(f"- last node Sending -> the round's row (the reply pushed, the ServerApp's look for replies, "
              f"aggregation, evaluation, the row written): {med['back']:.3f} s")  # fmt: skip
    idle = {k: (idle1[k] - idle0[k]) / IDLE for k in idle0}
    run_cpu = {k: busy[k] - idle1[k] for k in busy}
    print()
    print(
        f"CPU of the federation, idle (per second, {IDLE:.0f} s before the run): SuperLink {idle['superlink']:.3f}, "
        f"nodes {idle['node']:.3f}, executors {idle['executor']:.3f}; during the run (s): SuperLink and ServerApp "
        f"{run_cpu['superlink']:.1f}, nodes {run_cpu['node']:.1f}, executors and ClientApps {run_cpu['executor']:.1f}."
    )
    print(f"\nTime-stamped logs: {root / 'lines.txt'}")


if __name__ == "__main__":
    main()
