"""Jobs as data for the Flower deployment: every deployable rule survives the trip, unknown rules and
malformed jobs are refused, the app project is valid for Flower, and a plain import stays free of flwr."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch

from fedweave.algorithms.centralized.fedcm import FedCMRule
from fedweave.algorithms.centralized.feddyn import FedDynRule
from fedweave.algorithms.centralized.fedmim import MIMRule
from fedweave.algorithms.centralized.fedprox import ProxRule
from fedweave.algorithms.centralized.fedsam import SAMRule
from fedweave.algorithms.centralized.scaffold import ScaffoldRule
from fedweave.algorithms.hierarchical.base import BallProjection, BoxProjection, LowerLevelRule, decaying
from fedweave.config import LocalConfig, load
from fedweave.deploy.jobs import MalformedJobError, UnknownRuleError, decode_job, encode_header, encode_job
from fedweave.execution.local import PLAIN, LocalCall, LocalRule, reindexed
from fedweave.registry import RULES as RULES_REGISTRY

K, P = 3, 5
g = torch.Generator().manual_seed(0)
TABLE, VEC = torch.randn(K, P, generator=g), torch.randn(P, generator=g)
RULES = {
    "plain": PLAIN,
    "scaffold": ScaffoldRule(TABLE, VEC),
    "fedprox": ProxRule(0.1, VEC),
    "feddyn": FedDynRule(0.01, VEC, TABLE),
    "fedsam": SAMRule(0.05),
    "fedcm": FedCMRule(0.1, VEC, weight_decay=1e-3, grad_clip=None, sam_rho=0.05),
    "fedmim": MIMRule(VEC, -VEC, 0.1, 0.05, weight_decay=1e-4, grad_clip=2.0),
    "lower_level-ball": LowerLevelRule(0.3, TABLE, BallProjection(0.5)),
    "lower_level-box": LowerLevelRule(0.3, VEC, BoxProjection(-0.2, float("inf"))),
}


def trip(rule: LocalRule, k: int, jobs: int = K):
    call = LocalCall(VEC.expand(jobs, -1), [7] * jobs, 2, rule, 0.05, 3, (1,))
    header, tensors = encode_job(call, k, local=LocalConfig(steps=3))
    return decode_job(encode_header(header), tensors)


def quadratic_grad(w: torch.Tensor) -> torch.Tensor:
    return 2 * w + 1


@pytest.mark.parametrize("name", RULES)
def test_rule_rebuilt_on_the_node_gives_the_same_direction_for_its_job(name):
    rule = RULES[name]
    w = torch.randn(P, generator=g)
    for k in range(K):
        job = trip(rule, k)
        assert type(job.call.rule) is type(rule)
        # the node runs its one job as job 0 of its call
        torch.testing.assert_close(job.call.rule.direction(w, quadratic_grad, 0), rule.direction(w, quadratic_grad, k))
        torch.testing.assert_close(job.call.rule.project(w, 0), rule.project(w, k))
    assert (job.client, job.call.round, job.call.steps, job.call.key, job.call.lr) == (7, 2, 3, (1,), 0.05)


@RULES_REGISTRY.register("_test_scaled")
class Scaled(LocalRule):
    """A rule registered at its definition, as a plug-in's would be: nothing in fedweave.deploy names it."""

    def __init__(self, scale: float, shift: torch.Tensor) -> None:
        self.scale, self.shift = scale, shift

    def direction(self, w, grad, jobs):
        return self.scale * grad(w) + self.shift[jobs]


def test_a_rule_registered_at_its_definition_travels_by_its_name():
    rule = Scaled(0.5, TABLE)
    w = torch.randn(P, generator=g)
    header, _ = encode_job(LocalCall(VEC.expand(K, -1), [7] * K, 2, rule, 0.05, 3, (1,)), 1, local=LocalConfig())
    assert header["rule"] == "_test_scaled" and header["rule_scalars"] == {"scale": 0.5}
    job = trip(rule, 1)
    assert type(job.call.rule) is Scaled
    torch.testing.assert_close(job.call.rule.direction(w, quadratic_grad, 0), rule.direction(w, quadratic_grad, 1))


def test_a_reindexed_rule_sends_the_row_of_the_original_job():
    rule = reindexed(RULES["scaffold"], [2, 0])
    w = torch.randn(P, generator=g)
    job = trip(rule, 0, jobs=2)
    torch.testing.assert_close(
        job.call.rule.direction(w, quadratic_grad, 0), RULES["scaffold"].direction(w, quadratic_grad, 2)
    )


