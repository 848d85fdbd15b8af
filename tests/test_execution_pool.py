"""The pool backend computes what the loop backend computes; evaluation gives the same sums on the pool's
workers as in the driver; the plain-SGD fast path of the loop backend gives the general path's bits."""

from __future__ import annotations

import gc
import os
import pickle
import signal
import time

import pytest
import torch
from torch import nn

import fedweave
from fedweave.algorithms.base import RunContext, build_algorithm
from fedweave.config import ConfigError, load
from fedweave.errors import WorkerLost
from fedweave.execution import LocalRule, evaluate, evaluate_clients
from fedweave.execution.evaluate import (
    EVAL_ROWS,
    batch_sums,
    channels_last_ok,
    eval_model,
    fork_shared,
    one_thread,
    share_with_workers,
    to_channels_last,
)
from fedweave.execution.params import ParamLayout
from fedweave.execution.pool import _serve, pool, pool_for
from fedweave.execution.shards import shard_bounds
from tests.conftest import make_toy
from tests.test_core_engine import ProxLookAhead, _models, _trainer


class Unchanged(LocalRule):
    """Plain SGD written as a rule: takes the general path, not the fast path."""

    def direction(self, w, grad, jobs):
        return grad(w)


class Boom(LocalRule):
    def direction(self, w, grad, jobs):
        raise ValueError("rule failed on purpose")


@pytest.fixture(params=["linear", "cnn"])
def model(request):
    return dict(zip(["linear", "cnn"], _models()))[request.param]


@pytest.mark.parametrize("local", [{"epochs": 2, "batch_size": 16, "lr": 0.1}, {"steps": 4, "batch_size": 8}])
def test_plain_fast_path_gives_the_general_paths_bits(model, uneven_parts, local):
    tr = _trainer(model, uneven_parts, "loop", **local)
    w0 = tr.layout.flatten()
    starts = w0 + 0.01 * torch.arange(5, dtype=torch.float32)[:, None]
    fast = tr.train(starts, [0, 1, 2, 3, 5], round=1)
    general = tr.train(starts, [0, 1, 2, 3, 5], round=1, rule=Unchanged())
    assert torch.equal(fast.params, general.params) and torch.equal(fast.loss, general.loss)
    assert torch.equal(tr.layout.flatten(), w0)  # the template model is left as it was


