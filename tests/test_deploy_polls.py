"""How often the deployed run's own processes look for work (benchmarks/deploy_overhead.py, docs/deployment.md):
the ServerApp looks for a round's replies, and the warm executor asks its SuperNode for a task, every 0.05 s at
most, so that neither adds more than that to a round on top of Flower's own looks."""

from __future__ import annotations

import pytest

pytest.importorskip("flwr")

from flwr.app import Message  # noqa: E402

from fedweave.deploy import executor, server_app  # noqa: E402
from fedweave.deploy.wire import to_records  # noqa: E402

MOST = 0.05  # seconds


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


def test_the_server_app_looks_for_replies_every_0_05_s_at_most(monkeypatch):
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


def test_the_executor_asks_for_a_task_every_0_05_s_at_most(monkeypatch):
    waits: list[float] = []

    class Client:
        def AcquireTask(self, request):  # noqa: N802 (Flower's name)
            return type("NoTask", (), {"HasField": lambda self, name: False, "token": ""})()

        def close(self) -> None:
            pass

    class HttpClient:
        @staticmethod
        def from_server_address(**kwargs):
            return Client()

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) == 3:
            raise KeyboardInterrupt  # how the executor is stopped

    task_type = type("TaskType", (), {"CLIENT_APP": "clientapp"})
    fakes = (lambda **kw: kw, task_type, lambda **kw: None, lambda: None, HttpClient, lambda c, i: None, None)
    monkeypatch.setattr(executor, "_flower", lambda: fakes)
    monkeypatch.setattr(executor.time, "sleep", sleep)
    with pytest.raises(KeyboardInterrupt):
        executor.serve("127.0.0.1:1", insecure=True)
    assert len(waits) == 3 and max(waits) <= MOST
