"""Flower's SecAgg+ in deployment (fedweave.deploy.secure; docs/deployment.md, docs/privacy.md): in one process
(the stand-in Grid of test_deploy_inprocess delivering Flower messages to the nodes' ClientApp with Flower's
secaggplus_mod), the deployed run equals the simulation within SecAgg+'s quantization bound, the server never
holds an individual update, and what cannot be deployed is refused with one line. The run across real
SuperLink/SuperNode processes is in test_deploy_flower."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import ConfigRecord, Context, Error, Message, RecordDict  # noqa: E402

from fedweave.config import ConfigError, load  # noqa: E402
from fedweave.deploy import client_app, secure, server_app  # noqa: E402
from fedweave.runner import run  # noqa: E402
from tests.test_deploy_inprocess import CLIENTS, InProcessGrid, _task_identity  # noqa: E402, F401

SECURE = {"num_shares": 1.0, "reconstruction_threshold": 0.5, "max_weight": 1.0, "clipping_range": 1.0}


def _cfg(name: str = "fedavg", secure_section: dict | None = SECURE, **algo) -> dict:
    cfg = {
        "name": "s", "seed": 2, "rounds": 2, "backend": "loop", "dataset": {"name": "digits"},
        "partition": {"name": "dirichlet", "num_clients": CLIENTS, "alpha": 0.5}, "model": {"name": "logistic"},
        "algorithm": {"name": name, "clients_per_round": 3, "weighting": "uniform", **algo},
        "local": {"steps": 3, "batch_size": 16, "lr": 0.1}, "output": {"progress": False, "plots": False},
    }  # fmt: skip
    if secure_section is not None:
        cfg["secure_aggregation"] = secure_section
    return cfg


def _own_copy(msg):
    """A message as its node receives it: records of its own (the metadata and what it carries, copied)."""
    content = RecordDict()
    for name, rec in msg.content.config_records.items():
        content.config_records[name] = ConfigRecord(dict(rec))
    for name, rec in msg.content.array_records.items():
        content.array_records[name] = rec
    for name, rec in msg.content.metric_records.items():
        content.metric_records[name] = rec
    md = msg.metadata
    return Message(content, dst_node_id=md.dst_node_id, message_type=md.message_type, group_id=md.group_id)


class Watching(InProcessGrid):
    """The stand-in Grid that also keeps every reply a node sends the server, and gives each node its own copy of
    a message (as the transport does: SecAgg+'s setup sends one record to every node, and each node's mod
    takes its stage out of it)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.seen: list = []
        self.pushed: list = []

    def push_messages(self, msgs):
        self.pushed.extend(msgs)
        ids = []
        for msg in map(_own_copy, msgs):
            msg.metadata.__dict__["_message_id"] = msg.object_id  # as the SuperLink does
            self.jobs += msg.metadata.message_type == "train"
            try:
                reply = client_app.app(msg, self.contexts[msg.metadata.dst_node_id])
            except Exception as ex:  # as Flower's ClientApp runtime answers an exception: an error reply
                reply = Message(Error(code=2, reason=str(type(ex)) + ":<'" + str(ex) + "'>"), reply_to=msg)
            self.replies[msg.metadata.message_id] = reply
            ids.append(msg.metadata.message_id)
        self.messages += len(msgs)
        return ids

    def pull_messages(self, ids):
        out = super().pull_messages(ids)
        self.seen.extend(out)
        return out


def _deploy(cfg: dict, tmp_path, **app):
    config_json = json.dumps(load(cfg).to_dict())
    grid = Watching(config_json, tmp_path)
    run_config = {"fedweave-config": config_json, "run-dir": str(tmp_path / "deployed"), "reply-timeout": 60.0,
                  "node-wait": 5.0, "on-error": "stop", **app}  # fmt: skip
    server_app.main(grid, Context(7, 0, {}, RecordDict(), run_config))
    out = tmp_path / "deployed"
    return json.loads((out / "summary.json").read_text()), grid