def test_pool_equals_loop_for_plain_and_custom_rules(model, uneven_parts):
    clients = [0, 1, 2, 3, 5, 4]
    loop = _trainer(model, uneven_parts, "loop", epochs=1, batch_size=16, lr=0.1)
    pooled = _trainer(model, uneven_parts, "pool", epochs=1, batch_size=16, lr=0.1)
    pool(pooled, workers=2)
    w0 = loop.layout.flatten()
    starts = w0 + 0.01 * torch.arange(len(clients), dtype=torch.float32)[:, None]
    anchors = torch.randn(len(clients), loop.layout.numel, generator=torch.Generator().manual_seed(1)) * 0.1
    for rule in (LocalRule(), ProxLookAhead(anchors)):  # per-job tensors indexed by global job position
        a = loop.train(starts, clients, round=2, rule=rule)
        b = pooled.train(starts, clients, round=2, rule=rule)
        assert torch.equal(a.steps, b.steps)
        torch.testing.assert_close(b.params, a.params, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(b.loss, a.loss, rtol=1e-6, atol=1e-6)
    one = pooled.train(w0, [3], round=0)  # one shared start, fewer jobs than workers
    torch.testing.assert_close(one.params, loop.train(w0, [3], round=0).params, rtol=1e-6, atol=1e-6)
    assert pooled.train(w0, [], round=0).params.shape == (0, w0.numel())


def test_pool_evaluation_adds_the_same_batch_sums(model, uneven_parts):
    ds = make_toy(n_test=301)  # 301 rows, batches of 64: 5 batches, uneven over 2 workers
    tr = _trainer(model, uneven_parts, "pool", epochs=1, batch_size=16, lr=0.1)
    w = tr.layout.flatten() + 0.05
    local = batch_sums(tr.layout, w, ds.test_x, ds.test_y, 64)
    want = (sum(c for _, c in local) / 301, sum(s for s, _ in local) / 301)
    assert evaluate(tr.layout, w, ds.test_x, ds.test_y, 64) == want  # no pool yet: in the driver
    p = pool(tr, workers=2)
    assert pool_for(tr.layout) is p
    assert p.batch_sums(w, ds.test_x, ds.test_y, 64) == local  # the same batches, the same values
    assert evaluate(tr.layout, w, ds.test_x, ds.test_y, 64) == want
    assert evaluate(tr.layout, w, ds.test_x, ds.test_y, 64) == want  # the set is cached in the workers
    ds.test_x[0] += 1.0  # modified in place: sent again, not served stale
    changed = batch_sums(tr.layout, w, ds.test_x, ds.test_y, 64)
    assert p.batch_sums(w, ds.test_x, ds.test_y, 64) == changed


def test_a_declared_evaluation_set_is_read_from_the_fork_not_copied(uneven_parts, monkeypatch):
    """The test set a run declares (``share_with_workers``, done by ``RunContext.dataset``) exists before the
    pool forks: the workers evaluate on views of their inherited copy (pages shared with the driver) instead
    of receiving a copy of their rows; the sums are the driver's. Modified in place, it is sent as before."""
    model = next(iter(_models()))
    ds = make_toy(n_test=301)
    share_with_workers(ds.test_x, ds.test_y)
    tr = _trainer(model, uneven_parts, "pool", epochs=1, batch_size=16, lr=0.1)
    w = tr.layout.flatten() + 0.05
    p = pool(tr, workers=2)
    sent = []
    request = p.request
    monkeypatch.setattr(p, "request", lambda calls: sent.extend(op for _, op, _ in calls) or request(calls))
    assert p.batch_sums(w, ds.test_x, ds.test_y, 64) == batch_sums(tr.layout, w, ds.test_x, ds.test_y, 64)
    assert sent == ["view", "view", "evaluate", "evaluate"]  # no "data": no rows travel
    ds.test_x[0] += 1.0  # the workers' inherited copy is stale now: the rows are sent
    sent.clear()
    assert p.batch_sums(w, ds.test_x, ds.test_y, 64) == batch_sums(tr.layout, w, ds.test_x, ds.test_y, 64)
    assert sent == ["data", "data", "evaluate", "evaluate"]
    later = make_toy(n_test=100, seed=3)  # declared after the fork: the workers do not have it
    share_with_workers(later.test_x, later.test_y)
    sent.clear()
    assert p.batch_sums(w, later.test_x, later.test_y, 64) == batch_sums(tr.layout, w, later.test_x, later.test_y, 64)
    assert sent[:2] == ["data", "data"]


def test_a_runs_test_set_is_declared_for_the_pools_workers(toy_config):
    ds = RunContext(load(toy_config)).dataset
    assert fork_shared[id(ds.test_x)]() is ds.test_x and fork_shared[id(ds.test_y)]() is ds.test_y


def test_evaluation_rows_and_channels_last_twin():
    torch.manual_seed(0)
    cnn = nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(48, 4))
    assert channels_last_ok(cnn) and not channels_last_ok(nn.Sequential(nn.Flatten(), nn.Linear(36, 4)))
    assert not channels_last_ok(nn.Sequential(nn.Conv2d(1, 3, 3), nn.GroupNorm(1, 3)))
    from fedweave.execution import ParamLayout

    layout = ParamLayout(cnn)
    ds = make_toy(n_test=600)
    w = layout.flatten()
    with torch.inference_mode():  # the plain NCHW model, in one batch
        logits = cnn(ds.test_x)
        loss = float(nn.functional.cross_entropy(logits, ds.test_y))
        acc = int((logits.argmax(1) == ds.test_y).sum()) / 600
    got_acc, got_loss = evaluate(layout, w, ds.test_x, ds.test_y, 2048)
    assert got_acc == pytest.approx(acc, abs=1e-9) and got_loss == pytest.approx(loss, rel=1e-5)
    assert len(batch_sums(layout, w, ds.test_x, ds.test_y, min(2048, EVAL_ROWS))) == -(-600 // EVAL_ROWS)
    accs, losses = evaluate_clients(layout, w, ds.test_x, ds.test_y, [list(range(300)), list(range(300, 600))])
    assert (accs * 300).sum() / 600 == pytest.approx(acc) and losses.mean() == pytest.approx(loss, rel=1e-5)


def test_a_failing_rule_reports_the_workers_traceback(uneven_parts):
    tr = _trainer(next(_models()), uneven_parts, "pool", epochs=1, batch_size=16, lr=0.1)
    pool(tr, workers=2)
    with pytest.raises(RuntimeError, match="rule failed on purpose"):
        tr.train(tr.layout.flatten(), [0, 1, 3], round=0, rule=Boom())
    assert tr.train(tr.layout.flatten(), [0, 1], round=0).params.shape[0] == 2  # the pool still serves


def test_workers_exit_when_the_trainer_is_collected(uneven_parts):
    tr = _trainer(next(_models()), uneven_parts, "pool", epochs=1, batch_size=16, lr=0.1)
    pids = pool(tr, workers=2).pids()
    assert all(os.path.exists(f"/proc/{p}") for p in pids)
    del tr
    gc.collect()
    deadline = time.time() + 10
    while time.time() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids)


