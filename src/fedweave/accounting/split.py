"""Closed-form communication and storage of the federated split learning methods (cse-fsl spec §7).

These are the formulas behind the paper's Table II and Table V, written per round from the exact batch
plan, so that the ledger of a run can be checked against them byte for byte. Conventions (spec A6–A8):
float32 everywhere (4 bytes), labels counted separately and excluded from Table V's "Load", "GB" in
Table V is GiB (2³⁰ bytes), storage is in parameters and counts everything the server holds at
aggregation time (server-side model copies plus the received client-side models and auxiliary nets).

The 4 bytes are the paper's convention, not a run's: a run's ledger bills the width it sends (the run's float
width for the models, the tensors' element size for smashed data and gradients), so these forms equal the
ledger of a float32 run, and a float64 run bills twice their value bytes with the same label bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

METHODS = ("fsl_mc", "fsl_oc", "fsl_an", "cse_fsl")
FLOAT_BYTES = 4
LABEL_BYTES = 8  # int64 labels, as sent; not part of the paper's load
GIB = 2**30


@dataclass(frozen=True)
class SplitSizes:
    """Parameter counts of the three parts and the smashed floats per sample (the spec's P_c, P_s, P_a, q_f)."""

    client: int
    server: int
    aux: int
    smashed: int

    @property
    def whole(self) -> int:
        """|w| = P_c + P_s."""
        return self.client + self.server


# The paper's models (spec §4.2–4.3), checked against the built modules in the tests.
CIFAR = SplitSizes(client=107_328, server=960_970, aux=23_050, smashed=2304)
FEMNIST = SplitSizes(client=18_816, server=1_187_774, aux=571_454, smashed=9216)


def _check(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown split method {method!r}; allowed: {', '.join(METHODS)}")


def uses_aux(method: str) -> bool:
    _check(method)
    return method in ("fsl_an", "cse_fsl")


def upload_batches(num_batches: int, h: int, upload_at: str = "end", epoch: int | None = None) -> list[int]:
    """Indices m of the local batches whose smashed data is uploaded (spec A4, §2.6 item 2).

    ``end``: the last batch of each full h-window, (m+1) mod h == 0, ⌊M/h⌋ uploads (the authors' code);
    ``start``: m mod h == 0 as Alg. 1 is written, ⌈M/h⌉ uploads.
    ``epoch``: the batches of one local epoch, M_i. The windows restart at each epoch's first batch, so an epoch
    uploads ⌊M_i/h⌋ (``start``: ⌈M_i/h⌉) batches and its trailing M_i mod h batches are trained, not uploaded
    (Alg. 1 counts m from 0 over one pass of D_i, line 3; spec §2.5, A27, §7.1's U_i per epoch). None: one run of
    windows over all ``num_batches`` (a round of ``local.steps`` steps, which has no epochs).
    """
    if h < 1:
        raise ValueError(f"h must be >= 1, got {h}")
    if upload_at not in ("end", "start"):
        raise ValueError(f"upload_at must be 'end' or 'start', got {upload_at!r}")
    if epoch is not None and epoch < 1:
        raise ValueError(f"epoch must be >= 1 or None, got {epoch}")
    span = epoch or max(num_batches, 1)
    if upload_at == "end":
        return [m for m in range(num_batches) if (m % span + 1) % h == 0]
    return [m for m in range(num_batches) if m % span % h == 0]


def batch_sizes(samples: int, batch_size: int, epochs: int = 1) -> list[int]:
    """Sizes of one client's local batches over ``epochs`` epochs (the last batch of an epoch may be short)."""
    for name, value, least in (("samples", samples, 0), ("batch_size", batch_size, 1), ("epochs", epochs, 1)):
        if value < least:
            raise ValueError(f"{name} must be >= {least}, got {value}")
    full, rest = divmod(samples, batch_size)
    one = [batch_size] * full + ([rest] if rest else [])
    return one * epochs


def server_copies(method: str, n: int) -> int:
    """Server-side model instances: one per client for FSL_MC and FSL_AN, one for FSL_OC and CSE-FSL."""
    _check(method)
    return n if method in ("fsl_mc", "fsl_an") else 1


def uploaded_samples(method: str, samples: Sequence[int], batch_size: int, h: int = 1, upload_at: str = "end",
                     epochs: int = 1) -> int:  # fmt: skip
    """Samples whose smashed data go up in one round: all of them, or one batch per h for CSE-FSL."""
    _check(method)
    total = 0
    for s in samples:
        sizes = batch_sizes(s, batch_size, epochs)
        if method == "cse_fsl":
            total += sum(sizes[m] for m in upload_batches(len(sizes), h, upload_at, len(sizes) // epochs or None))
        else:
            total += sum(sizes)
    return total


def server_steps(method: str, samples: Sequence[int], batch_size: int, h: int = 1, upload_at: str = "end",
                 epochs: int = 1) -> int:  # fmt: skip
    """Server SGD steps in one round: one per received smashed batch (eq. 11 for CSE-FSL)."""
    _check(method)
    total = 0
    for s in samples:
        m = len(batch_sizes(s, batch_size, epochs))
        total += len(upload_batches(m, h, upload_at, m // epochs or None)) if method == "cse_fsl" else m
    return total


def round_bytes(method: str, sizes: SplitSizes, samples: Sequence[int], batch_size: int, h: int = 1,
                upload_at: str = "end", epochs: int = 1, agg_every: int | None = None) -> dict[str, int]:  # fmt: skip
    """Bytes of one round by message kind (spec §7.2); ``samples`` = |D_i| of each participating client.

    ``agg_every`` = c (CSE-FSL): the models go down and up every c local batches, ⌈M_i / c⌉ times for client i
    (at least once: every client downloads at the round's start and is averaged after its first segment).
    """
    if agg_every is not None and agg_every < 1:
        raise ValueError(f"agg_every must be >= 1 or None, got {agg_every}")
    n = len(samples)
    up = uploaded_samples(method, samples, batch_size, h, upload_at, epochs)
    batches = [len(batch_sizes(s, batch_size, epochs)) for s in samples]
    syncs = sum(max(math.ceil(m / agg_every), 1) for m in batches) if agg_every else n  # models' trips, all clients
    out = {
        "smashed": up * sizes.smashed * FLOAT_BYTES,
        "labels": up * LABEL_BYTES,
        "gradient": up * sizes.smashed * FLOAT_BYTES if method in ("fsl_mc", "fsl_oc") else 0,
        "client_model": 2 * sizes.client * FLOAT_BYTES * syncs,  # down at the start, up for aggregation
        "aux_model": 2 * sizes.aux * FLOAT_BYTES * syncs if uses_aux(method) else 0,
    }
    out["load"] = out["smashed"] + out["gradient"] + out["client_model"] + out["aux_model"]  # Table V
    return out


def load_gib(method: str, sizes: SplitSizes, samples: Sequence[int], batch_size: int, rounds: int, h: int = 1,
             upload_at: str = "end") -> float:  # fmt: skip
    """Table V "Load (GB)": total traffic over ``rounds`` rounds in GiB, labels excluded."""
    return round_bytes(method, sizes, samples, batch_size, h, upload_at)["load"] * rounds / GIB


def storage_params(method: str, sizes: SplitSizes, n: int, *, streaming: bool = False) -> int:
    """Server storage in parameters (spec §7.3).

    Buffered (Table V): server-side copies plus the n received client-side models (and auxiliary nets).
    Streaming (Table II style, spec A7): the aggregation keeps one running sum instead of n models (none for
    n = 0, where nothing is summed: never more than the buffered figure).
    """
    copies = server_copies(method, n)
    per_client = sizes.client + (sizes.aux if uses_aux(method) else 0)
    return copies * sizes.server + (min(n, 1) if streaming else n) * per_client


# The paper's Table V (accuracy IID, accuracy non-IID, load GiB, storage M params); CSE rows keyed by h.
PAPER_TABLE_V: dict[str, dict[str, tuple[float, float, float, float]]] = {
    "cifar10": {
        "fsl_mc": (80.55, 61.17, 172.46, 5.34),
        "fsl_oc": (73.74, 50.14, 172.46, 1.50),
        "fsl_an": (77.75, 54.67, 86.80, 5.46),
        "cse_fsl h=5": (76.52, 42.33, 18.14, 1.61),
        "cse_fsl h=10": (75.75, 40.24, 9.55, 1.61),
        "cse_fsl h=25": (73.57, 37.94, 4.40, 1.61),
        "cse_fsl h=50": (73.29, 34.97, 2.69, 1.61),
    },
    "femnist": {
        "fsl_mc": (74.52, 72.58, 36.23, 6.03),
        "fsl_oc": (70.80, 70.05, 36.23, 1.28),
        "fsl_an": (75.05, 73.26, 28.16, 8.89),
        "cse_fsl h=2": (72.01, 70.63, 19.58, 4.14),
        "cse_fsl h=4": (70.27, 68.77, 15.29, 4.14),
        "cse_fsl h=5": (69.64, 67.91, 14.43, 4.14),
    },
}

# The paper's configurations behind Table V (spec §6.2): clients, samples per client per round, B, rounds.
PAPER_SETUPS = {
    "cifar10": {"sizes": CIFAR, "clients": 5, "samples": 10_000, "batch_size": 50, "rounds": 200},
    "femnist": {"sizes": FEMNIST, "clients": 5, "samples": 200, "batch_size": 10, "rounds": 500},
}


def table_v_row(dataset: str, key: str) -> tuple[float, float]:
    """(load GiB, storage M params) of a Table V row computed from the paper's configuration."""
    setup = PAPER_SETUPS[dataset]
    method, _, hs = key.partition(" h=")
    h = int(hs) if hs else 1
    samples = [setup["samples"]] * setup["clients"]
    load = load_gib(method, setup["sizes"], samples, setup["batch_size"], setup["rounds"], h)
    storage = storage_params(method, setup["sizes"], setup["clients"]) / 1e6
    return load, storage


def rounds_to(accuracies: Sequence[float], target: float) -> int | None:
    """Index of the first value >= target (for "bytes to reach X %" comparisons), or None."""
    for i, a in enumerate(accuracies):
        if a is not None and not math.isnan(a) and a >= target:
            return i
    return None