def test_unknown_rule_is_refused_with_the_known_names():
    class Homemade(LocalRule):
        def direction(self, w, grad, jobs):
            return -grad(w)

    with pytest.raises(UnknownRuleError, match="Homemade is not registered"):
        trip(Homemade(), 0)
    header, tensors = encode_job(LocalCall(VEC[None], [0], 0, PLAIN, 0.1, 1, ()), 0, local=LocalConfig(steps=1))
    header["rule"] = "os.system"
    with pytest.raises(UnknownRuleError, match="unknown local rule 'os.system'; this node knows: ") as e:
        decode_job(encode_header(header), tensors)
    known = str(e.value).split("this node knows: ")[1].split(", ")
    builtin = ["fedcm", "feddyn", "fedlc", "fedmim", "fedproto", "fedprox", "fedsam", "lower_level", "moon", "plain"]
    builtin += ["proxskip", "scaffold"]
    assert [n for n in known if not n.startswith("_")] == builtin  # the tests' own rules start with _


def test_malformed_jobs_are_refused():
    header, tensors = encode_job(LocalCall(VEC[None], [0], 0, PLAIN, 0.1, 1, ()), 0, local=LocalConfig(steps=1))
    with pytest.raises(MalformedJobError, match="JSONDecodeError"):
        decode_job("{not json", tensors)
    with pytest.raises(MalformedJobError, match="KeyError: 'start'"):
        decode_job(encode_header(header), {})
    bad = {**header, "local": {"no_such_key": 1}}
    with pytest.raises(MalformedJobError, match="no_such_key"):
        decode_job(json.dumps(bad), tensors)


def test_a_registered_schedule_travels_and_a_function_does_not():
    call = LocalCall(VEC[None], [0], 0, PLAIN, decaying(0.3, 2.0), 4, ())
    header, tensors = encode_job(call, 0, local=LocalConfig(steps=4))
    assert header["lr"] == {"schedule": "decaying", "scalars": {"c": 0.3, "offset": 2.0}}
    lr = decode_job(encode_header(header), tensors).call.lr
    assert [lr(t) for t in range(4)] == [0.3 / (t + 2.0) for t in range(4)]
    with pytest.raises(ValueError, match="a constant local learning rate or a registered schedule .decaying."):
        encode_job(LocalCall(VEC[None], [0], 0, PLAIN, lambda t: 0.1, 1, ()), 0, local=LocalConfig(steps=1))
    header["lr"] = {"schedule": "cosine", "scalars": {}}
    with pytest.raises(UnknownRuleError, match="unknown learning-rate schedule 'cosine'; this node knows: decaying"):
        decode_job(encode_header(header), tensors)


def test_a_projection_travels_as_data_and_a_tensor_equal_to_the_start_travels_once():
    """The lower level's projection goes as its registered name and scalars (an unknown one is refused), and
    the input point it is anchored at, which is the job's start (ZO-HFL), is not sent a second time."""
    rule = LowerLevelRule(0.3, torch.stack([VEC, -VEC]), BoxProjection(-0.2, float("inf")))
    call = LocalCall(torch.stack([VEC, -VEC]), [1, 0], 0, rule, 0.1, 1, ())
    header, tensors = encode_job(call, 1, local=LocalConfig(steps=1))
    assert sorted(tensors) == ["start"] and header["same_as_start"] == {"rule.anchors": [1, P]}
    assert header["rule_scalars"]["projection"] == {"part": "box", "scalars": {"low": -0.2, "high": float("inf")}}
    job = decode_job(encode_header(header), tensors)
    assert torch.equal(job.call.rule.anchors, -VEC[None]) and isinstance(job.call.rule.projection, BoxProjection)
    header["rule_scalars"]["projection"]["part"] = "sphere"
    with pytest.raises(UnknownRuleError, match="unknown part 'sphere'; this node knows: ball, box, projection"):
        decode_job(encode_header(header), tensors)


