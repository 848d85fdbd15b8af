"""Where a cross-device round's time goes: the peers benchmark's logistic or MLP round (1,000 clients
Dirichlet(0.3), 50 per round, batch 10, one local epoch, the 10k test images evaluated every round), split by
wrapping the engine's functions with timers (issue 31, target 1).

Per round, in CPU seconds of this thread (``time.thread_time``: on a shared machine a part's CPU time moves
far less with the load than its wall time), averaged over ``--rounds`` rounds after a warm-up round:
  sampling                 the sampler (``sample_clients``)
  plan                     each job's batch indices (``client_batches`` / ``flat_batches``) and their streams'
                           seeds (``Seeds.torch`` / ``Seeds.torches``)
  local steps              the fused kernel's steps (``FusedSGD.step``), and ``FusedSGD.run`` around them
                           (with the per-job gather where ``run`` gathers, the loss sums)
  rest of local training   ``train_clients`` less the above: the gathers of many jobs, the copies of each
                           job's start and result, the call's bookkeeping
  client updates, aggregation, server update
  rest of the round        ``run_round`` less ``train_clients`` and the three above: the ledger records, the
                           metrics of the round
  evaluation               ``evaluate`` (global model on the test set)
The wrappers add about 1 us per call. The script imports ``fedweave`` from the path, so the same file splits
another checkout's round: ``PYTHONPATH=<checkout>/src python benchmarks/round_split.py``.

Usage: python benchmarks/round_split.py [--workload logistic mlp] [--rounds 40] [--threads 1]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ``benchmarks`` importable when run as a script
from benchmarks.peers import fedweave_config  # noqa: E402


def split(workload: str, rounds: int, threads: int) -> str:
    """The printed split of ``rounds`` rounds of ``workload``."""
    import fedweave.execution.fused as fused
    import fedweave.execution.local as local
    import fedweave.seeding as seeding
    from fedweave.algorithms.base import RunContext, build_algorithm
    from fedweave.algorithms.centralized.base import StarAlgorithm
    from fedweave.config import load

    torch.set_num_threads(threads)
    algo = build_algorithm(RunContext(load(fedweave_config(workload, rounds + 1, "auto", threads))))
    spent: dict[str, float] = {}

    def timed(owner, name: str, label: str) -> None:
        f = getattr(owner, name, None)
        if f is None:  # a function this checkout does not have
            return

        @functools.wraps(f)
        def wrapper(*a, **k):
            t = time.thread_time()
            try:
                return f(*a, **k)
            finally:
                spent[label] = spent.get(label, 0.0) + time.thread_time() - t

        setattr(owner, name, wrapper)

    for owner, name, label in [
        (StarAlgorithm, "sample_clients", "sampling"),
        (StarAlgorithm, "train_clients", "local training"),
        (local.LocalTrainer, "client_batches", "plan"),
        (local.LocalTrainer, "flat_batches", "plan"),
        (seeding.Seeds, "torch", "plan: seeds"),
        (seeding.Seeds, "torches", "plan: seeds"),
        (fused.FusedSGD, "run", "FusedSGD.run"),
        (fused.FusedSGD, "step", "local steps"),
        (StarAlgorithm, "client_updates", "client updates"),
        (StarAlgorithm, "aggregate", "aggregation"),
        (type(algo), "server_update", "server update"),
    ]:
        timed(owner, name, label)
    algo.run_round(0)
    algo.evaluate(0)
    spent.clear()
    total = {"round": 0.0, "evaluation": 0.0}
    for r in range(1, rounds + 1):
        t0 = time.thread_time()
        algo.run_round(r)
        t1 = time.thread_time()
        algo.evaluate(r)
        total["round"] += t1 - t0
        total["evaluation"] += time.thread_time() - t1
    ms = {k: v / rounds * 1e3 for k, v in {**spent, **total}.items()}

    def get(key: str) -> float:
        return ms.get(key, 0.0)

    # the batch plans run inside train_clients (seeds inside the plan, steps inside FusedSGD.run on the loop)
    parts = {
        "sampling": get("sampling"),
        "plan (batch indices, seeds included)": get("plan"),
        "  of which the streams' seeds": get("plan: seeds"),
        "local steps (FusedSGD.step)": get("local steps"),
        "FusedSGD.run around the steps": get("FusedSGD.run") - get("local steps"),
        "rest of local training (gathers, copies)": get("local training") - get("plan") - get("FusedSGD.run"),
        "client updates": get("client updates"),
        "aggregation": get("aggregation"),
        "server update": get("server update"),
    }
    parts["rest of the round (ledger, metrics)"] = (
        get("round")
        - sum(v for k, v in parts.items() if k in ("sampling", "client updates", "aggregation", "server update"))
        - get("local training")
    )
    parts["evaluation"] = get("evaluation")
    out = [f"[{workload}] backend {algo.trainer.backend}, {threads} thread(s), CPU ms per round over {rounds} rounds"]
    out += [f"  {k:44s} {v:7.3f}" for k, v in parts.items()]
    out.append(f"  {'round + evaluation':44s} {get('round') + get('evaluation'):7.3f}")
    out.append(f"load average after: {os.getloadavg()[0]:.1f}")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", nargs="+", choices=["logistic", "mlp"], default=["logistic", "mlp"])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    if a.rounds < 1 or a.threads < 1:
        p.error("--rounds and --threads must be at least 1")
    for w in a.workload:
        print(split(w, a.rounds, a.threads), flush=True)


if __name__ == "__main__":
    main()