def test_the_drivers_ends_of_the_pipes_live_in_the_driver_only(uneven_parts):
    """A worker that kept the copies its fork made of the driver's ends (its own and the earlier workers')
    held those pipes open after the driver was killed, and a worker blocked sending a reply never exited
    (two such orphans were found holding 0.6 GB each)."""
    tr = _trainer(next(_models()), uneven_parts, "pool", epochs=1, batch_size=16, lr=0.1)
    p = pool(tr, workers=3)
    # a worker closes the copies first thing in its loop: only one that has answered has surely run it. The
    # call gets a shard for every worker (clients 0-3, whose local steps are 1, 3, 1 and 10, filled two shards
    # only, and the third worker, given nothing, could still be waiting for the processor when it was looked at)
    clients = [3, 4, 5, 6]
    assert len(shard_bounds([tr.num_steps(c, None) for c in clients], 3)) == 3
    tr.train(tr.layout.flatten(), clients, 0)
    for i, conn in enumerate(p.conns):
        inode = os.fstat(conn.fileno()).st_ino
        for pid in p.pids():
            fds = os.listdir(f"/proc/{pid}/fd")
            held = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in fds if os.path.exists(f"/proc/{pid}/fd/{fd}")]
            assert f"socket:[{inode}]" not in held, f"worker pid {pid} holds the driver's end of worker {i}'s pipe"


def test_a_worker_that_died_is_one_line_naming_it_and_how(uneven_parts):
    """A worker killed from outside (the out-of-memory killer sends SIGKILL) ended the run in a RuntimeError of
    two lines, "a pool worker failed:" and "worker 0 (pid N) died", with no cause, which the command line
    printed as a traceback. It is one line now, naming the worker, its signal and what to do."""
    tr = _trainer(next(_models()), uneven_parts, "pool", epochs=1, batch_size=16, lr=0.1)
    p = pool(tr, workers=2)
    tr.train(tr.layout.flatten(), [0, 1, 3], round=0)
    victim = p.pids()[1]
    os.kill(victim, signal.SIGKILL)
    deadline = time.time() + 10
    while time.time() < deadline and _alive(victim):
        time.sleep(0.05)
    with pytest.raises(WorkerLost) as e:
        tr.train(tr.layout.flatten(), [0, 1, 3], round=1)
    msg = str(e.value)
    assert "\n" not in msg, msg
    assert f"worker 1 (pid {victim}) was killed by SIGKILL" in msg and "backend: loop" in msg, msg