def test_flower_app_project_is_valid_and_carries_the_config(tmp_path, toy_config):
    flwr_config = pytest.importorskip("flwr.common.config")
    cfg = load(toy_config)
    from fedweave.cli import main

    args = ["flower-app", "--run-dir", str(tmp_path / "out"), "--on-error", "drop", "--node-data", str(tmp_path / "d")]
    assert main([*args, _write(tmp_path, toy_config), str(tmp_path / "app")]) == 0
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == [f"client-{i}.npz" for i in sorted(range(12), key=str)]
    data = tomllib.loads((tmp_path / "app" / "pyproject.toml").read_text())
    ok, errors, _ = flwr_config.validate_config(data, check_module=False)
    assert ok, errors
    app = data["tool"]["flwr"]["app"]
    assert load(json.loads(app["config"]["fedweave-config"])).to_dict() == cfg.to_dict()
    assert app["config"]["run-dir"] == str(tmp_path / "out")
    assert app["config"]["on-error"] == "drop" and app["config"]["reply-timeout"] == 600.0


def test_flower_app_with_node_data_it_cannot_write_writes_nothing(tmp_path, toy_config, capsys):
    """``--node-data`` into a directory that already holds a client's file, or that cannot be created (a path
    below a file), or for a partition the run cannot build, is refused in one line before the app or any node
    data file is written: the same command can be run again once the cause is gone (before, the app and the
    files of the clients before it were left behind, so that the app directory was no longer empty)."""
    from fedweave.cli import main

    config = _write(tmp_path, toy_config)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "client-1.npz").write_bytes(b"mine")
    assert main(["flower-app", config, str(tmp_path / "app"), "--node-data", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "client-1.npz exists" in err
    assert not (tmp_path / "app").exists()
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["client-1.npz"]
    assert (tmp_path / "d" / "client-1.npz").read_bytes() == b"mine"
    bad = ["partition.alpha=-1"]
    assert main(["flower-app", config, str(tmp_path / "app"), *bad, "--node-data", str(tmp_path / "e")]) == 2
    assert "partition.alpha must be > 0" in capsys.readouterr().err
    assert not (tmp_path / "app").exists() and not (tmp_path / "e").exists()
    (tmp_path / "f").write_bytes(b"a file")  # a directory that cannot be created: refused before the app too
    assert main(["flower-app", config, str(tmp_path / "app"), "--node-data", str(tmp_path / "f" / "d")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "node data directory" in err and "lies under the file" in err
    assert not (tmp_path / "app").exists()
    (tmp_path / "d" / "client-1.npz").unlink()
    assert main(["flower-app", config, str(tmp_path / "app"), "--node-data", str(tmp_path / "d")]) == 0
    assert len(list((tmp_path / "d").iterdir())) == toy_config["partition"]["num_clients"]


@pytest.mark.parametrize("key", ["reply_timeout", "node_wait"])
@pytest.mark.parametrize("value", [float("inf"), float("nan"), 0.0, -1.0])
def test_write_app_refuses_seconds_the_serverapp_would_refuse(tmp_path, toy_config, key, value):
    """``write_app`` takes the seconds the ServerApp takes at start (a finite number > 0): an app it writes is
    never one the ServerApp refuses for its own settings (before, an infinite timeout was written)."""
    from fedweave.deploy.project import write_app

    with pytest.raises(ValueError, match=r"must be > 0 seconds \(finite\)"):
        write_app(load(toy_config), tmp_path / "app", **{key: value})
    assert not (tmp_path / "app").exists()


def _write(tmp_path, config: dict) -> str:
    import yaml

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_importing_fedweave_and_its_deploy_package_does_not_import_flwr():
    code = "import sys, fedweave, fedweave.deploy, fedweave.deploy.jobs, fedweave.cli; print('flwr' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("name", ["scaffold", "feddyn", "hier_scaffold"])
def test_a_stateful_client_on_its_node_equals_the_simulation(tmp_path, toy_config, name):
    """Two rounds of a stateful algorithm's clients: the simulation's call over its StateStore, and each
    client as a node job (its state in the node's files, the step rebuilt from the message) agree, and the
    node keeps the state the simulation stores."""
    pytest.importorskip("flwr")
    from fedweave.algorithms.base import RunContext
    from fedweave.algorithms.centralized.feddyn import FedDynStep
    from fedweave.algorithms.centralized.scaffold import ScaffoldStep
    from fedweave.algorithms.hierarchical.baselines import HierScaffoldStep
    from fedweave.deploy.client_app import _run_step
    from fedweave.deploy.node_state import INITIAL, NodeState
    from fedweave.execution import StateStore
    from fedweave.execution.local import LocalTrainer

    ctx = RunContext(load({**toy_config, "local": {"steps": 3, "batch_size": 8, "lr": 0.1}}))
    ds = ctx.dataset
    tr = LocalTrainer(ctx.model, ds.train_x, ds.train_y, ctx.partition, ctx.config.local, ctx.seeds)
    x = tr.layout.flatten()
    P = x.numel()
    store = StateStore(ctx.num_clients)
    store.create("c" if "scaffold" in name else FedDynStep.state[0], P)
    node = NodeState(tmp_path, run_id=7)
    clients, accepted = [1, 4], dict.fromkeys([1, 4], INITIAL)
    for r in range(2):
        if name == "feddyn":
            step = FedDynStep(0.05, x)
        else:
            step = (
                ScaffoldStep(0.01 * torch.ones(P), 0.1)
                if name == "scaffold"
                else HierScaffoldStep(0.01 * torch.ones(P), 0.17)
            )
        res, upload = tr.train_with_state(x, clients, r, step, store, lr=0.1)
        for k, c in enumerate(clients):
            call = LocalCall(x.expand(2, -1), clients, r, PLAIN, 0.1, None, ())
            header, tensors = encode_job(call, k, local=tr.local, step=step, state_round=accepted[c])
            job = decode_job(encode_header(header), tensors)
            assert type(job.step) is type(step) and job.state_round == accepted[c]
            got, sent = _run_step(tr, job, node)
            if "scaffold" in name:  # the client sends Delta y_i and Delta c_i, not its model
                assert sorted(sent) == ["dc", "dy"]
                torch.testing.assert_close(sent["dc"][0], upload["dc"][k])
                torch.testing.assert_close(sent["dy"][0], upload["dy"][k])
            else:  # FedDyn's client sends its model
                assert sorted(sent) == ["params"]
            torch.testing.assert_close(got.params[0], res.params[k])
            accepted[c] = r
            kept = node.load(c, r, step.state, x)
            torch.testing.assert_close(kept[step.state[0]][0], store[step.state[0]][c])
        x = res.params.mean(0)
    # the state moved away from zero: the comparison above was not of two zeros
    assert float(store[step.state[0]][clients].abs().sum()) > 0


def test_node_state_keeps_the_accepted_version_and_the_new_one(tmp_path):
    from fedweave.deploy.node_state import INITIAL, NodeState, StateMissingError

    node = NodeState(tmp_path, run_id=1)
    like = torch.zeros(3)
    assert node.load(2, INITIAL, ("c",), like)["c"].tolist() == [[0.0, 0.0, 0.0]]
    node.save(2, 0, {"c": torch.ones(1, 3)}, accepted=INITIAL)
    node.save(2, 1, {"c": 2 * torch.ones(1, 3)}, accepted=0)
    files = lambda: sorted(p.name for p in (tmp_path / "run-1" / "client-2").iterdir())  # noqa: E731
    assert files() == ["round-0.npz", "round-1.npz"]
    # round 2's reply never reached the server: it still names round 0, so round 1 is forgotten
    assert node.load(2, 0, ("c",), like)["c"].tolist() == [[1.0, 1.0, 1.0]]
    node.save(2, 2, {"c": 3 * torch.ones(1, 3)}, accepted=0)
    assert files() == ["round-0.npz", "round-2.npz"]
    with pytest.raises(StateMissingError, match="state of client 2 from round 2 is not in"):
        node.load(2, 1, ("c",), like)
    assert not list((tmp_path / "run-1" / "client-2").glob("*.tmp"))


def test_node_state_release_removes_the_files_the_run_wrote_for_the_client_and_nothing_else(tmp_path):
    """At a run's end a node removes what the run wrote for its client (state versions, a split turn, a trial's
    samples, error-feedback residuals, the temporary file of a write cut short) and the directories that this
    empties. A file the run did not write, another client's and another run's files, a file ``keep`` names (a
    node's own data) and whatever a link leads to stay."""
    from fedweave.deploy.node_data import write_samples
    from fedweave.deploy.node_state import INITIAL, RESIDUALS, NodeState

    node, residuals = NodeState(tmp_path, run_id=3), NodeState(tmp_path, run_id=3, part=RESIDUALS)
    row = {"c": torch.ones(1, 3)}
    for c in (1, 2):
        node.save(c, 0, row, accepted=INITIAL)
        node.save(c, 1, row, accepted=0)
        node.save_turn(c, 1, row)
        residuals.save(c, 0, row, accepted=INITIAL)
        write_samples(node.samples(c), torch.zeros(2, 3), torch.zeros(2))
    (node.client_dir(1) / ".round-2.npz.k3x_9a2q.tmp").write_bytes(b"")  # a node killed while it wrote
    NodeState(tmp_path, run_id=4).save(1, 0, row, accepted=INITIAL)  # another run's
    (residuals.client_dir(1) / "notes.txt").write_text("not the run's")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "round-0.npz").write_bytes(b"x")
    (node.client_dir(1) / "round-7.npz").symlink_to(outside / "round-0.npz")
    (node.run_dir / "client-5").symlink_to(outside, target_is_directory=True)
    files = lambda: sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if not p.is_dir())  # noqa: E731
    before = files()

    removed, failed = node.release(1)
    assert failed == []
    gone = [
        "run-3/client-1/.round-2.npz.k3x_9a2q.tmp",
        "run-3/client-1/round-0.npz",
        "run-3/client-1/round-1.npz",
        "run-3/client-1/samples.npz",
        "run-3/client-1/turn-round-1.npz",
        "run-3/residuals/client-1/round-0.npz",
    ]
    assert sorted(str(p.relative_to(tmp_path)) for p in removed) == gone
    assert files() == sorted(set(before) - set(gone))  # the link, the notes, client 2's and run 4's files stay
    assert (node.client_dir(1) / "round-7.npz").is_symlink() and (outside / "round-0.npz").read_bytes() == b"x"
    assert node.release(5) == ([], []) and (outside / "round-0.npz").is_file()  # behind a link: not the run's

    (node.client_dir(1) / "round-7.npz").unlink()
    (node.run_dir / "client-5").unlink()
    removed, failed = node.release(2, keep=(str(node.samples(2)),))  # its own data file, where the run's would be
    assert failed == [] and len(removed) == 4 and node.samples(2).is_file()
    node.samples(2).unlink()
    assert node.release(2) == ([], []) and not node.client_dir(2).exists()  # emptied: removed
    assert files() == ["elsewhere/round-0.npz", "run-3/residuals/client-1/notes.txt", "run-4/client-1/round-0.npz"]
    (residuals.client_dir(1) / "notes.txt").unlink()
    assert node.release(1) == ([], []) and not node.run_dir.exists()  # the last file gone, so is the run's directory


def test_a_step_job_carries_the_servers_tensors_and_the_state_version_not_the_state():
    from fedweave.algorithms.centralized.scaffold import ScaffoldStep

    call = LocalCall(VEC[None], [3], 5, PLAIN, 0.1, 2, ())
    header, tensors = encode_job(call, 0, local=LocalConfig(steps=2), step=ScaffoldStep(-VEC, 0.1), state_round=3)
    assert sorted(tensors) == ["start", "step.c_global"]
    assert header["step"] == "scaffold" and header["state_round"] == 3 and header["step_scalars"] == {"lr": 0.1}
    header["step"] = "homemade"
    with pytest.raises(
        UnknownRuleError, match="unknown client step 'homemade'; this node knows: feddyn, hier_scaffold, moon, scaffold"
    ):
        decode_job(encode_header(header), tensors)


def test_node_data_files_are_checked_and_export_gives_the_clients_samples(tmp_path, toy_config):
    from fedweave.algorithms.base import RunContext
    from fedweave.deploy.node_data import NodeDataError, export_clients, load_node_data

    cfg = load(toy_config)
    paths = export_clients(cfg, tmp_path / "data", [3, 5])
    assert [p.name for p in paths] == ["client-3.npz", "client-5.npz"]
    ctx = RunContext(cfg)
    x, y = load_node_data(paths[0])
    idx = torch.as_tensor(ctx.partition[3])
    torch.testing.assert_close(x, ctx.dataset.train_x[idx])
    assert torch.equal(y, ctx.dataset.train_y[idx]) and y.dtype == torch.int64
    with pytest.raises(FileExistsError, match="client-3.npz exists"):
        export_clients(cfg, tmp_path / "data", [3])
    with pytest.raises(NodeDataError, match="is not a file"):
        load_node_data(tmp_path / "nope.npz")
    bad = tmp_path / "bad.npz"
    np.savez(bad, x=np.zeros((4, 2)), labels=np.zeros(4))
    with pytest.raises(NodeDataError, match=r"lacks the arrays \['y'\]"):
        load_node_data(bad)
    np.savez(bad, x=np.zeros((4, 2)), y=np.zeros(3))
    with pytest.raises(NodeDataError, match="x has 4 rows and y 3"):
        load_node_data(bad)
    bad.write_text("not a zip")
    with pytest.raises(NodeDataError, match="not a readable .npz"):
        load_node_data(bad)


def test_a_node_whose_data_size_differs_from_the_servers_partition_is_refused():
    pytest.importorskip("flwr")
    from fedweave.deploy.server_app import DeploymentError, FlowerClients

    clients = FlowerClients(None, reply_timeout=1.0, node_wait=1.0)
    clients.samples = {1: 40}
    clients.check_samples([30, 40, 50])
    clients.samples = {2: 49}
    with pytest.raises(DeploymentError, match="client 2 holds 49 samples in its data file, but the run's partition"):
        clients.check_samples([30, 40, 50])


def test_a_node_trains_on_its_own_data_file_as_the_simulation_does(tmp_path, toy_config):
    """The node's trainer over an exported file gives the job the simulation gives the client."""
    pytest.importorskip("flwr")
    from fedweave.algorithms.base import RunContext
    from fedweave.deploy.client_app import _trainer
    from fedweave.deploy.node_data import export_clients
    from fedweave.execution import loop
    from fedweave.execution.local import LocalTrainer

    cfg = load({**toy_config, "local": {"steps": 3, "batch_size": 8, "lr": 0.1}})
    ctx = RunContext(cfg)
    ds = ctx.dataset
    sim = LocalTrainer(ctx.model, ds.train_x, ds.train_y, ctx.partition, cfg.local, ctx.seeds)
    (path,) = export_clients(cfg, tmp_path, [4])
    node = _trainer(json.dumps(cfg.to_dict()), str(path), 4, ds.num_classes)
    x = sim.layout.flatten()
    call = LocalCall(x[None], [4], 2, PLAIN, 0.1, None, (1,))
    want, got = loop.run(sim, call), loop.run(node, call)
    torch.testing.assert_close(got.params, want.params)
    assert got.loss.item() == pytest.approx(want.loss.item())


@pytest.mark.parametrize("own_data", [False, True], ids=["partition", "data-file"])
def test_a_cse_fsl_epoch_on_the_node_equals_the_simulations(tmp_path, own_data):
    """The node's side of a CSE-FSL job (the client's epoch from the fed server's models), over the wire
    format, gives the simulation's client-side model, auxiliary net, smashed uploads and losses."""
    pytest.importorskip("flwr")
    from fedweave.algorithms.base import RunContext, build_algorithm
    from fedweave.deploy import split
    from fedweave.deploy.node_data import export_clients

    cfg = load({
        "name": "s", "seed": 2, "rounds": 2, "dataset": {"name": "digits", "as_image": True},
        "partition": {"name": "iid", "num_clients": 4}, "model": {"name": "split_small", "width": 4, "hidden": 8},
        "algorithm": {"name": "cse_fsl", "h": 2}, "local": {"steps": 5, "batch_size": 8, "lr": 0.05},
    })  # fmt: skip
    algo = build_algorithm(RunContext(cfg))
    xc, xa = algo.xc + 0.01, algo.xa - 0.01
    want = algo.client_epoch(1, 3, xc, xa, (0.05, 0.04), 0, 5, 0)
    data = str(export_clients(cfg, tmp_path, [3])[0]) if own_data else None
    header = {"kind": split.EPOCH, "client": 3, "round": 1, "lrs": [0.05, 0.04], "start": 0, "period": 5, "seg": 0,
              "num_classes": 10}  # fmt: skip
    h, t = split.run_epoch(header, {"xc": xc[None], "xa": xa[None]}, json.dumps(cfg.to_dict()), data, 3)
    got = split.decode_epoch(json.loads(json.dumps(h)), t)
    torch.testing.assert_close(got.xc, want.xc)
    torch.testing.assert_close(got.xa, want.xa)
    assert got.losses == pytest.approx(want.losses) and got.batches == want.batches == 5
    assert [(w, m) for w, m, _, _ in got.uploads] == [(w, m) for w, m, _, _ in want.uploads] == [(0, 1), (1, 3)]
    for (_, _, a, y), (_, _, a0, y0) in zip(got.uploads, want.uploads, strict=True):
        torch.testing.assert_close(a, a0)
        assert torch.equal(y, y0)


def test_a_split_node_refuses_a_job_whose_settings_or_models_are_not_the_runs():
    """A split node checks the job's numbers and the models it receives (x_c, a_c: the run's client-side
    model and auxiliary net, in the run's dtype) before its epoch; one line names what is wrong."""
    pytest.importorskip("flwr")
    from fedweave.algorithms.base import RunContext, build_algorithm
    from fedweave.deploy import split

    cfg = load({
        "name": "s", "seed": 2, "rounds": 2, "dataset": {"name": "digits", "as_image": True},
        "partition": {"name": "iid", "num_clients": 4}, "model": {"name": "split_small", "width": 4, "hidden": 8},
        "algorithm": {"name": "cse_fsl", "h": 2}, "local": {"steps": 5, "batch_size": 8, "lr": 0.05},
    })  # fmt: skip
    algo = build_algorithm(RunContext(cfg))
    good = {"xc": algo.xc[None], "xa": algo.xa[None]}
    header = {"kind": split.EPOCH, "client": 3, "round": 1, "lrs": [0.05, 0.04], "start": 0, "period": 5, "seg": 0,
              "num_classes": 10}  # fmt: skip
    cases = [
        ({**header, "round": "1"}, good, "the job's round must be an integer, got '1'"),
        ({**header, "period": 0}, good, "the job's period must be >= 1, got 0"),
        ({**header, "lrs": [0.05, -1.0]}, good, "the job's lr must be a finite number >= 0, got -1.0"),
        (header, {**good, "xc": algo.xc[None, :-1]}, f"job tensor 'xc' has shape (1, {algo.xc.numel() - 1})"),
        (header, {**good, "xa": algo.xa[None].double()}, "job tensor 'xa' is torch.float64"),
    ]
    for h, t, why in cases:
        with pytest.raises(MalformedJobError, match=re.escape(why)):
            split.run_epoch(h, t, json.dumps(cfg.to_dict()), None, 3)


class InProcessNodes:
    """``FlowerClients.run_jobs`` with every split job run by the node's own functions in this process, over
    the wire format (JSON header, tensors as Flower records); it counts the array bytes each way."""

    def __init__(self, config_json: str, state_dir) -> None:
        from fedweave.deploy.node_state import NodeState

        self.config_json, self.store = config_json, NodeState(state_dir, run_id=1)
        self.sent = self.received = 0

    def run_jobs(self, round: int, jobs):
        from fedweave.deploy import split
        from fedweave.deploy.wire import from_records, to_records

        replies = []
        for c, header, tensors in jobs:
            self.sent += sum(t.numel() * t.element_size() for t in tensors.values())
            h, t = from_records(to_records(header, tensors))
            h = json.loads(h)
            if h["kind"] == split.EPOCH:
                out = split.run_epoch(h, t, self.config_json, None, c)
            else:
                out = split.run_turn(h, t, self.config_json, None, c, self.store)
            self.received += sum(t.numel() * t.element_size() for t in out[1].values())
            replies.append(type("Reply", (), {"content": to_records(*out)})())
        return replies


SPLIT_RUNS = {
    "fsl_mc": {"name": "fsl_mc"},
    "fsl_oc": {"name": "fsl_oc"},
    "fsl_oc-interleaved": {"name": "fsl_oc", "schedule": "interleaved"},
    "fsl_an": {"name": "fsl_an"},
    "cse_fsl": {"name": "cse_fsl", "h": 2},
}


@pytest.mark.parametrize("model", ["split_small", "split_femnist"])
@pytest.mark.parametrize("method", SPLIT_RUNS)
def test_split_clients_on_their_nodes_equal_the_simulation(tmp_path, method, model):
    """Two rounds of each split method with the clients' side run by the nodes' functions (the job and reply
    through the wire format; FSL_MC/OC: a message per batch, the client kept in the node's files between
    them, its forward pass computed again there) give the simulation's models and metrics bit for bit, and
    the messages carry the ledger's bytes. split_femnist has dropout in both parts: each party's own stream."""
    split_equals_simulation(tmp_path, SPLIT_RUNS[method], model)


@pytest.mark.parametrize("precision", ["float64", "bf16-mixed"])
@pytest.mark.parametrize("method", ["cse_fsl", "fsl_mc"])
def test_split_clients_on_their_nodes_compute_in_the_runs_precision(tmp_path, method, precision):
    """The nodes' client parts (and CSE-FSL's auxiliary net) in float64, or with bf16 autocast, as in the
    simulation, bit for bit."""
    split_equals_simulation(tmp_path, SPLIT_RUNS[method], "split_small", precision)


def split_equals_simulation(tmp_path, algorithm: dict, model: str, precision: str = "float32") -> None:
    pytest.importorskip("flwr")
    from fedweave.algorithms.base import RunContext, build_algorithm
    from fedweave.deploy import split

    opts = {"width": 4, "hidden": 16} if model == "split_small" else {}
    cfg = load({
        "name": "s", "seed": 4, "rounds": 2, "dataset": {"name": "digits", "as_image": True},
        "partition": {"name": "dirichlet", "num_clients": 4, "alpha": 0.5}, "model": {"name": model, **opts},
        "algorithm": {**algorithm, "clients_per_round": 3}, "local": {"steps": 3, "batch_size": 8, "lr": 0.05},
        "precision": precision,
    })  # fmt: skip
    sim, deployed = build_algorithm(RunContext(cfg)), build_algorithm(RunContext(cfg))
    nodes = InProcessNodes(json.dumps(cfg.to_dict()), tmp_path)
    split.attach(nodes, deployed)
    for r in range(2):
        want, got = sim.run_round(r), deployed.run_round(r)
        assert got == want
        for part in ("xc", "xs", "xa"):
            assert torch.equal(getattr(deployed, part), getattr(sim, part)), part
    assert want["server_steps"] > 0 and want["train_loss"] > 0
    assert sim.ledger.bytes() == deployed.ledger.bytes()
    assert nodes.received == deployed.ledger.bytes(sender="client")
    assert nodes.sent == deployed.ledger.bytes(receiver="client")


def test_the_executor_refuses_a_flower_whose_runtime_api_it_does_not_speak(monkeypatch, capsys):
    flwr = pytest.importorskip("flwr")
    from fedweave.cli import main

    monkeypatch.setattr(flwr, "__version__", "1.99.0")
    assert main(["flower-executor", "--runtime-api-address", "127.0.0.1:1", "--insecure"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "speaks the Runtime API of Flower 1.42.x (pip install 'flwr>=1.42,<1.43'" in err
    assert "this is Flower 1.99.0" in err
    monkeypatch.setattr(flwr, "__version__", "1.4.2")  # not 1.42: the version's numbers, not its text
    assert main(["flower-executor", "--runtime-api-address", "127.0.0.1:1", "--insecure"]) == 2
    assert "this is Flower 1.4.2" in capsys.readouterr().err


@pytest.mark.parametrize("address", ["notanaddress", "127.0.0.1:99999", "127.0.0.1:0", ":9094", "host:port"])
def test_the_executor_refuses_an_address_that_is_not_host_and_port(address, capsys):
    """Flower's client retried such an address forever, saying only that a connection attempt failed."""
    from fedweave.cli import main

    assert main(["flower-executor", "--runtime-api-address", address, "--insecure"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "fedweave: error: --runtime-api-address must be HOST:PORT with a port from 1 to 65535 (the SuperNode's "
        f"Runtime API, its --port), got {address!r}\n"
    )


@pytest.mark.parametrize("module", ["flwr", "tomli_w"])
def test_the_flower_commands_without_the_flower_extra_say_so_in_one_line(
    tmp_path, toy_config, monkeypatch, capsys, module
):
    """Without the ``flower`` extra, ``fedweave flower-app`` (tomli_w) and ``fedweave flower-executor`` (flwr)
    end in one line naming the extra, not in a traceback of the missing import."""
    from fedweave.cli import main

    monkeypatch.setitem(sys.modules, module, None)  # an import of it fails as if it were not installed
    monkeypatch.delitem(sys.modules, "fedweave.deploy.project", raising=False)
    if module == "tomli_w":
        argv = ["flower-app", _write(tmp_path, toy_config), str(tmp_path / "app")]
    else:
        argv = ["flower-executor", "--runtime-api-address", "127.0.0.1:1", "--insecure"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"module {module!r} is missing" in err
    assert "pip install 'fedweave[flower]'" in err
    assert not (tmp_path / "app").exists()


def test_the_flower_extra_pins_the_release_the_executor_speaks():
    """One truth for the Flower release: pyproject's ``flower`` extra, the executor's check and the
    constraints' pin name the same one."""
    from fedweave.deploy.executor import FLOWER

    root = Path(__file__).parent.parent
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    major, minor = FLOWER
    flwr = [req for req in extras["flower"] if req.startswith("flwr")]
    assert flwr == [f"flwr[simulation]>={major}.{minor},<{major}.{minor + 1}"]
    # benchmarks/peers.py compares against the same release the tests run (the bench extra allowed any 1.x)
    assert [req for req in extras["bench"] if req.startswith("flwr")] == flwr
    pins = [line for line in (root / "constraints.txt").read_text().splitlines() if line.startswith("flwr==")]
    assert len(pins) == 1 and pins[0].startswith(f"flwr=={major}.{minor}."), pins
