"""Accounting benchmark: the epsilon that sample-level DP asks for every round, fedweave's ``Accountant`` against
Opacus's ``RDPAccountant`` called directly, side by side in one process (docs/privacy.md, "What accounting costs").

Sample-level DP (``privacy.level: sample``) reports the largest epsilon over the clients, each client's
``(noise multiplier, q_i = B / n_i, steps_i)`` a history of its own; the clients whose (q_i, steps_i) no other
client dominates are asked every round (twice: the budget's look-ahead and the round's metrics row). The workload
here: ``--clients`` rates spread as a Dirichlet partition's sizes spread (q from B / 400 to B / 20 at B = 16),
``--rounds`` rounds in which every client has done one more epoch (steps_i = round * n_i / B), every client asked
every round. Printed: seconds for the whole workload by each, their ratio, and whether every epsilon is equal
(fedweave computes each rate's one-release RDP once and scales it by the steps, Opacus's own ``compute_rdp``
arithmetic, so they must be equal bit for bit).

Usage: python benchmarks/accounting.py [--clients 30] [--rounds 10]
"""

from __future__ import annotations

import argparse
import time
import warnings

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    for flag in ("clients", "rounds"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")

    from opacus.accountants import RDPAccountant

    from fedweave.privacy import Accountant

    z, batch, delta = 1.0, 16, 1e-5
    sizes = np.linspace(20, 400, args.clients).round().astype(int)
    asks = [(z, batch / n, r * int(np.ceil(n / batch))) for r in range(1, args.rounds + 1) for n in sizes]

    def opacus(q_z_steps):
        acc = RDPAccountant()
        acc.history = [q_z_steps]
        return acc.get_epsilon(delta=delta)

    ours = Accountant("rdp", delta)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = time.perf_counter()
        want = [opacus(a) for a in asks]
        t_opacus = time.perf_counter() - t
        t = time.perf_counter()
        got = [ours.epsilon([a]) for a in asks]
        t_ours = time.perf_counter() - t
    print(f"{len(asks)} epsilons ({args.clients} client rates x {args.rounds} rounds), RDP accountant, delta {delta:g}")
    print(f"  Opacus RDPAccountant called directly: {t_opacus:8.3f} s")
    print(f"  fedweave Accountant:                  {t_ours:8.3f} s   ({t_opacus / t_ours:.1f}x faster)")
    print(f"  every epsilon equal bit for bit: {got == want}")


if __name__ == "__main__":
    main()