def test_the_command_line_reports_a_lost_worker_in_one_line(monkeypatch, capsys, tmp_path):
    from fedweave import cli, runner

    def lost(*args, **kwargs):
        raise WorkerLost("backend pool: worker 1 (pid 7) was killed by SIGKILL")

    monkeypatch.setattr(runner, "run", lost)
    (tmp_path / "c.yaml").write_text("rounds: 1\n")
    assert cli.main(["run", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err == "fedweave: error: backend pool: worker 1 (pid 7) was killed by SIGKILL\n"


def test_a_worker_whose_driver_is_gone_exits_without_a_traceback(monkeypatch):
    """A worker that finished its work after the driver was killed failed to send its reply (a broken pipe),
    and multiprocessing printed the BrokenPipeError's traceback for each worker on the terminal; it returns
    quietly now, as it does when it finds the pipe closed while waiting for a request."""

    class Gone:
        def recv_bytes(self):
            return pickle.dumps(("no such request", None))

        def send_bytes(self, data):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(signal, "signal", lambda *args: None)  # the worker's handlers, not this process's
    threads = torch.get_num_threads()
    try:
        assert _serve(Gone(), None) is None
    finally:
        torch.set_num_threads(threads)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("algorithm", ["fedavg", "scaffold"])
def test_a_run_on_the_pool_equals_the_loop(toy_config, algorithm):
    out = {}
    for backend in ("loop", "auto"):  # auto: a CNN with 2 threads runs on the pool
        cfg = {**toy_config, "backend": backend, "threads": 2, "model": {"name": "_toy_cnn"}}
        cfg["algorithm"] = {"name": algorithm, "clients_per_round": 5}
        ctx = RunContext(load(cfg))
        torch.set_num_threads(2)  # as the runner does for `threads: 2`
        algo = build_algorithm(ctx)
        assert algo.trainer.backend == {"loop": "loop", "auto": "pool"}[backend]
        evals = []
        for r in range(3):
            algo.run_round(r)
            evals.append(algo.evaluate(r))
        out[backend] = (algo.x.clone(), evals)
        torch.set_num_threads(1)
    torch.testing.assert_close(out["auto"][0], out["loop"][0], rtol=1e-5, atol=1e-6)
    for a, b in zip(out["loop"][1], out["auto"][1]):
        assert a["test_accuracy"] == b["test_accuracy"]
        assert a["test_loss"] == pytest.approx(b["test_loss"], rel=1e-5)


def test_evaluation_row_work_at_one_thread_keeps_the_sums(model):
    """The passes' losses and argmaxes run at one intra-op thread (``one_thread``): the same per-batch sums,
    bit for bit, as computed at the process's thread count, and the thread count is restored afterwards."""
    ds = make_toy(n_test=301)
    layout = ParamLayout(model)
    w = layout.flatten() + 0.05
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = batch_sums(layout, w, ds.test_x, ds.test_y, 64)
        assert torch.get_num_threads() == 2
        with one_thread():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        want = []
        with torch.inference_mode():  # each pass's row work at 2 threads, as it was computed before
            m, cl = eval_model(layout, w)
            for lo in range(0, 301, 64):
                xb = ds.test_x[lo : lo + 64]
                logits = m.eval()(to_channels_last(xb) if cl else xb)
                yb = ds.test_y[lo : lo + 64]
                loss = nn.functional.cross_entropy(logits, yb, reduction="sum")
                want.append((loss.item(), int((logits.argmax(1) == yb).sum())))
        m.train()
    finally:
        torch.set_num_threads(threads)
    assert got == want


@pytest.mark.parametrize("algorithm", [{"name": "fedavg", "clients_per_round": 2}, {"name": "dfedavg"}])
def test_a_model_with_running_statistics_is_refused_with_one_line(tmp_path, algorithm):
    """A model's batch-norm running statistics are buffers, which the flat parameter vector does not carry:
    every forward pass of local training moved them in whichever process trained (on the pool, each worker's
    own, and those workers evaluated the global model with them), the server did not average them and a
    checkpoint did not hold them. A model passed from Python with ``nn.BatchNorm2d`` ran silently: on the
    pool its test loss differed from the loop's (1.0780 against 1.0807, 2 points of accuracy) and a resumed
    run on the loop left the uninterrupted one at the first resumed round. It is refused before anything is
    written, as FedBN refused it already; the same model without running statistics runs."""
    ds = make_toy(n_train=200, n_test=50)
    data = (ds.train_x, ds.train_y, ds.test_x, ds.test_y)

    def model(running: bool = True) -> nn.Module:
        bn = nn.BatchNorm2d(3, track_running_stats=running)
        return nn.Sequential(nn.Conv2d(1, 3, 3), bn, nn.ReLU(), nn.Flatten(), nn.Linear(48, 4))

    cfg = {"rounds": 1, "partition": {"name": "iid", "num_clients": 4}, "algorithm": algorithm,
           "output": {"progress": False, "plots": False}}  # fmt: skip
    with pytest.raises(ConfigError, match=r"^model: its BatchNorm2d '1' keeps running statistics") as e:
        fedweave.run(cfg, model=model, dataset=data, run_dir=tmp_path / "refused")
    assert "\n" not in str(e.value) and not (tmp_path / "refused").exists()
    fedweave.run(cfg, model=lambda: model(running=False), dataset=data, run_dir=tmp_path / "runs")
