"""Jobs as data for the Flower deployment: every deployable rule survives the trip, unknown rules and
malformed jobs are refused, the app project is valid for Flower, and a plain import stays free of flwr."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib

import pytest
import torch

from fedweave.algorithms.centralized.fedcm import FedCMRule
from fedweave.algorithms.centralized.feddyn import FedDynRule
from fedweave.algorithms.centralized.fedmim import MIMRule
from fedweave.algorithms.centralized.fedprox import ProxRule
from fedweave.algorithms.centralized.fedsam import SAMRule
from fedweave.algorithms.centralized.scaffold import ScaffoldRule
from fedweave.config import LocalConfig, load
from fedweave.deploy.jobs import MalformedJobError, UnknownRuleError, decode_job, encode_header, encode_job
from fedweave.execution.local import PLAIN, LocalRule, reindexed

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
}


def trip(rule: LocalRule, k: int, jobs: int = K):
    header, tensors = encode_job(start=VEC, client=7, round=2, rule=rule, k=k, jobs=jobs, lr=0.05, steps=3,
                                 key=(1,), local=LocalConfig(steps=3))  # fmt: skip
    return decode_job(encode_header(header), tensors)


def quadratic_grad(w: torch.Tensor) -> torch.Tensor:
    return 2 * w + 1


@pytest.mark.parametrize("name", RULES)
def test_rule_rebuilt_on_the_node_gives_the_same_direction_for_its_job(name):
    rule = RULES[name]
    w = torch.randn(P, generator=g)
    for k in range(K):
        job = trip(rule, k)
        assert type(job.rule) is type(rule)
        # the node runs its one job as job 0 of its call
        torch.testing.assert_close(job.rule.direction(w, quadratic_grad, 0), rule.direction(w, quadratic_grad, k))
        torch.testing.assert_close(job.rule.project(w, 0), rule.project(w, k))
    assert (job.client, job.round, job.steps, job.key, job.lr) == (7, 2, 3, (1,), 0.05)


def test_a_reindexed_rule_sends_the_row_of_the_original_job():
    rule = reindexed(RULES["scaffold"], [2, 0])
    w = torch.randn(P, generator=g)
    job = trip(rule, 0, jobs=2)
    torch.testing.assert_close(
        job.rule.direction(w, quadratic_grad, 0), RULES["scaffold"].direction(w, quadratic_grad, 2)
    )


def test_unknown_rule_is_refused_with_the_known_names():
    class Homemade(LocalRule):
        def direction(self, w, grad, jobs):
            return -grad(w)

    with pytest.raises(UnknownRuleError, match="Homemade is not registered"):
        trip(Homemade(), 0)
    header, tensors = encode_job(start=VEC, client=0, round=0, rule=PLAIN, k=0, jobs=1, lr=0.1, steps=1, key=(),
                                 local=LocalConfig(steps=1))  # fmt: skip
    header["rule"] = "os.system"
    with pytest.raises(UnknownRuleError, match="unknown local rule 'os.system'; this node knows: plain, scaffold"):
        decode_job(encode_header(header), tensors)


def test_malformed_jobs_are_refused():
    header, tensors = encode_job(start=VEC, client=0, round=0, rule=PLAIN, k=0, jobs=1, lr=0.1, steps=1, key=(),
                                 local=LocalConfig(steps=1))  # fmt: skip
    with pytest.raises(MalformedJobError, match="JSONDecodeError"):
        decode_job("{not json", tensors)
    with pytest.raises(MalformedJobError, match="KeyError: 'start'"):
        decode_job(encode_header(header), {})
    bad = {**header, "local": {"no_such_key": 1}}
    with pytest.raises(MalformedJobError, match="no_such_key"):
        decode_job(json.dumps(bad), tensors)


def test_a_learning_rate_schedule_cannot_travel():
    with pytest.raises(ValueError, match="constant local learning rate"):
        encode_job(start=VEC, client=0, round=0, rule=PLAIN, k=0, jobs=1, lr=lambda t: 0.1, steps=1, key=(),
                   local=LocalConfig(steps=1))  # fmt: skip


def test_flower_app_project_is_valid_and_carries_the_config(tmp_path, toy_config):
    flwr_config = pytest.importorskip("flwr.common.config")
    cfg = load(toy_config)
    from fedweave.cli import main

    assert (
        main(["flower-app", "--run-dir", str(tmp_path / "out"), _write(tmp_path, toy_config), str(tmp_path / "app")])
        == 0
    )
    data = tomllib.loads((tmp_path / "app" / "pyproject.toml").read_text())
    ok, errors, _ = flwr_config.validate_config(data, check_module=False)
    assert ok, errors
    app = data["tool"]["flwr"]["app"]
    assert load(json.loads(app["config"]["fedweave-config"])).to_dict() == cfg.to_dict()
    assert app["config"]["run-dir"] == str(tmp_path / "out")


def _write(tmp_path, config: dict) -> str:
    import yaml

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_importing_fedweave_and_its_deploy_package_does_not_import_flwr():
    code = "import sys, fedweave, fedweave.deploy, fedweave.deploy.jobs, fedweave.cli; print('flwr' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
