"""What secure aggregation costs: the SecAgg+ protocol's messages of every round, billed in the ledger.

SecAgg+ (Bell, Bonawitz, Gascon, Lepoint, Raykova, CCS 2020) lets the server learn only the sum of the clients'
inputs: each client masks its input with one pairwise mask per neighbour of a random k-regular graph (masks that
cancel in the sum) and one self mask, and secret-shares (Shamir, threshold t) its mask seed and its masking key
among its neighbours, so that the masks of clients that drop out can still be removed. The messages and their
sizes follow Flower's ``SecAggPlusWorkflow`` and ``secaggplus_mod``, stage by stage (n: the round's sampled
clients, k: the size of a client's neighbourhood, itself included; A: the clients that deliver their input):

==========  =====================  ==================================================================
stage       direction              each message
==========  =====================  ==================================================================
0 setup     server -> n clients    the configuration: 7 numbers (n, shares, t, ranges, max weight)
0           n clients -> server    two public keys (P-384, PEM): ``2 * 215`` bytes
1 keys      server -> n clients    its k neighbours' ids and public key pairs: ``k * (8 + 2 * 215)``
1           n clients -> server    one encrypted share pair per other neighbour: ``(k - 1) * (8 + 612)``
2 masked    server -> n clients    the shares addressed to it, with their sources: ``(k - 1) * (612 + 8)``
2           A -> server            the masked input in Z_R: ``8 (d + 1)`` (the weight + d values, int64 each)
3 unmask    server -> A            its neighbours split into delivered and dropped: ``k * 8``
3           A -> server            one share per neighbour, with its id: ``k * 8`` plus 52 per delivered
                                   neighbour (its mask seed's share) and 324 per dropped one (its key's share)
==========  =====================  ==================================================================

The sizes of Flower's byte strings are fixed by its formats: a P-384 public key in PEM is 215 bytes; a Shamir
share is a 4-byte index and 16 bytes per 16-byte block of the padded secret (the 32-byte mask seed pads to 48:
52 bytes; the 306-byte PEM private key pads to 320: 324 bytes); a share pair's plaintext is 8 + 8 + 4 + 52 + 324
= 396 bytes, whose Fernet token is 612 bytes (1 + 8 + 16 + 400 + 32 = 457 bytes in base64). Node ids count 8
bytes, as in Flower's share plaintexts. Message framing (protobuf, record keys) is not counted, as for every
other kind in the ledger. The masked input replaces the dense upload: its d + 1 elements (Flower prepends the
quantized weight) cost 8 bytes each, as Flower's ``secaggplus_mod`` ships them (numpy int64 arrays, whatever R;
Bell et al.'s analysis counts ``log2(R)`` bits), so that a deployed run (``fedweave.deploy.secure``) sends what its
ledger bills (``tests/test_deploy_secagg.py``).

The neighbourhoods are Flower's: the sampled clients in a random order (the ``("secagg_ring", round)`` stream),
each with the ``num_shares >> 1`` clients either side of it; ``num_shares`` and the threshold resolve as
Flower's setup stage resolves them. Only the ledger is simulated: the values the model sees are the clients'
updates as they are, neither clipped to ``clipping_range`` nor quantized, and a round that Flower would abort
for too few delivering neighbours is not aborted.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedweave.config import ConfigError, Section, SecureAggregationConfig
from fedweave.seeding import Seeds

PUBLIC_KEY_BYTES = 215  # a SECP384R1 public key, PEM SubjectPublicKeyInfo (Flower's public_key_to_bytes)
SEED_SHARE_BYTES = 52  # a Shamir share of the 32-byte mask seed: index 4 + 3 blocks of 16
KEY_SHARE_BYTES = 324  # a Shamir share of the 306-byte PEM PKCS8 private key: index 4 + 20 blocks of 16
CIPHERTEXT_BYTES = 612  # the Fernet token of a share pair's 396-byte plaintext
ID_BYTES = 8  # a node id, as Flower packs it into the share plaintexts
SETUP_BYTES = 7 * 8  # the setup stage's 7 numbers
MASKED_VALUE_BYTES = 8  # a masked value in Z_R, as Flower's mod ships it (numpy int64)


def resolve(cfg: SecureAggregationConfig, n: int) -> tuple[int, int, int]:
    """``(num_shares, threshold, k)`` of a round of ``n`` sampled clients, as Flower's setup stage resolves them
    (k: the neighbourhood's size, the client itself included)."""
    ns: float | int = 1.0 if cfg.num_shares == 1 else cfg.num_shares
    if isinstance(ns, float):
        shares = round(ns * n)
        if shares < n and shares % 2 == 0:
            shares += 1
        if shares <= 2:
            shares = n
    else:
        shares = int(ns)
    t: float | int = 1.0 if cfg.reconstruction_threshold == 1 else cfg.reconstruction_threshold
    threshold = max(round(t * shares), 2) if isinstance(t, float) else int(t)
    if n != shares and shares % 2 == 0:  # Flower: the number of shares should be odd
        shares += 1
    half = shares >> 1
    return shares, threshold, min(2 * half + 1, n)


class SecAggPlus:
    """Bills the SecAgg+ messages of a round in the ledger (see the module's table)."""

    def __init__(self, cfg: SecureAggregationConfig, seeds: Seeds) -> None:
        self.cfg, self.seeds = cfg, seeds

    def masked_input_bytes(self, elements: int) -> int:
        """One client's masked input: the weight and ``elements`` values in Z_R, 8 bytes each (Flower's int64)."""
        return MASKED_VALUE_BYTES * (elements + 1)

    def neighbourhoods(self, r: int, sampled: np.ndarray) -> dict[int, set[int]]:
        """Each sampled client's neighbours (itself included): Flower's ring of the sampled clients in a random
        order, ``num_shares >> 1`` either side."""
        n = len(sampled)
        half = resolve(self.cfg, n)[0] >> 1
        order = np.asarray(sampled)[self.seeds.numpy("secagg_ring", r).permutation(n)]
        return {int(c): {int(order[(i + o) % n]) for o in range(-half, half + 1)} for i, c in enumerate(order)}

    def record(self, r: int, ledger: Any, sampled: np.ndarray, delivered: np.ndarray, elements: int) -> None:
        """Bill round ``r``: stages 0 to 2 for every sampled client, the masked inputs and stage 3 for the
        clients that delivered (``elements``: the values of one client's upload)."""
        n = len(sampled)
        if n == 0:
            return
        _, _, k = resolve(self.cfg, n)
        pk = 2 * PUBLIC_KEY_BYTES
        ledger.record(r, "server", "client", "secagg_setup", n * SETUP_BYTES, n)
        ledger.record(r, "client", "server", "secagg_public_keys", n * pk, n)
        ledger.record(r, "server", "client", "secagg_key_broadcast", n * k * (ID_BYTES + pk), n)
        pair = ID_BYTES + CIPHERTEXT_BYTES
        ledger.record(r, "client", "server", "secagg_encrypted_shares", n * (k - 1) * pair, n)
        ledger.record(r, "server", "client", "secagg_forwarded_shares", n * (k - 1) * pair, n)
        a = len(delivered)
        if a == 0:
            return
        ledger.record(r, "client", "server", "secagg_masked_input", a * self.masked_input_bytes(elements), a)
        ledger.record(r, "server", "client", "secagg_unmask_request", a * k * ID_BYTES, a)
        alive = {int(c) for c in delivered}
        shares = 0
        if len(alive) == n:  # nobody dropped: a seed share per neighbour
            shares = a * k * SEED_SHARE_BYTES
        else:
            hood = self.neighbourhoods(r, np.asarray(sampled))
            for c in alive:
                live = len(hood[c] & alive)
                shares += live * SEED_SHARE_BYTES + (len(hood[c]) - live) * KEY_SHARE_BYTES
        ledger.record(r, "client", "server", "secagg_unmask_shares", a * k * ID_BYTES + shares, a)


def make_secagg(algo: Any) -> SecAggPlus | None:
    """The run's SecAgg+ billing (None without a ``secure_aggregation`` section); a method or setting whose
    server needs more than the sum of the updates is one ConfigError naming ``secure_aggregation``."""
    cfg: SecureAggregationConfig | None = algo.config.secure_aggregation
    if cfg is None:
        return None
    name = algo.config.algorithm.name
    if algo.family != "centralized":
        raise ConfigError(f"secure_aggregation: the {algo.family} family is not supported yet (star methods only)")
    if getattr(algo, "asynchronous", False):
        # FedBuff steps on a buffer of arrivals, FedAsync on each one (it has no buffer_size)
        steps = (
            "a buffer of uploads that arrive one by one"
            if hasattr(algo.hp, "buffer_size")
            else "each upload as it arrives"
        )
        raise ConfigError(
            f"secure_aggregation: algorithm {name!r} is refused: its server steps on {steps}, which SecAgg+'s rounds "
            "of a fixed cohort do not model"
        )
    if why := algo.secure_refusal(algo.hp.weighting):  # one model update per client, the server state from their sum
        raise ConfigError(
            f"secure_aggregation: algorithm {name!r} is refused: its server needs more than the sum of the "
            f"clients' updates ({why})"
        )
    if algo.config.compression.upload is not None:
        raise ConfigError(
            "secure_aggregation: compression.upload sends encoded updates, but SecAgg+ masks dense vectors in Z_R; "
            "leave one out"
        )
    if algo.config.aggregator != Section("mean"):
        raise ConfigError(
            f"secure_aggregation: aggregator {algo.config.aggregator.name} needs each client's update, which secure "
            "aggregation hides from the server (it learns only the sum); leave one out"
        )
    # the counts a round takes where the sampler knows them (fixed's clients, each schedule entry the run uses),
    # else clients_per_round: a round of one client has no sum to hide its update in, and Flower refuses it
    counts = algo.sampler.sizes()
    if counts[0] < 2:
        raise ConfigError(
            f"secure_aggregation: SecAgg+ needs at least 2 clients per round (algorithm.clients_per_round, or the "
            f"sampler's clients), got rounds of {counts[0]}"
        )
    for per_round in counts:
        _, threshold, k = resolve(cfg, per_round)
        if k < threshold:
            raise ConfigError(
                f"secure_aggregation: with {per_round} clients per round each client has {k} neighbours, fewer "
                f"than reconstruction_threshold ({threshold}); lower it or raise num_shares"
            )
    return SecAggPlus(cfg, algo.ctx.seeds)
