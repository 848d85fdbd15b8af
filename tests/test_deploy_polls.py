"""How often the deployed run's ServerApp looks for a round's replies (benchmarks/deploy_overhead.py,
docs/deployment.md): every 0.1 s at most, so that it adds no more than that to a round on top of Flower's own
looks."""

from __future__ import annotations

import pytest

pytest.importorskip("flwr")

from flwr.app import Message  # noqa: E402

from fedweave.deploy import server_app  # noqa: E402
from fedweave.deploy.wire import to_records  # noqa: E402

MOST = 0.1  # seconds


class SlowGrid:
    """One node (id 1) holding client 0, whose reply shows only at the third look."""

    def __init__(self) -> None:
        self.looks, self.replies = 0, {}

    def get_node_ids(self) -> list[int]:
        return [1]

    def push_messages(self, msgs: list[Message]) -> list[str]:
        for m in msgs:
            m.metadata.__dict__["_message_id"] = m.object_id  # as the SuperLink does
            self.replies[m.metadata.message_id] = Message(to_records({"steps": 1}, {}), reply_to=m)
        return [m.metadata.message_id for m in msgs]

    def pull_messages(self, ids: list[str]) -> list[Message]:
        self.looks += 1
        return [self.replies[i] for i in ids] if self.looks >= 3 else []


def test_the_server_app_looks_for_replies_every_0_1_s_at_most(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    for attr, value in (("_run_id", 7), ("_node_id", 0), ("_task_id", 1)):  # the messages' run, as a ServerApp's
        monkeypatch.setattr(TaskIdentity, attr, value)
    waits: list[float] = []
    monkeypatch.setattr(server_app.time, "sleep", waits.append)
    clients = server_app.FlowerClients(SlowGrid(), reply_timeout=60.0, node_wait=60.0)
    clients.queried, clients.node_of = {1}, {0: 1}  # discovered
    (reply,) = clients.run_jobs(0, [(0, {"job": 0}, {})])
    assert not reply.has_error()
    assert len(waits) == 2 and max(waits) <= MOST
