"""The round templates of the family bases: a method file holds its paper (hyper-parameters, client rule,
server update) and nothing of the round's skeleton; the server step reduces the client updates in one
overridable place, ``aggregate``, that every method goes through."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from fedweave.algorithms.base import RunContext, build_algorithm
from fedweave.config import load

ALGORITHMS = Path(__file__).parents[1] / "src" / "fedweave" / "algorithms"
STAR = ["fedavg", "fedprox", "scaffold", "feddyn", "fedadam", "fedcm", "mofedsam", "fedmim", "fedsam"]

# what the family bases own: sampling, the round's messages, injected faults, simulated time
SKELETON = {
    "centralized": r"def run_round|sample_clients|reporting\(|\bfault_metrics|self\.send\(|self\.receive\(|"
    r"ledger\.record|self\.faults|faulty",
    "hierarchical": r"sample_clients|reporting\(|\bfault_metrics|self\.send\(|self\.receive\(|ledger\.record|"
    r"self\.faults",
    "split": r"reporting\(|\bfault_metrics|self\.faults|arrival_times|in_flight|batch_time|upload_times|"
    r"ledger\.record|deadline",
}


# ZO-HFL's round does not average client models (its server steps on its own data and a zeroth-order
# estimate): it reaches its clients through the base's call_clients and names its own upload (spec A24)
OWN_ROUND = {"zo_hfl.py": {"self.receive("}}


def _method_files(family: str) -> list[Path]:
    # a protocol base (base.py; the asynchronous star's async_base.py) owns a round skeleton by design
    return sorted(
        p for p in (ALGORITHMS / family).glob("*.py") if not p.name.endswith("base.py") and p.name != "__init__.py"
    )


@pytest.mark.parametrize("family", sorted(SKELETON))
def test_method_files_hold_no_round_skeleton(family):
    files = _method_files(family)
    assert files
    for path in files:
        code = "\n".join(line.split("#")[0] for line in path.read_text().splitlines())  # comments aside
        code = re.sub(r'"""[\s\S]*?"""', "", code)  # docstrings aside: they may cite the mechanics
        code = re.sub(r'"[^"\n]*"', '""', code)  # and strings: an error may name a fault key it refuses
        found = sorted(set(re.findall(SKELETON[family], code)) - OWN_ROUND.get(path.name, set()))
        assert not found, f"{path.name} carries round mechanics of its family base: {found}"


def _star(name: str, **faults) -> object:
    cfg = {
        "name": "t",
        "seed": 2,
        "rounds": 3,
        "backend": "loop",
        "dataset": {"name": "_toy"},
        "partition": {"name": "iid", "num_clients": 6},
        "model": {"name": "logistic"},
        "algorithm": {"name": name, "clients_per_round": 3},
        "local": {"steps": 2, "batch_size": 16, "lr": 0.1},
        "output": {"progress": False, "plots": False},
        "faults": faults,
    }
    return build_algorithm(RunContext(load(cfg)))


@pytest.mark.parametrize("name", STAR)
def test_every_star_method_reduces_its_client_updates_in_aggregate(name):
    algo = _star(name, dropout=0.4)
    calls = []
    mean = type(algo).aggregate

    def recorded(updates, weights, clients=None):
        calls.append((updates.shape, float(weights.sum())))
        assert clients is not None and len(clients) == len(updates)  # the template names the updates' clients
        return mean(algo, updates, weights, clients)

    algo.aggregate = recorded
    reported = [algo.run_round(r)["reported_clients"] for r in range(3)]
    # once per round in which a client reported, over exactly those clients' updates
    assert [int(n) for n in reported if n] == [shape[0] for shape, _ in calls]
    assert all(shape[1] == algo.num_params and total == pytest.approx(1.0) for shape, total in calls)


@pytest.mark.parametrize("name", ["fedavg", "fedprox", "fedsam", "scaffold"])
def test_a_replaced_aggregate_decides_the_server_step(name):
    """The seam is where the update is decided: an aggregate of zero leaves the model where it was."""
    algo = _star(name)
    algo.aggregate = lambda updates, weights, clients=None: torch.zeros_like(updates[0])
    x0 = algo.x.clone()
    algo.run_round(0)
    assert torch.equal(algo.x, x0)


def test_hierarchical_baselines_reduce_in_aggregate():
    cfg = {
        "name": "h",
        "seed": 1,
        "rounds": 2,
        "dataset": {"name": "_toy"},
        "partition": {"name": "iid", "num_clients": 6},
        "model": {"name": "logistic"},
        "algorithm": {"name": "hier_fedavg", "tau": 2, "participation": 0.5},
        "local": {"batch_size": 16, "lr": 0.05},
        "output": {"progress": False, "plots": False},
    }
    algo = build_algorithm(RunContext(load(cfg)))
    x0 = algo.x.clone()
    algo.aggregate = lambda updates, weights: x0  # hier_fedavg's update is the mean model
    algo.run_round(0)
    assert torch.equal(algo.x, x0)