class Recorder:
    """What each side computed: every node's update (float64, before Flower's mod masks it), and the server's
    securely aggregated mean of every round with the algorithm it serves."""

    def __init__(self, monkeypatch) -> None:
        self.updates: dict[int, dict[int, np.ndarray]] = {}  # round -> client -> its update
        self.means: list[np.ndarray] = []
        self.algo = None
        reply, aggregate = secure.masked_reply, secure.SecureAggregation.aggregate

        def masked_reply(msg, header, update):
            r = json.loads(str(msg.content["header"]["json"]))["round"]
            c = int(msg.content.config_records[secure.WEIGHT]["client"])
            self.updates.setdefault(r, {})[c] = update.reshape(-1).double().numpy()
            return reply(msg, header, update)

        def aggregate_(this, round, jobs):
            self.algo = this.algo
            mean, results = aggregate(this, round, jobs)
            self.means.append(mean)
            return mean, results

        monkeypatch.setattr(secure, "masked_reply", masked_reply)
        monkeypatch.setattr(secure.SecureAggregation, "aggregate", aggregate_)


@pytest.mark.parametrize("name", ["fedavg", "fedadam", "fedlc", "moon", "feddyn", "scaffold"])
def test_each_secure_mean_is_the_mean_of_the_updates_within_the_quantization_bound(tmp_path, name, monkeypatch):
    seen = Recorder(monkeypatch)
    summary, _ = _deploy(_cfg(name), tmp_path)
    assert summary["status"] == "completed" and len(seen.means) == 2
    # 3 clients of equal weight, max_weight 1: the bound is n (2c / R) / (n dq) = 2c / R
    bound = secure.error_bound(load(_cfg(name)).secure_aggregation, np.ones(3))
    assert bound == 2 * 1.0 / 2**22
    for r, mean in enumerate(seen.means):
        exact = np.mean(list(seen.updates[r].values()), axis=0)
        err = np.abs(mean - exact).max()
        assert 0 < err <= bound  # quantized: not the exact mean, and never further than the bound
        assert np.abs(exact).max() > 1000 * bound  # the bound is small beside what the round moves


def test_weighting_by_samples_is_the_weighted_mean_within_the_bound(tmp_path, monkeypatch):
    from fedweave.algorithms.base import RunContext

    sizes = np.array([len(p) for p in RunContext(load(_cfg())).partition])
    section = {**SECURE, "max_weight": float(sizes.max())}
    seen = Recorder(monkeypatch)
    summary, _ = _deploy(_cfg("fedavg", section, weighting="samples"), tmp_path)
    assert summary["status"] == "completed"
    cfg = load(_cfg("fedavg", section)).secure_aggregation
    for r, mean in enumerate(seen.means):
        clients = seen.algo.sample_clients(r)
        w = sizes[clients]
        updates = np.stack([seen.updates[r][int(c)] for c in clients])
        exact = (w[:, None] * updates).sum(0) / w.sum()
        largest = np.abs(updates).max()
        assert np.abs(mean - exact).max() <= secure.error_bound(cfg, w) + secure.weighted_error(cfg, w, largest)


def test_the_deployed_round_is_the_simulated_round_within_the_bound(tmp_path, monkeypatch):
    seen = Recorder(monkeypatch)
    cfg = {**_cfg("fedavg"), "rounds": 1}
    _deploy(cfg, tmp_path)
    sim = run(load(cfg), run_dir=tmp_path / "sim").algorithm
    diff = (seen.algo.x.double() - sim.x.double()).abs().max().item()
    bound = secure.error_bound(load(cfg).secure_aggregation, np.ones(3))
    assert diff <= bound + 1e-6  # + float32 rounding of the mean and the model (|x| < 10)
    assert not torch.equal(seen.algo.x, sim.x)  # quantized: SecAgg+ does not give the same bits


