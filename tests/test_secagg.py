"""Secure aggregation's cost in simulation (fedweave.privacy.secagg; docs/privacy.md): SecAgg+'s messages in the
ledger with Flower's sizes, the numbers unchanged, and the refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedweave.algorithms.base import RunContext, build_algorithm
from fedweave.config import ConfigError, SecureAggregationConfig, load
from fedweave.privacy.secagg import SecAggPlus, resolve
from fedweave.seeding import Seeds


def _cfg(toy_config: dict, secure: dict | None = None, **top) -> dict:
    cfg = {**toy_config, "rounds": 2, **top}
    if secure is not None:
        cfg["secure_aggregation"] = secure
    return cfg


def _built(cfg: dict):
    return build_algorithm(RunContext(load(cfg)))


class _Ledger:
    def __init__(self) -> None:
        self.rows: dict[str, tuple[str, int, int]] = {}

    def record(self, r, sender, receiver, kind, nbytes, count=1):
        self.rows[kind] = (f"{sender}->{receiver}", nbytes, count)


def test_the_round_bills_secagg_plus_messages_as_computed_by_hand(toy_config):
    algo = _built(_cfg(toy_config, {"num_shares": 3, "reconstruction_threshold": 2}))
    algo.run_round(0)
    got = {kind: (nbytes, count) for (r, _, _, kind), (nbytes, count) in algo.ledger._totals.items()}
    # 4 clients, 3 shares: each client has k = 3 neighbours (itself included); the logistic model has d = 148 values
    assert algo.num_params == 148
    assert got["secagg_setup"] == (4 * 7 * 8, 4)
    assert got["secagg_public_keys"] == (4 * 2 * 215, 4)
    assert got["secagg_key_broadcast"] == (4 * 3 * (8 + 2 * 215), 4)
    assert got["secagg_encrypted_shares"] == (4 * 2 * (8 + 612), 4) == got["secagg_forwarded_shares"]
    assert got["secagg_masked_input"] == (4 * 149 * 8, 4)  # the weight and 148 values, int64 each (as Flower ships)
    assert got["secagg_unmask_request"] == (4 * 3 * 8, 4)
    assert got["secagg_unmask_shares"] == (4 * (3 * 8 + 3 * 52), 4)  # no dropout: a seed share per neighbour
    assert "model" not in {kind for (_, s, _, kind) in algo.ledger._totals if s == "client"}  # masked, not dense
    assert got["model"] == (4 * 148 * 4, 4)  # the downlink is unchanged


def test_a_dropped_neighbour_costs_its_key_share_and_masked_values_are_int64_whatever_the_field():
    cfg = SecureAggregationConfig(num_shares=1.0, modulus_range=2**20, quantization_range=2**10)
    ledger = _Ledger()
    SecAggPlus(cfg, Seeds(0)).record(0, ledger, np.arange(5), np.array([0, 1, 2, 4]), 10)
    # everybody is everybody's neighbour (k = 5); client 3 dropped after stage 2
    assert ledger.rows["secagg_forwarded_shares"] == ("server->client", 5 * 4 * 620, 5)
    assert ledger.rows["secagg_masked_input"] == ("client->server", 4 * 88, 4)  # 11 int64 values, whatever R
    assert ledger.rows["secagg_unmask_shares"] == ("client->server", 4 * (5 * 8 + 4 * 52 + 324), 4)


def test_the_shares_and_threshold_resolve_as_flowers_setup_stage():
    def res(n, shares, t):
        return resolve(SecureAggregationConfig(num_shares=shares, reconstruction_threshold=t), n)

    assert res(10, 0.5, 0.5) == (5, 2, 5)  # round(5) odd; round(2.5) = 2
    assert res(10, 0.4, 0.6) == (5, 3, 5)  # round(4) even and < n: 5 shares; round(0.6 * 5) = 3
    assert res(4, 1.0, 0.5) == (4, 2, 4)
    assert res(10, 4, 3) == (5, 3, 5)  # an even int: one more (Flower warns)
    assert res(3, 5, 2) == (5, 2, 3)  # more shares than clients: everybody


def test_the_neighbourhoods_are_flowers_ring():
    sa = SecAggPlus(SecureAggregationConfig(num_shares=3, reconstruction_threshold=2), Seeds(1))
    hood = sa.neighbourhoods(0, np.array([2, 5, 7, 9, 11]))
    assert all(len(v) == 3 and c in v for c, v in hood.items())
    assert all(c in hood[o] for c, v in hood.items() for o in v)  # symmetric


def test_flowers_byte_strings_have_the_billed_sizes():
    pytest.importorskip("flwr")
    import os

    from flwr.common.secure_aggregation.crypto.shamir import create_shares
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import encrypt, generate_shared_key
    from flwr.common.secure_aggregation.secaggplus_utils import share_keys_plaintext_concat
    from flwr.supercore.primitives.asymmetric import generate_key_pairs, private_key_to_bytes, public_key_to_bytes

    from fedweave.privacy import secagg

    sk, pk = generate_key_pairs()
    other, _ = generate_key_pairs()
    seed_share = create_shares(os.urandom(32), 2, 3)[0]
    key_share = create_shares(private_key_to_bytes(sk), 2, 3)[0]
    token = encrypt(generate_shared_key(other, pk), share_keys_plaintext_concat(1, 2, seed_share, key_share))
    assert len(public_key_to_bytes(pk)) == secagg.PUBLIC_KEY_BYTES
    assert (len(seed_share), len(key_share)) == (secagg.SEED_SHARE_BYTES, secagg.KEY_SHARE_BYTES)
    assert len(token) == secagg.CIPHERTEXT_BYTES


def test_the_numbers_are_unchanged_and_nothing_is_recorded_without_the_section(toy_config):
    plain = _built(_cfg(toy_config))
    secure = _built(_cfg(toy_config, {"num_shares": 1.0}))
    for r in range(2):
        plain.run_round(r)
        secure.run_round(r)
    assert torch.equal(plain.x, secure.x)
    assert plain.secagg is None and "secure_aggregation" not in load(_cfg(toy_config)).to_dict()
    assert not any(kind.startswith("secagg") for (_, _, _, kind) in plain.ledger._totals)


@pytest.mark.parametrize("name", ["moon", "feddyn", "scaffold"])
def test_a_method_with_client_state_is_unchanged_by_the_section(toy_config, name):
    """MOON, FedDyn and SCAFFOLD keep state on their clients; FedDyn's server needs the sum of the models and
    SCAFFOLD's the sum of the control deltas, which the mean gives under equal weights (their Alg. 1): bit for bit
    the method without the section."""
    algorithm = {"name": name, "clients_per_round": 4, "weighting": "uniform"}
    plain = _built(_cfg(toy_config, algorithm=algorithm))
    secure = _built(_cfg(toy_config, {"num_shares": 1.0}, algorithm=algorithm))
    for r in range(3):
        plain.run_round(r)
        secure.run_round(r)
    assert secure.secagg is not None and torch.equal(plain.x, secure.x)


@pytest.mark.parametrize(("name", "what"), [("feddyn", "h sums the"), ("scaffold", "sums the control-variate")])
def test_a_method_that_needs_a_sum_weighted_by_samples_is_refused_with_one_line(toy_config, name, what):
    cfg = _cfg(toy_config, {"num_shares": 1.0}, algorithm={"name": name, "clients_per_round": 4})
    with pytest.raises(ConfigError, match=rf"^secure_aggregation: algorithm '{name}' is refused: .* {what}"):
        _built(cfg)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"algorithm": {"name": "scaffold", "clients_per_round": 4}}, "algorithm 'scaffold' is refused"),
        ({"compression": {"upload": {"name": "topk", "ratio": 0.1}}}, "compression.upload sends encoded updates"),
        ({"aggregator": "median"}, "aggregator median needs each client's update"),
        ({"algorithm": {"name": "fedavg", "clients_per_round": 1}}, "at least 2 clients per round"),
        # the sampler's own count, not clients_per_round (4 here): a fixed client alone, a schedule's entry of one
        ({"sampler": {"name": "fixed", "clients": 1}}, "at least 2 clients per round"),
        ({"sampler": {"name": "schedule", "clients": [[0, 1, 2], [3]]}}, "at least 2 clients per round"),
        (
            {"sampler": {"name": "fixed", "clients": [0, 1, 2]}, "secure_aggregation": {"reconstruction_threshold": 4}},
            "reconstruction_threshold (4)",
        ),
        ({"secure_aggregation": {"num_shares": 3, "reconstruction_threshold": 5}}, "reconstruction_threshold (5)"),
        ({"secure_aggregation": {"num_shares": 2}}, "secure_aggregation.num_shares as an integer"),
        ({"secure_aggregation": {"modulus_range": 1000}}, "secure_aggregation.modulus_range must be a power of 2"),
    ],
)
def test_what_secure_aggregation_cannot_cover_is_refused_with_one_line(toy_config, change, words):
    cfg = _cfg(toy_config, {"num_shares": 1.0})
    cfg.update(change)
    with pytest.raises(ConfigError) as e:
        _built(cfg)
    assert str(e.value).startswith("secure_aggregation") and words in str(e.value) and "\n" not in str(e.value)


def test_another_family_is_refused_with_one_line_and_flower_deployment_runs_it(toy_config):
    from fedweave.deploy.support import check_deployable

    cfg = _cfg(toy_config, {"num_shares": 1.0}, algorithm={"name": "hier_fedavg", "tau": 2})
    with pytest.raises(ConfigError, match=r"^secure_aggregation: the hierarchical family is not supported yet"):
        _built(cfg)
    # fedweave flower-app runs Flower's SecAgg+ (tests/test_deploy_secagg.py); on-error drop is refused there
    check_deployable(load(_cfg(toy_config, {"num_shares": 1.0})), "stop")


def test_the_documented_deployed_error_bound_divides_by_the_quantization_range_not_the_field():
    # docs/privacy.md calls the field of the masked values R = modulus_range (2^32); the deployed mean's error
    # bound divides by quantization_range (2^22 gives the documented 4.8e-7), which must not be called R there
    from pathlib import Path

    text = Path(__file__).parents[1].joinpath("docs", "privacy.md").read_text()
    section = text[text.index("**Deployed, it is Flower's SecAgg+**") :][:900]
    assert "2 c / R" not in section and "`quantization_range`" in section
    assert abs(2 * 1.0 / SecureAggregationConfig().quantization_range - 4.8e-7) < 0.05e-7


def test_a_quoted_number_of_shares_is_read_as_its_unquoted_spelling(toy_config):
    # before: a quoted "3" was read by the float branch as 3.0, a fraction, and refused as "num_shares as a fraction
    # must be in (0, 1], got 3.0"; a quoted number is taken as the number its unquoted spelling is
    cfg = load(_cfg(toy_config, {"num_shares": "3", "reconstruction_threshold": "2"}))
    assert cfg.secure_aggregation.num_shares == 3 and isinstance(cfg.secure_aggregation.num_shares, int)
    assert isinstance(cfg.secure_aggregation.reconstruction_threshold, int)
    cfg = load(_cfg(toy_config, {"num_shares": "0.5", "reconstruction_threshold": "0.5"}))
    assert cfg.secure_aggregation.num_shares == 0.5 and cfg.secure_aggregation.reconstruction_threshold == 0.5
    with pytest.raises(ConfigError, match=r"^secure_aggregation\.num_shares must be int or float, got 'three'$"):
        load(_cfg(toy_config, {"num_shares": "three"}))
