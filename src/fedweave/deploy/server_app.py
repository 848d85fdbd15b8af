"""The Flower ``ServerApp``: fedweave's runner drives the algorithm; every client job is a Flower
``Message`` to the SuperNode that holds the client's data (docs/deployment.md).

Run config keys of the app (``[tool.flwr.app.config]``, written by ``fedweave flower-app``):
``fedweave-config`` (the run config as JSON), ``run-dir`` (the results directory; empty: the config's),
``reply-timeout`` (seconds a round waits for its replies) and ``node-wait`` (seconds to wait for the
SuperNodes holding the run's clients to connect).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from flwr.app import Context, Message
from flwr.serverapp import Grid, ServerApp

from fedweave.algorithms.base import Algorithm
from fedweave.config import load as load_config
from fedweave.deploy.jobs import encode_job
from fedweave.deploy.wire import from_records, to_records, wire_bytes
from fedweave.execution.local import LR, LocalResult, LocalRule, LocalTrainer
from fedweave.results import atomic_write

log = logging.getLogger("fedweave")


class DeploymentError(RuntimeError):
    """A node answered a job with an error, or did not answer in time."""


class FlowerClients:
    """The run's clients as SuperNodes: which node holds which client, and the bytes sent to them."""

    def __init__(self, grid: Grid, *, reply_timeout: float, node_wait: float) -> None:
        self.grid, self.reply_timeout, self.node_wait = grid, reply_timeout, node_wait
        self.node_of: dict[int, int] = {}
        self.bytes_sent = self.bytes_received = self.messages = 0

    def discover(self, num_clients: int) -> None:
        """Ask every connected node which partition it holds, until all ``num_clients`` are held."""
        deadline = time.monotonic() + self.node_wait
        while True:
            asked = [n for n in self.grid.get_node_ids() if n not in self.node_of.values()]
            msgs = [Message(to_records({}, {}), dst_node_id=n, message_type="query") for n in asked]
            for reply in self.exchange(msgs, timeout=30.0):
                if reply.has_error():
                    raise DeploymentError(f"node {reply.metadata.src_node_id}: {reply.error.reason}")
                header, _ = from_records(reply.content)
                self.node_of[int(json.loads(header)["partition"])] = reply.metadata.src_node_id
            missing = sorted(set(range(num_clients)) - set(self.node_of))
            if not missing:
                return
            if time.monotonic() > deadline:
                raise DeploymentError(f"no SuperNode holds partitions {missing} after waiting {self.node_wait:.0f} s")
            time.sleep(0.5)

    def exchange(self, msgs: list[Message], timeout: float) -> list[Message]:
        if not msgs:
            return []
        self.bytes_sent += sum(wire_bytes(m) for m in msgs)
        replies = list(self.grid.send_and_receive(msgs, timeout=timeout))
        self.bytes_received += sum(wire_bytes(m) for m in replies)
        self.messages += len(msgs) + len(replies)
        return replies

    def attach(self, algo: Algorithm) -> None:
        """Make ``algo``'s local trainer send its jobs to the nodes (runner ``prepare`` hook)."""
        trainer = getattr(algo, "trainer", None)
        if trainer is None:
            raise DeploymentError(f"algorithm {algo.name!r} has no local trainer; it cannot be deployed on Flower yet")
        remote = FlowerTrainer.__new__(FlowerTrainer)
        remote.__dict__.update(trainer.__dict__)
        remote.backend, remote.clients = "flower", self
        algo.trainer = remote
        self.discover(len(trainer.parts))

    def summary(self) -> dict[str, int]:
        return {"messages": self.messages, "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received}


class FlowerTrainer(LocalTrainer):
    """A ``LocalTrainer`` whose jobs run on the SuperNodes; same arguments, same results."""

    clients: FlowerClients

    def run_jobs(
        self,
        starts: torch.Tensor,
        clients: list[int],
        round: int,
        rule: LocalRule,
        lr: LR,
        steps: int | None,
        key: tuple[int, ...],
    ) -> LocalResult:
        """The call's jobs as one Message each to the SuperNode holding that client's data."""
        msgs = []
        for k, c in enumerate(map(int, clients)):
            header, tensors = encode_job(
                start=starts[k], client=c, round=round, rule=rule, k=k, jobs=len(clients),
                lr=lr, steps=steps, key=key, local=self.local,
            )  # fmt: skip
            m = Message(to_records(header, tensors), dst_node_id=self.clients.node_of[c], message_type="train")
            msgs.append(m)
        replies = self.clients.exchange(msgs, timeout=self.clients.reply_timeout)
        order = {m.metadata.message_id: k for k, m in enumerate(msgs)}  # set when the grid pushed them
        out: list[tuple[torch.Tensor, int, float] | None] = [None] * len(msgs)
        for reply in replies:
            k = order.get(reply.metadata.reply_to_message_id)
            if k is None:
                continue
            if reply.has_error():
                raise DeploymentError(f"round {round + 1}: client {clients[k]}: {reply.error.reason}")
            header, tensors = from_records(reply.content)
            h = json.loads(header)
            out[k] = (tensors["params"].reshape(-1), int(h["steps"]), float(h["loss"]))
        lost = [int(clients[k]) for k, o in enumerate(out) if o is None]
        if lost:
            raise DeploymentError(f"round {round + 1}: no reply from clients {lost} in {self.clients.reply_timeout} s")
        done = [o for o in out if o is not None]
        return LocalResult(
            torch.stack([o[0] for o in done]),
            torch.tensor([o[1] for o in done], dtype=torch.long),
            torch.tensor([o[2] for o in done]),
        )


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    from fedweave import runner

    rc = context.run_config
    config = load_config(json.loads(str(rc["fedweave-config"])))
    clients = FlowerClients(grid, reply_timeout=float(rc["reply-timeout"]), node_wait=float(rc["node-wait"]))
    run_dir = str(rc.get("run-dir", "")) or None
    result = runner.run(config, run_dir=run_dir, prepare=clients.attach, progress=False)
    summary = dict(result.summary)
    # Flower's serialised messages next to the ledger's payload bytes; the difference is the framing,
    # record names, the job header and the discovery queries (docs/deployment.md)
    flower = clients.summary()
    flower["overhead_bytes"] = flower["bytes_sent"] + flower["bytes_received"] - summary["communication"]["bytes_total"]
    summary["flower"] = flower
    atomic_write(Path(result.run_dir) / "summary.json", json.dumps(summary, indent=2))
    log.info("fedweave run finished in %s", result.run_dir)