def test_the_server_never_holds_an_individual_update(tmp_path, monkeypatch):
    from flwr.common import bytes_to_ndarray
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

    seen = Recorder(monkeypatch)
    summary, grid = _deploy(_cfg("fedavg"), tmp_path)
    trained = [m for m in grid.seen if m.content.config_records.get(RECORD_KEY_CONFIGS, {}).get(Key.MASKED_PARAMETERS)]
    assert len(trained) == 2 * 3  # a masked vector from each client of each round
    for m in grid.seen:  # no reply carries a float array: the models and updates never leave a node in the clear
        for record in m.content.array_records.values():
            assert all(a.numpy().size == 0 or a.numpy().dtype.kind in "iu" for a in record.values())
    levels = 2**22
    for m in trained:
        masked = np.concatenate([bytes_to_ndarray(b).reshape(-1) for b in
                                 m.content.config_records[RECORD_KEY_CONFIGS][Key.MASKED_PARAMETERS]])  # fmt: skip
        # unmasked, the quantized update would sit near levels / 2 (updates << clipping_range); masked, it is
        # spread over Z_M (M = 2^32): the server cannot read it
        assert masked.max() > 2**30 and np.abs(masked[1:] - levels // 2).min() > 0
        assert np.mean(np.abs(masked[1:].astype(np.float64) - levels / 2) < levels) < 0.01
    assert summary["flower"]["messages"] > 0 and seen.means


@pytest.mark.parametrize(
    ("change", "app", "words"),
    [
        ({"privacy": {"noise_multiplier": 1.0, "amplification": "none"}}, "stop", "secure_aggregation with privacy"),
        ({"faults": {"dropout": 0.2}}, "stop", "secure_aggregation with faults"),
        (
            {"algorithm": {"name": "scaffold", "clients_per_round": 3}},
            "stop",
            "secure_aggregation: algorithm 'scaffold'",
        ),
        ({"algorithm": {"name": "hier_fedavg", "tau": 2}}, "stop", "secure_aggregation: algorithm 'hier_fedavg'"),
        ({"algorithm": {"name": "feddyn", "clients_per_round": 3}}, "stop", "secure_aggregation: algorithm 'feddyn'"),
    ],
)
def test_what_secure_aggregation_cannot_deploy_is_refused_with_one_line(change, app, words):
    from fedweave.deploy.support import check_deployable

    with pytest.raises(ConfigError) as e:
        check_deployable(load({**_cfg(), **change}), app)
    assert str(e.value).startswith(words) and "\n" not in str(e.value)


def test_an_update_that_quantization_would_clip_is_refused_on_its_node(tmp_path):
    cfg = _cfg("fedavg", {**SECURE, "clipping_range": 1e-6})
    with pytest.raises(server_app.RunFailed, match="secure_aggregation.clipping_range"):
        _deploy(cfg, tmp_path)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_an_update_that_is_not_finite_is_refused_on_its_node(bad):
    """Flower's quantization turns NaN into an arbitrary integer (int32's least) that the masks then carry into a
    finite, wrong sum: a diverged client would go unseen. Its node refuses the update with one line instead."""
    content = RecordDict()
    content.config_records[secure.WEIGHT] = ConfigRecord(
        {"client": 2, "weight": 1, "max_weight": 1.0, "clipping_range": 1.0, "quantization_range": 2**22}
    )
    msg = Message(content, dst_node_id=5, message_type="train")
    msg.metadata.__dict__["_message_id"] = msg.object_id
    with pytest.raises(ValueError, match=r"^secure_aggregation: client 2's update has a non-finite element") as e:
        secure.masked_reply(msg, {"steps": 1, "loss": 0.5}, torch.tensor([bad, 0.1, -0.1]))
    assert "\n" not in str(e.value)
    reply = secure.masked_reply(msg, {"steps": 1, "loss": 0.5}, torch.tensor([0.2, 0.1, -0.1]))
    assert not reply.has_error()


def test_a_weight_share_that_rounds_to_zero_is_refused_on_its_node():
    """Flower's mod multiplies the update by dq = round(weight / max_weight * R) / R: a share below half a level
    gives dq = 0, and the client's update would leave the mean in silence (all of them: a division by zero).
    Its node refuses it with one line instead."""
    content = RecordDict()
    content.config_records[secure.WEIGHT] = ConfigRecord(
        {"client": 2, "weight": 1, "max_weight": 1000.0, "clipping_range": 1.0, "quantization_range": 256}
    )
    msg = Message(content, dst_node_id=5, message_type="train")
    msg.metadata.__dict__["_message_id"] = msg.object_id
    assert round(1 / 1000 * 256) == 0
    with pytest.raises(ValueError, match=r"^secure_aggregation: client 2's weight share \(1 / 1000\)") as e:
        secure.masked_reply(msg, {"steps": 1, "loss": 0.5}, torch.tensor([0.2, 0.1, -0.1]))
    assert "\n" not in str(e.value)
    content.config_records[secure.WEIGHT]["weight"] = 2  # 2 / 1000 * 256 = 0.512: one level
    assert not secure.masked_reply(msg, {"steps": 1, "loss": 0.5}, torch.tensor([0.2])).has_error()


def test_a_round_whose_quantized_sum_would_wrap_around_the_modulus_is_refused(tmp_path, monkeypatch):
    """Each client's quantized values (the weight's factor among them) lie in [0, quantization_range] and SecAgg+
    sums them modulo modulus_range: with 3 clients at R = 2^31, M = 2^32 the sum can reach 3 R > M and wraps, so
    the unmasked mean would be wrong (measured: off by twice the updates' size, the run completed). The round is
    refused with one line instead; at 3 R < M it runs within the bound."""
    cfg = {**_cfg("fedavg", {**SECURE, "quantization_range": 2**31, "modulus_range": 2**32}), "rounds": 1}
    with pytest.raises(server_app.RunFailed, match="secure_aggregation.quantization_range") as e:
        _deploy(cfg, tmp_path)
    assert "\n" not in str(e.value)
    cfg = {**_cfg("fedavg", {**SECURE, "quantization_range": 2**30, "modulus_range": 2**32}), "rounds": 1}
    seen = Recorder(monkeypatch)
    summary, _ = _deploy(cfg, tmp_path / "fits")
    assert summary["status"] == "completed" and len(seen.means) == 1
    exact = np.mean(list(seen.updates[0].values()), axis=0)
    assert np.abs(seen.means[0] - exact).max() <= secure.error_bound(load(cfg).secure_aggregation, np.ones(3))


def _protocol_bytes(grid: Watching) -> dict[str, int]:
    """The bytes of SecAgg+'s records in the messages of a deployed run, by the ledger kind that bills them: byte
    strings by their length, ids and numbers 8 bytes, the masked arrays by their int64 values (the stage's name
    and the arrays' .npy headers are framing, not counted, as for every kind)."""
    from flwr.common import bytes_to_ndarray
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage

    def size(v) -> int:
        if isinstance(v, bytes):
            return len(v)
        if isinstance(v, list):
            return sum(size(x) for x in v)
        return 0 if isinstance(v, str) else 8

    out: dict[str, int] = {}
    for m in grid.pushed + grid.seen:
        rec = m.content.config_records.get(RECORD_KEY_CONFIGS)
        if rec is None or m.has_error():
            continue
        down = m in grid.pushed
        stage = rec.get(Key.STAGE)
        if down and stage == Stage.SETUP:
            kind, n = "server->client:secagg_setup", sum(size(v) for v in rec.values())
        elif down and stage == Stage.SHARE_KEYS:  # each neighbour: its id (the record's key) and its key pair
            kind, n = "server->client:secagg_key_broadcast", sum(8 + size(v) for k, v in rec.items() if k != Key.STAGE)
        elif down and stage == Stage.COLLECT_MASKED_VECTORS:
            kind, n = (
                "server->client:secagg_forwarded_shares",
                size(rec[Key.CIPHERTEXT_LIST]) + size(rec[Key.SOURCE_LIST]),
            )
        elif down:
            kind, n = (
                "server->client:secagg_unmask_request",
                size(rec[Key.ACTIVE_NODE_ID_LIST]) + size(rec[Key.DEAD_NODE_ID_LIST]),
            )
        elif Key.PUBLIC_KEY_1 in rec:
            kind, n = "client->server:secagg_public_keys", size(rec[Key.PUBLIC_KEY_1]) + size(rec[Key.PUBLIC_KEY_2])
        elif Key.CIPHERTEXT_LIST in rec:
            kind, n = (
                "client->server:secagg_encrypted_shares",
                size(rec[Key.DESTINATION_LIST]) + size(rec[Key.CIPHERTEXT_LIST]),
            )
        elif Key.MASKED_PARAMETERS in rec:
            arrays = [bytes_to_ndarray(b) for b in rec[Key.MASKED_PARAMETERS]]
            assert all(a.dtype == np.int64 for a in arrays)
            kind, n = "client->server:secagg_masked_input", sum(a.nbytes for a in arrays)
        else:
            kind, n = "client->server:secagg_unmask_shares", size(rec[Key.NODE_ID_LIST]) + size(rec[Key.SHARE_LIST])
        out[kind] = out.get(kind, 0) + n
    return out


@pytest.mark.parametrize(
    ("name", "down", "up"), [("fedavg", "model", "model"), ("scaffold", "model+control", "update+control_delta")]
)
def test_the_ledger_bills_what_the_deployed_protocol_sends(tmp_path, name, down, up):
    """The simulation's SecAgg+ cost (fedweave.privacy.secagg), which the deployed run's ledger records too, is
    what the deployed messages carry, stage by stage; the uploads are masked, never dense (SCAFFOLD's Delta y_i
    and Delta c_i as one masked vector of 2d + 1 values), and the downloads (the jobs' start vectors, and
    SCAFFOLD's c) are the ledger's bytes."""
    summary, grid = _deploy(_cfg(name), tmp_path)
    ledger = summary["communication"]["by_transfer"]
    sent = _protocol_bytes(grid)
    assert len(sent) == 8
    for kind, n in sent.items():
        assert ledger[kind]["bytes"] == n, kind
    assert f"client->server:{up}" not in ledger
    assert summary["flower"]["payload_sent"] == ledger[f"server->client:{down}"]["bytes"]
    assert summary["flower"]["payload_received"] == 0  # no reply carries fedweave's tensors: only masked values


@pytest.mark.parametrize("name", ["moon", "feddyn", "scaffold"])
def test_a_stateful_client_step_keeps_its_state_on_its_node_under_secagg(tmp_path, monkeypatch, name):
    """MOON's clients keep their previous model on their nodes, FedDyn's their grad L_i, SCAFFOLD's their c_i (and
    mask Delta y_i and Delta c_i as one vector): a client that trains again starts from the state version its node
    wrote when it last took part, and the run is the simulated one within the quantization (three rounds over five
    clients, so that clients come back)."""
    seen = Recorder(monkeypatch)
    sent = []
    encode = secure.encode_job

    def encode_job(call, k, **kw):
        sent.append((call.round, int(call.clients[k]), kw["state_round"]))
        return encode(call, k, **kw)

    monkeypatch.setattr(secure, "encode_job", encode_job)
    cfg = {**_cfg(name), "rounds": 3}
    summary, _ = _deploy(cfg, tmp_path)
    assert summary["status"] == "completed"
    last: dict[int, int] = {}
    for r, c, state_round in sent:
        assert state_round == last.get(c, -1)  # the round the client last trained in (-1: never)
        last[c] = r
    assert any(s >= 0 for _, _, s in sent)  # some client came back
    sim = run(load(cfg), run_dir=tmp_path / "sim").algorithm
    assert (seen.algo.x.double() - sim.x.double()).abs().max().item() <= 1e-4  # three rounds of quantized means


def test_a_client_step_whose_upload_is_not_what_it_declares_is_refused_on_its_node(tmp_path, monkeypatch):
    """The server splits SecAgg+'s mean of a step's upload by the names the step declares (``uploads``): a step
    that sends other names is refused on its node with one line, never split wrongly."""
    from fedweave.algorithms.centralized.scaffold import ScaffoldStep

    monkeypatch.setattr(ScaffoldStep, "uploads", ())
    with pytest.raises(server_app.RunFailed, match=r"client step ScaffoldStep uploads \[.dc., .dy.\], not what it"):
        _deploy(_cfg("scaffold"), tmp_path)


def test_a_stateful_client_step_under_sample_level_dp_is_refused_in_one_line(tmp_path):
    """A node runs DP-SGD around a rule it rebuilds, never around a client step (MOON's is refused in simulation
    too, for its contrastive term); the deployed run stops before its first round with one line."""
    cfg = {**_cfg("moon", None), "privacy": {"level": "sample", "noise_multiplier": 1.0, "amplification": "none"}}
    with pytest.raises(server_app.RunFailed, match=r"not started: privacy.level: sample: client step MoonStep") as e:
        _deploy(cfg, tmp_path)
    assert "\n" not in str(e.value)


def test_feddyn_under_a_sampler_that_draws_by_size_is_deployable_as_it_is_simulated():
    """Power-of-choice draws by size, so the run weighs its clients equally without ``weighting: uniform``: the
    check before any app reads the weighting the run will use, as the simulation does."""
    from fedweave.deploy.support import secure_refusal

    cfg = {**_cfg("feddyn"), "sampler": {"name": "power_of_choice", "d": 4}}
    del cfg["algorithm"]["weighting"]
    assert secure_refusal(load(cfg)) is None
    without = {**cfg, "sampler": {"name": "uniform"}}
    assert "algorithm.weighting: uniform" in secure_refusal(load(without))


class Silent(Watching):
    """The node that gets the first message of SecAgg+'s ``stage`` (by default the one that carries the jobs) in
    a round never answers it nor anything after it in that round (its ClientApp runs; the reply is lost)."""

    def __init__(self, *a, stage: str = "collect_masked_vectors", **kw) -> None:
        super().__init__(*a, **kw)
        self.stage, self.lost, self.gone = stage, None, False

    def push_messages(self, msgs):
        from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

        ids = super().push_messages(msgs)
        for msg, i in zip(msgs, ids):
            stage = msg.content.config_records.get(RECORD_KEY_CONFIGS, {}).get(Key.STAGE)
            if stage == "setup":  # a new round: the node answers again until it reaches the stage
                self.gone = False
            if stage == self.stage and (self.lost is None or msg.metadata.dst_node_id == self.lost):
                self.lost, self.gone = msg.metadata.dst_node_id, True
            if self.gone and msg.metadata.dst_node_id == self.lost:
                self.replies.pop(i)
        return ids


def test_a_node_lost_within_a_secure_round_stops_the_run_naming_its_client(tmp_path, monkeypatch):
    """SecAgg+ unmasks the sum of the clients that delivered when one is lost after sharing its keys; the mean is
    then over fewer clients than the round sampled, which the simulation never computes, and a secure round cannot
    be repeated. Under on-error stop the run stops with one line naming the lost client (before: a KeyError)."""
    cfg = {**_cfg("fedavg"), "rounds": 1}
    config_json = json.dumps(load(cfg).to_dict())
    seen = Recorder(monkeypatch)
    grid = Silent(config_json, tmp_path)
    run_config = {"fedweave-config": config_json, "run-dir": str(tmp_path / "deployed"), "reply-timeout": 1.0,
                  "node-wait": 5.0, "on-error": "stop"}  # fmt: skip
    with pytest.raises(server_app.RunFailed) as e:
        server_app.main(grid, Context(7, 0, {}, RecordDict(), run_config))
    client = grid.lost - 1  # the stand-in Grid's node of client c is c + 1
    assert client in seen.algo.sample_clients(0)
    line = str(e.value)
    assert line.startswith(f"fedweave run stopped: round 1: client {client}: its node sent no masked update")
    assert "(deployment on-error: stop)" in line and "\n" not in line
    summary = json.loads((tmp_path / "deployed" / "summary.json").read_text())
    assert summary["status"] != "completed" and f"client {client}" in summary["error"]
    assert len(seen.means) == 1  # SecAgg+ itself succeeded: the mean of the two others came back


def test_a_sampled_client_without_a_connected_node_stops_the_secure_round_before_it_starts(tmp_path):
    """As for plain jobs, the secure round first looks for nodes that joined since (a restarted node comes back
    under a new id) and then names a sampled client whose node is not connected, before SecAgg+'s first stage
    (before: the stages were sent to the node's old id, whose messages nobody pulls)."""
    cfg = _cfg("fedavg")
    config_json = json.dumps(load(cfg).to_dict())
    away = int(run(load(cfg), run_dir=tmp_path / "sim").algorithm.sample_clients(1)[0])
    grid = Watching(config_json, tmp_path)
    grid.offline, grid.offline_after = {away + 1}, 4 * 3  # its node leaves after round 1's four stages
    run_config = {"fedweave-config": config_json, "run-dir": str(tmp_path / "deployed"), "reply-timeout": 60.0,
                  "node-wait": 5.0, "on-error": "stop"}  # fmt: skip
    with pytest.raises(server_app.RunFailed) as e:
        server_app.main(grid, Context(7, 0, {}, RecordDict(), run_config))
    line = str(e.value)
    assert line.startswith(f"fedweave run stopped: round 2: client {away}: no SuperNode holding it is connected")
    assert "(deployment on-error: stop)" in line and "\n" not in line
    assert grid.jobs == 4 * 3  # nothing of round 2 was sent


def _deploy_on(grid: Watching, cfg: dict, tmp_path, on_error: str, reply_timeout: float = 60.0) -> dict:
    """Deploy ``cfg`` on ``grid`` under ``on_error``; summary.json."""
    run_config = {"fedweave-config": json.dumps(load(cfg).to_dict()), "run-dir": str(tmp_path / "deployed"),
                  "reply-timeout": reply_timeout, "node-wait": 5.0, "on-error": on_error}  # fmt: skip
    server_app.main(grid, Context(7, 0, {}, RecordDict(), run_config))
    return json.loads((tmp_path / "deployed" / "summary.json").read_text())


def _simulated_with_dropouts(cfg: dict, tmp_path, dropped: dict[str, list[int]]):
    """The simulation in which the clients of ``dropped`` (summary.json's: round as a string -> clients) deliver
    nothing in those rounds (1-based), as a dropout of ``faults`` does: its algorithm."""
    from fedweave.callbacks import Callback

    gone = {int(r) - 1: cs for r, cs in dropped.items()}

    class Drop(Callback):
        def on_build(self, state) -> None:
            reporting = state.algo.reporting
            state.algo.reporting = lambda r, c: (lambda kept: kept[~np.isin(kept, gone.get(r, []))])(reporting(r, c))

    return run(load(cfg), run_dir=tmp_path / "sim", callbacks=[Drop()]).algorithm


@pytest.mark.parametrize(
    ("name", "stage"),
    [("fedavg", "collect_masked_vectors"), ("scaffold", "collect_masked_vectors"), ("fedavg", "setup"),
     ("fedavg", "share_keys")],
)  # fmt: skip
def test_under_drop_a_node_lost_within_a_secure_round_is_a_dropout_of_the_sum_secagg_recovered(
    tmp_path, monkeypatch, name, stage
):
    """``on-error: drop``: SecAgg+ recovers from a node lost within the protocol and unmasks the others' sum (also
    for a node lost before it shared its keys, which Flower's unmask stage counted as dead: its survivors then
    failed on the key shares they never got); the round, computed again without the lost client as a dropout,
    takes that mean instead of a second secure sum (two sums over sets that differ by one client would reveal its
    update): one SecAgg+ round a round. The run equals the simulation in which the client drops out of those
    rounds within the quantization bound (SCAFFOLD's c too), and for a node lost after sharing its keys the ledger
    bills what the protocol sent, stage by stage (one lost before is billed its first stages, as a dropout in the
    simulation: they ran before anybody dropped)."""
    cfg = {**_cfg(name), "rounds": 3}
    seen = Recorder(monkeypatch)
    grid = Silent(json.dumps(load(cfg).to_dict()), tmp_path, stage=stage)
    summary = _deploy_on(grid, cfg, tmp_path, "drop", reply_timeout=1.0)
    assert summary["status"] == "completed"
    client = grid.lost - 1  # the stand-in Grid's node of client c is c + 1
    dropped = summary["flower"]["dropped"]
    assert dropped and all(cs == [client] for cs in dropped.values()) and "1" in dropped
    assert summary["flower"]["unsent"] == {}  # its node was reached: the jobs were sent
    assert len(seen.means) == 3  # one secure sum a round: the round again without the client took the recovered one
    sim = _simulated_with_dropouts(cfg, tmp_path, dropped)
    bound = 3 * secure.error_bound(load(cfg).secure_aggregation, np.ones(3)) + 1e-6  # 3 rounds, float32 (|x| < 10)
    assert (seen.algo.x.double() - sim.x.double()).abs().max().item() <= bound
    assert not torch.equal(seen.algo.x, sim.x)  # quantized
    if name == "scaffold":
        assert (seen.algo.c.double() - sim.c.double()).abs().max().item() <= bound
    ledger = summary["communication"]["by_transfer"]
    for kind, n in _protocol_bytes(grid).items():
        assert stage != "collect_masked_vectors" or ledger[kind]["bytes"] == n, kind
    assert ledger["client->server:secagg_masked_input"]["count"] == sum(
        len(seen.algo.sample_clients(r)) for r in range(3)
    ) - sum(map(len, dropped.values()))


def test_under_drop_a_sampled_client_without_a_connected_node_is_a_dropout_sent_nothing(tmp_path, monkeypatch):
    """``on-error: drop``: a sampled client whose node left is named before SecAgg+'s first stage and dropped; the
    round's protocol runs among the others, and the ledger bills that protocol, nothing to the client it never
    reached (its download neither); every other number is the simulation's in which it drops out."""
    cfg = {**_cfg("fedavg"), "rounds": 3}
    away = int(run(load(cfg), run_dir=tmp_path / "plain").algorithm.sample_clients(1)[0])
    seen = Recorder(monkeypatch)
    grid = Watching(json.dumps(load(cfg).to_dict()), tmp_path)
    grid.offline, grid.offline_after = {away + 1}, 4 * 3  # its node leaves after round 1's four stages
    summary = _deploy_on(grid, cfg, tmp_path, "drop")
    assert summary["status"] == "completed" and len(seen.means) == 3
    fl = summary["flower"]
    assert fl["dropped"] == fl["unsent"] and "2" in fl["dropped"]
    assert all(cs == [away] for cs in fl["dropped"].values())
    ledger = summary["communication"]["by_transfer"]
    for kind, n in _protocol_bytes(grid).items():
        assert ledger[kind]["bytes"] == n, kind
    assert fl["payload_sent"] == ledger["server->client:model"]["bytes"]  # the downloads that left
    sim = _simulated_with_dropouts(cfg, tmp_path, fl["dropped"])
    bound = 3 * secure.error_bound(load(cfg).secure_aggregation, np.ones(3)) + 1e-6
    assert (seen.algo.x.double() - sim.x.double()).abs().max().item() <= bound


class Restarts(Watching):
    """The node that gets the first message of round 2's collect stage (the one that carries the jobs) restarts
    then: its old self never answers again, and a new node (id ``100 + client``, the same partition-id and
    state-dir) joins, as a SIGKILLed SuperNode started again does."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.collects, self.lost = 0, None

    def push_messages(self, msgs):
        from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

        ids = super().push_messages(msgs)
        stages = {m.content.config_records.get(RECORD_KEY_CONFIGS, {}).get(Key.STAGE) for m in msgs}
        if "collect_masked_vectors" in stages:
            self.collects += 1
            if self.collects == 2 and self.lost is None:
                self.lost = msgs[0].metadata.dst_node_id
                old = self.contexts[self.lost]
                self.contexts[100 + self.lost] = Context(7, 100 + self.lost, old.node_config, RecordDict(),
                                                         old.run_config)  # fmt: skip
        for msg, i in zip(msgs, ids):
            if self.lost is not None and msg.metadata.dst_node_id == self.lost:
                self.replies.pop(i)
        return ids


def test_a_secure_stage_stops_waiting_for_a_node_that_restarted(tmp_path, monkeypatch):
    """A node SIGKILLed within round 2's protocol and started again joins under a new id; its old self never
    answers. As for plain jobs, the stage stops waiting for it once the new node said which client it holds,
    not after reply-timeout (before: the stage waited the whole reply-timeout, during which a fast run's later
    rounds could start before the new node was known). The client is a dropout of round 2 only: from round 3
    its new node takes part, and the run equals the simulation with that dropout within the quantization bound."""
    cfg = {**_cfg("fedavg"), "rounds": 3}
    seen = Recorder(monkeypatch)
    grid = Restarts(json.dumps(load(cfg).to_dict()), tmp_path)
    started = time.monotonic()
    summary = _deploy_on(grid, cfg, tmp_path, "drop", reply_timeout=600.0)
    assert time.monotonic() - started < 120  # well before the 600 s reply-timeout
    client = grid.lost - 1  # the stand-in Grid's node of client c is c + 1
    assert summary["status"] == "completed" and summary["flower"]["dropped"] == {"2": [client]}
    assert len(seen.means) == 3
    sim = _simulated_with_dropouts(cfg, tmp_path, summary["flower"]["dropped"])
    bound = 3 * secure.error_bound(load(cfg).secure_aggregation, np.ones(3)) + 1e-6
    assert (seen.algo.x.double() - sim.x.double()).abs().max().item() <= bound


def test_a_protocol_that_halts_after_a_node_was_lost_is_run_again_without_it_under_drop(tmp_path, monkeypatch):
    """With ``reconstruction_threshold: 1.0`` every neighbour must answer: a node lost at the collect stage halts
    the protocol, and the server learned no sum. Under stop the run stops naming the client; under drop the client
    is a dropout and the round's protocol runs again among the others (the one sum the round gives: the halted
    attempt gave none), equal to the simulation in which it drops out within the quantization bound."""
    section = {**SECURE, "reconstruction_threshold": 1.0}
    cfg = {**_cfg("fedavg", section), "rounds": 2}
    with pytest.raises(server_app.RunFailed) as e:
        _deploy_on(Silent(json.dumps(load(cfg).to_dict()), tmp_path / "stop"), cfg, tmp_path / "stop", "stop", 1.0)
    assert "its node did not answer SecAgg+ within reply-timeout, and the protocol halted" in str(e.value)
    assert "(deployment on-error: stop)" in str(e.value) and "\n" not in str(e.value)
    seen = Recorder(monkeypatch)
    grid = Silent(json.dumps(load(cfg).to_dict()), tmp_path)
    summary = _deploy_on(grid, cfg, tmp_path, "drop", reply_timeout=1.0)
    assert summary["status"] == "completed" and len(seen.means) == 2  # the halted attempts returned no mean
    dropped = summary["flower"]["dropped"]
    assert "1" in dropped and all(cs == [grid.lost - 1] for cs in dropped.values())
    sim = _simulated_with_dropouts(cfg, tmp_path, dropped)
    bound = 2 * secure.error_bound(load(cfg).secure_aggregation, np.ones(3)) + 1e-6
    assert (seen.algo.x.double() - sim.x.double()).abs().max().item() <= bound
