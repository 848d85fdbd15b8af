"""Update compression (docs/compression.md): unbiased compressors, error feedback, exact billing, resume."""

from __future__ import annotations

import csv
import math
import runpy
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import fedweave
from fedweave.cli import main as cli_main
from fedweave.compression import QSGD, EFSign, Encoded, Int8, RandK, TopK, build_compressor, wire_bits
from fedweave.compression.download import REPLICA
from fedweave.config import ConfigError, Section, load
from fedweave.registry import ALGORITHMS, COMPRESSORS
from fedweave.runner import run as run_config
from fedweave.seeding import Seeds
from tests.test_centralized import D_TOY, _algo, _cfg, _quad_cfg, _quad_optimum, _rounds, _squared

ALL = {
    "topk": {"ratio": 0.1},
    "randk": {"ratio": 0.1},
    "qsgd": {"levels": 4},
    "efsign": {},
    "int8": {},
}


def _with(cfg: dict, name: str | None, **opts) -> dict:
    return {**cfg, "compression": {"upload": None if name is None else {"name": name, **opts}}}


# ---- the compressors on their own -----------------------------------------------------------------------
def _draws(c, v: torch.Tensor, n: int) -> torch.Tensor:
    seeds = Seeds(11)
    return torch.stack([c.decode(c.encode(v, seeds.torch("compression", r, 0, 0))) for r in range(n)])


@pytest.mark.parametrize(
    "c, variance",
    [
        # QSGD: xi_i/s is a two-point draw on neighbouring levels 1/s apart: var <= ||v||^2 / (4 s^2)
        (QSGD(levels=2), lambda v: torch.full_like(v, float(v.norm() ** 2) / (4 * 2**2))),
        # random-k, scaled by d/k: (d/k) v_i with probability k/d, else 0: var = v_i^2 (d/k - 1)
        (RandK(k=5), lambda v: v**2 * (len(v) / 5 - 1)),
        # 8 bits: neighbouring levels (max - min)/255 apart: var <= step^2 / 4
        (Int8(), lambda v: torch.full_like(v, float((v.max() - v.min()) / 255) ** 2 / 4)),
    ],
    ids=["qsgd", "randk", "int8"],
)
def test_random_compressors_are_unbiased(c, variance):
    """The mean of n decoded draws is within 5 standard errors sqrt(var / n) of v in every coordinate (a
    deterministic set of draws from the seed streams; 5 sigma over 20 coordinates fails by chance < 1e-5)."""
    v = torch.randn(20, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    n = 4000
    mean = _draws(c, v, n).mean(0)
    tol = 5 * (variance(v) / n).sqrt() + 1e-12
    assert bool(((mean - v).abs() <= tol).all()), ((mean - v).abs() / tol).max()
    assert not torch.equal(_draws(c, v, 1)[0], v)  # the draws do compress


@pytest.mark.parametrize("scale", [1e-25, 1e20], ids=["tiny", "huge"])
def test_qsgd_stays_unbiased_where_the_squared_norm_leaves_the_float_range(scale):
    """Values whose squares underflow (or overflow) float32 still have a representable norm: QSGD keeps their
    scale (a naive ||v||_2 is 0 or inf there, and the message decoded to zeros or NaN)."""
    unit = torch.tensor([1.0, -2.0, 0.5, 3.0])
    mean = _draws(QSGD(levels=2), scale * unit, 2000).mean(0) / scale
    # QSGD with s = 2: each coordinate's variance is at most ||v||^2 / (4 s^2); 5 standard errors of the mean
    torch.testing.assert_close(mean, unit, rtol=0.0, atol=5 * float(unit.norm()) / 4 / 2000**0.5)


@pytest.mark.parametrize("s", [1, 4])
def test_qsgd_under_error_feedback_is_a_contraction_and_its_residual_stays_bounded(s):
    """Error feedback needs a delta-contraction (Karimireddy et al. 2019, Alg. 2 and Lemma 3); QSGD is unbiased
    with variance omega = min(d/s^2, sqrt(d)/s) (Alistarh et al. 2017, Lemma 3.1), a contraction only once
    scaled by 1/(1 + omega). Sent unscaled under error feedback, the residual of a repeated message grew
    without bound (||e|| / ||v|| about 9e4 after 30 steps at s = 1, d = 1000); scaled, it stays within the
    lemma's E||e||^2 <= 4 (1 - delta) / delta^2 ||v||^2."""
    d, g = 1000, torch.Generator().manual_seed(0)
    v = torch.randn(d, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    c = QSGD(levels=s, error_feedback=True)
    delta = 1 / (1 + min(d / s**2, math.sqrt(d) / s))
    e, ratios = torch.zeros_like(v), []
    for _ in range(300):
        p = v + e
        e = p - c.decode(c.encode(p, g))
        ratios.append(float(e.norm() / v.norm()))
    assert max(ratios) <= math.sqrt(4 * (1 - delta)) / delta
    # the contraction itself, in expectation: E||C(p) - p||^2 <= (1 - delta) ||p||^2
    p = v.clone()
    err = torch.stack([(c.decode(c.encode(p, g)) - p).pow(2).sum() for _ in range(2000)]).mean()
    assert float(err) <= (1 - delta) * float(p.pow(2).sum())


@pytest.mark.parametrize("s", [1, 4])
def test_qsgd_variance_is_the_stochastic_roundings_and_within_lemma_3_1(s):
    """QSGD's error is that of its stochastic rounding, E||Q(v) - v||^2 = sum_i (||v|| / s)^2 p_i (1 - p_i) with
    p_i the fractional part of s |v_i| / ||v||, which Alistarh et al. 2017, Lemma 3.1 (ii) bounds by
    min(d / s^2, sqrt(d) / s) ||v||^2. The mean of n squared errors is within 5 of its standard errors of it."""
    v = torch.randn(50, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    scaled = v.abs() / v.norm() * s
    p = scaled - scaled.floor()
    exact = float((v.norm() / s) ** 2 * (p * (1 - p)).sum())
    assert exact <= min(len(v) / s**2, math.sqrt(len(v)) / s) * float(v.norm() ** 2)
    err = ((_draws(QSGD(levels=s), v, 2000) - v) ** 2).sum(1)
    assert abs(float(err.mean()) - exact) <= 5 * float(err.std()) / math.sqrt(len(err))


def test_topk_and_efsign_are_what_their_papers_define():
    v = torch.tensor([0.5, -3.0, 0.1, 2.0, -0.2])
    top = TopK(k=2)
    assert torch.equal(top.decode(top.encode(v, None)), torch.tensor([0.0, -3.0, 0.0, 2.0, 0.0]))
    s = EFSign()
    scale = v.abs().sum() / 5  # ||v||_1 / d (Karimireddy et al. 2019, Alg. 1)
    assert torch.equal(s.decode(s.encode(v, None)), scale * torch.tensor([1.0, -1, 1, 1, -1]))


@pytest.mark.parametrize("name", sorted(ALL))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_encoded_bytes_round_trip_and_match_the_formula(name, dtype):
    c = build_compressor(Section(name, ALL[name]))
    v = torch.randn(37, generator=torch.Generator().manual_seed(1), dtype=dtype)
    e = c.encode(v, Seeds(0).torch("compression", 0, 0, 0))
    data = e.to_bytes()
    assert len(data) == e.nbytes == math.ceil(wire_bits(c, 37, dtype) / 8)
    back = Encoded.from_bytes(data, e.layout, e.size, e.dtype, e.shared)
    assert torch.equal(c.decode(back), c.decode(e))


@pytest.mark.parametrize("cls", [TopK, RandK])
@pytest.mark.parametrize(
    "ratio, size, k", [(0.07, 100, 7), (0.14, 50, 7), (0.035, 200, 7), (0.01, 650, 7), (0.5, 1, 1)]
)
def test_ratio_keeps_ceil_of_ratio_times_d_as_written(cls, ratio, size, k):
    # 0.07 * 100 is 7.000000000000001 in floats, whose ceiling kept (and billed) 8 values for "7 % of 100"
    c = cls(ratio=ratio)
    assert c.kept(size) == k == cls(ratio=np.float64(ratio)).kept(size)  # a ratio from a numpy grid too
    e = c.encode(torch.randn(size, generator=torch.Generator().manual_seed(0)), torch.Generator().manual_seed(1))
    assert int((c.decode(e) != 0).sum()) == k and e.nbytes == math.ceil(wire_bits(c, size, torch.float32) / 8)


# ---- in the star round --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(ALL))
def test_the_ledger_bills_exactly_the_encoded_payload(name, monkeypatch):
    sent: list[int] = []
    cls = COMPRESSORS.get(name)
    encode = cls.encode

    def spy(self, v, rng):
        e = encode(self, v, rng)
        sent.append(len(e.to_bytes()))
        return e

    monkeypatch.setattr(cls, "encode", spy)
    for alg, messages in (("fedavg", 1), ("scaffold", 2)):  # SCAFFOLD sends Delta y_i and Delta c_i
        sent.clear()
        algo = _algo(_with(_cfg(alg), name, **ALL[name]))
        algo.run_round(0)
        assert len(sent) == 3 * messages
        assert algo.ledger.bytes("up", round=0) == sum(sent)
        assert sum(sent) < 3 * messages * D_TOY * 4  # fewer bytes than dense
        dense = _algo(_cfg(alg))
        dense.run_round(0)
        assert algo.ledger.bytes("down", round=0) == dense.ledger.bytes("down", round=0)  # downloads stay dense


def test_absent_compression_changes_nothing():
    for alg in ("fedavg", "scaffold"):
        plain, none = _algo(_cfg(alg)), _algo(_with(_cfg(alg), None))
        assert torch.equal(_rounds(plain, 2), _rounds(none, 2))
        assert plain.ledger.summary() == none.ledger.summary()
        assert "compression" not in plain.state_dict()


@pytest.mark.parametrize("alg", ["fedavg", "fedadam", "fedmim", "fedprox", "scaffold"])
def test_topk_with_k_equal_d_is_no_compression_bit_for_bit(alg):
    plain = _rounds(_algo(_cfg(alg)), 3)
    full = _rounds(_algo(_with(_cfg(alg), "topk", ratio=1.0)), 3)
    assert torch.equal(plain, full)


@pytest.mark.parametrize("name", ["efsign", "qsgd"])
def test_fednova_reduces_the_decoded_updates_themselves(name):
    """FedNova's rows are (tau_eff / tau_i) times the decoded displacement (Wang et al. 2020, Sec. 5), not times
    (x + decoded) - x, which differs from it by the rounding of the sum (in the last bits of some coordinates)."""
    from fedweave.algorithms.centralized.fednova import nova_scale

    algo = _algo(_with(_cfg("fednova", local={"epochs": 1, "batch_size": 16, "lr": 0.5}), name))
    _rounds(algo, 2)
    got = algo.transmit_uploads(2, algo.train_clients(2, algo.sample_clients(2)))
    assert got.sent is not None
    want = nova_scale(got.weights, got.local.steps).unsqueeze(1) * got.sent
    assert torch.equal(algo.client_updates(got), want)


def test_error_feedback_converges_to_the_uncompressed_optimum():
    """SCAFFOLD on the federated least-squares problem (full participation, local GD) reaches the pooled
    optimum uncompressed; with error feedback on both of its messages (Delta y_i and Delta c_i, which vanish
    there) top-1 of the 3 coordinates and the scaled sign reach it too, and without error feedback they stop
    short of it. (FedAvg's clients keep non-zero updates at its fixed point, so compressed FedAvg circles it.)"""

    def distance(name: str | None = None, **opts) -> float:
        algo = _algo(_with(_quad_cfg("scaffold"), name, **opts))
        algo.trainer.loss_fn = _squared
        # 80 rounds: within 1e-5 by round 60, about 1e-7 (float32 rounding) at 80; without feedback 0.28 and more
        return float((_rounds(algo, 80) - opt).norm() / opt.norm())

    opt = _quad_optimum()
    assert distance() < 1e-5
    for name, opts in (("topk", {"k": 1}), ("efsign", {})):
        assert distance(name, **opts) < 1e-5, name
        assert distance(name, **opts, error_feedback=False) > 0.1, name


@pytest.mark.parametrize("name", ["topk", "qsgd"])
def test_resume_continues_identically(name, tmp_path):
    opts = {"ratio": 0.2} if name == "topk" else {"levels": 2, "error_feedback": True}
    cfg = _with(_cfg("scaffold", rounds=4), name, **opts)
    full = fedweave.run(cfg, run_dir=tmp_path / "full")
    cfg2 = {**cfg, "output": {**cfg["output"], "checkpoint_every": 2}}
    fedweave.run({**cfg2, "rounds": 2}, run_dir=tmp_path / "part")
    resumed = run_config(load({**cfg2, "rounds": 4}), run_dir=tmp_path / "part", resume=True)
    assert torch.equal(resumed.algorithm.x, full.algorithm.x)
    residuals = full.algorithm.compression.state_dict()
    assert set(residuals) == {"dy", "dc"}
    for k, t in resumed.algorithm.compression.state_dict().items():
        assert torch.equal(t, residuals[k])
    assert [r["bytes_up"] for r in resumed.metrics] == [r["bytes_up"] for r in full.metrics]


def test_loop_and_vmap_agree():
    xs = [_rounds(_algo(_with(_cfg("fedavg", backend=b), "qsgd", levels=8)), 3) for b in ("loop", "vmap")]
    torch.testing.assert_close(xs[0], xs[1], rtol=1e-5, atol=1e-6)


# ---- bad input: one line ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "upload, alg, expect",
    [
        ({"name": "nosuch"}, "fedavg", "compression.upload.name: unknown compressor 'nosuch'"),
        ({"name": "topk"}, "fedavg", "compression.upload: give exactly one of k (values kept) and ratio"),
        ({"name": "topk", "k": 10_000}, "fedavg", "compression.upload.k (10000) exceeds the 148 values"),
        ({"name": "qsgd", "levels": 0}, "fedavg", "compression.upload.levels must be >= 1"),
        ({"name": "qsgd", "levels": 1e30}, "fedavg", "compression.upload.levels must be at most 2^63 - 1"),
        ({"name": "qsgd", "bits": 4}, "fedavg", "unknown key 'compression.upload.bits'"),
        ({"name": "efsign"}, "dfedavg", "compression.upload: algorithm 'dfedavg' (decentralized) does not compress"),
        ([1], "fedavg", "compression.upload must be str or dict or null"),
    ],
)
def test_bad_compression_config_is_one_line(upload, alg, expect):
    cfg = _cfg(alg)
    if alg == "dfedavg":
        cfg["algorithm"] = {"name": "dfedavg"}
    with pytest.raises(ConfigError, match=None) as e:
        _algo({**cfg, "compression": {"upload": upload}})
    assert expect in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("side", ["upload", "download"])
def test_an_override_sets_an_option_of_a_compressor_given_by_its_name(side):
    # docs/compression.md: `upload: efsign` is the name alone; a key=value override (or a --grid key) of one of
    # its options works on that form as on the mapping, as it does on `model: cnn_small`
    cfg = {**_cfg("fedavg"), "compression": {side: "int8"}}
    got = load(cfg, [f"compression.{side}.error_feedback=true"]).compression
    assert getattr(got, side) == {"name": "int8", "error_feedback": True}
    mapping = load({**cfg, "compression": {side: {"name": "int8", "error_feedback": True}}}).compression
    assert (
        getattr(got, f"{side}_section")
        == getattr(mapping, f"{side}_section")
        == Section("int8", {"error_feedback": True})
    )


def test_flower_app_carries_a_compressed_upload(tmp_path, monkeypatch):
    """The deployment sends the encoded uploads (tests/test_deploy_inprocess.py, tests/test_deploy_flower.py)."""
    monkeypatch.chdir(tmp_path)
    cfg = {**_cfg("fedavg"), "dataset": {"name": "_toy"}, "partition": {"name": "iid", "num_clients": 4}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    assert cli_main(["flower-app", "c.yaml", "app", "compression.upload={name: qsgd}"]) == 0
    assert (tmp_path / "app" / "pyproject.toml").is_file()


def test_list_shows_the_compressors(capsys):
    assert cli_main(["list"]) == 0
    line = next(s for s in capsys.readouterr().out.splitlines() if s.startswith("compressors:"))
    assert line == "compressors: " + ", ".join(sorted(ALL))
    assert np.all([COMPRESSORS.get(n) for n in ALL])


# the synchronous star methods (the asynchronous ones send one upload per arrival: tests/test_async.py)
STAR = [
    n
    for n, cls in ((n, ALGORITHMS.get(n)) for n in ALGORITHMS.names() if not n.startswith("_"))
    if cls.family == "centralized" and cls.compresses_uploads and not getattr(cls, "asynchronous", False)
]


@pytest.mark.parametrize("alg", STAR)
def test_every_star_method_composes_with_compression(alg):
    """Each method trains on what the server decodes and pays the encoded bytes of each of its messages."""
    dense, packed = _algo(_cfg(alg)), _algo(_with(_cfg(alg), "efsign"))
    for a in (dense, packed):
        _rounds(a, 2)
    messages = dense.ledger.bytes("up", round=1) // (3 * D_TOY * 4)  # 3 clients, float32
    assert packed.ledger.bytes("up", round=1) == 3 * messages * math.ceil((32 + D_TOY) / 8)
    assert bool(torch.isfinite(packed.x).all()) and not torch.equal(packed.x, dense.x)


def test_the_accuracy_vs_bytes_figure_is_rebuilt_from_its_records(tmp_path):
    """docs/compression/: the table and the figure come from the committed records alone, and the records'
    bytes are the formulas' (5 clients a round, 650 float32 parameters, no faults)."""
    root = Path(__file__).resolve().parents[1]
    # by its path: the name `benchmarks` may belong to an installed distribution
    bench = runpy.run_path(str(root / "benchmarks" / "compression_digits.py"))
    ROUNDS, SETTINGS, render = bench["ROUNDS"], bench["SETTINGS"], bench["render"]  # noqa: N806
    docs = root / "docs" / "compression"
    png, md = render(docs / "records.csv", tmp_path)
    assert md.read_text() == (docs / "table.md").read_text()
    assert png.stat().st_size > 10_000
    last = {}
    with open(docs / "records.csv", newline="") as f:
        for row in csv.DictReader(f):
            if int(row["round"]) == ROUNDS:
                last[row["setting"]] = int(row["bytes_up"])
    for label, upload in SETTINGS.items():
        if upload is None:
            per_message = 650 * 4
        else:
            c = build_compressor(Section(upload["name"], {k: v for k, v in upload.items() if k != "name"}))
            per_message = math.ceil(wire_bits(c, 650, torch.float32) / 8)
        assert last[label] == ROUNDS * 5 * per_message, label


# ---- the hierarchical edge step -----------------------------------------------------------------------
def _hier(name: str, upload: dict | None, **algo) -> dict:
    from tests.test_hierarchical import _config

    cfg = _config(**algo)
    cfg["algorithm"]["name"] = name
    cfg["algorithm"].pop("server_batch_size")
    return {**cfg, "compression": {"upload": upload}}


@pytest.mark.parametrize("name, messages", [("hier_fedavg", 1), ("hier_fedprox", 1), ("hier_scaffold", 2)])
def test_the_hierarchical_averaging_step_composes(name, messages, tmp_path):
    """The model-averaging baselines bill each client's encoded messages (the server's own job sends
    nothing), top-k with k = d changes their models only by the rounding of x + (y - x) (SCAFFOLD's
    messages are its updates: not at all), and a resumed run continues identically."""
    plain = _rounds(_algo(_hier(name, None, server_data="client")), 3)
    full = _algo(_hier(name, {"name": "topk", "ratio": 1.0}, server_data="client"))
    _rounds(full, 3)
    if name == "hier_scaffold":
        assert torch.equal(full.x, plain)
    torch.testing.assert_close(full.x, plain, rtol=1e-6, atol=1e-9)
    packed = _algo(_hier(name, {"name": "efsign"}))
    packed.run_round(0)
    f = torch.finfo(packed.x.dtype).bits
    assert packed.ledger.bytes("up", round=0) == packed.k * messages * math.ceil((f + packed.dim) / 8)
    cfg = {**_hier(name, {"name": "qsgd", "levels": 2, "error_feedback": True}), "rounds": 4}
    whole = fedweave.run(cfg, run_dir=tmp_path / "full")
    cfg2 = {**cfg, "output": {**cfg["output"], "checkpoint_every": 2}}
    fedweave.run({**cfg2, "rounds": 2}, run_dir=tmp_path / "part")
    resumed = run_config(load(cfg2), run_dir=tmp_path / "part", resume=True)
    assert torch.equal(resumed.algorithm.x, whole.algorithm.x)


def test_zo_hfl_refuses_compression_in_one_line():
    cfg = {**_hier("hier_fedavg", {"name": "efsign"}), "algorithm": {"name": "zo_hfl", "tau": 2}}
    with pytest.raises(ConfigError, match=r"compression.upload: algorithm 'zo_hfl' \(hierarchical\) does not"):
        _algo(cfg)


# ---- compressed downloads (compression.download) -------------------------------------------------------------
def _down(cfg: dict, name: str | None, **opts) -> dict:
    return {**cfg, "compression": {"download": None if name is None else {"name": name, **opts}}}


@pytest.mark.parametrize(
    "name, opts, variance",
    [
        ("qsgd", {"levels": 2}, lambda v: torch.full_like(v, float(v.norm() ** 2) / (4 * 2**2))),
        ("randk", {"k": 5}, lambda v: v**2 * (len(v) / 5 - 1)),
    ],
)
def test_a_compressed_download_is_unbiased(name, opts, variance):
    """One broadcast of x to a client that holds x_0: over the ``("compression_download", round, client)``
    draws the mean of the model it then holds is within 5 standard errors of x in every coordinate (the
    replica moves by an unbiased estimate of the difference x - x_0)."""
    algo = _algo(_down(_cfg("fedavg"), name, **opts))
    x0 = algo.x.clone()
    x = x0 + torch.randn(len(x0), generator=torch.Generator().manual_seed(3), dtype=x0.dtype)
    n, held = 3000, []
    for r in range(n):
        algo.download.store[REPLICA][0] = x0
        algo.download.broadcast(r, np.array([0]), x)
        held.append(algo.download.held(np.array([0]))[0].double())
    mean = torch.stack(held).mean(0)
    tol = 5 * (variance((x - x0).double()) / n).sqrt() + 1e-6
    assert bool(((mean - x.double()).abs() <= tol).all()), ((mean - x.double()).abs() / tol).max()
    assert not torch.equal(held[0], x.double())  # the draws do compress


@pytest.mark.parametrize("steps", [1, 5])
def test_compressed_downloads_converge_where_the_dense_run_does(steps):
    """FedAvg on the federated least-squares problem (full participation, local GD): with one local step it is
    gradient descent and reaches the pooled optimum, with five it settles at its own fixed point. With the
    download compressed to the difference from what each client holds (top-1 of the 3 coordinates, the scaled
    sign, unscaled random-1, QSGD) it reaches the same point: what compression drops is sent later."""

    def final(name: str | None = None, **opts) -> torch.Tensor:
        cfg = _down(_quad_cfg("fedavg"), name, **opts)
        cfg["local"] = {**cfg["local"], "steps": steps}
        algo = _algo(cfg)
        algo.trainer.loss_fn = _squared
        return _rounds(algo, 100)

    dense, opt = final(), _quad_optimum()
    if steps == 1:
        assert float((dense - opt).norm() / opt.norm()) < 1e-5
    else:
        assert float((dense - opt).norm() / opt.norm()) > 0.1  # FedAvg's own fixed point
    for name, opts in (("topk", {"k": 1}), ("efsign", {}), ("randk", {"k": 1, "error_feedback": True}), ("qsgd", {})):
        assert float((final(name, **opts) - dense).norm() / dense.norm()) < 1e-5, name


def test_scaffold_with_compressed_downloads_and_uploads_reaches_the_optimum():
    """SCAFFOLD on the federated least-squares problem (5 local GD steps, where FedAvg stops short) reaches the
    pooled optimum with its model compressed on the way down (top-1 of 3, the scaled sign; its c travels
    dense), and with both directions compressed."""

    def distance(compression: dict) -> float:
        algo = _algo({**_quad_cfg("scaffold"), "compression": compression})
        algo.trainer.loss_fn = _squared
        # 80 rounds: within 1e-6 by round 70, about 1e-7 (float32 rounding) at 80
        return float((_rounds(algo, 80) - opt).norm() / opt.norm())

    opt = _quad_optimum()
    for name, opts in (("topk", {"k": 1}), ("efsign", {})):
        assert distance({"download": {"name": name, **opts}}) < 1e-5, name
        assert distance({"download": {"name": name, **opts}, "upload": {"name": name, **opts}}) < 1e-5, name


def test_the_ledger_bills_the_encoded_download_and_clients_train_from_what_they_hold():
    """Each sampled client's download costs the encoded bytes of the formula (top-k: k indices and k values);
    the clients start from their replicas, and their updates are measured from there."""
    algo = _algo(_down(_cfg("fedavg"), "topk", ratio=0.1))
    seen = {}
    train = algo.trainer.train

    def spy(start, clients, *args, **kwargs):
        seen["start"] = start.clone()
        return train(start, clients, *args, **kwargs)

    algo.trainer.train = spy
    for r in range(2):
        algo.run_round(r)
        clients = algo.sample_clients(r)
        assert algo.ledger.bytes("down", round=r) == len(clients) * -(
            -wire_bits(TopK(ratio=0.1), D_TOY, torch.float32) // 8
        )
        assert torch.equal(seen["start"], algo.download.held(clients))
    assert not torch.equal(seen["start"][0], algo.x)  # what a client holds lags the server's model
    assert algo.ledger.bytes("up", round=0) == 3 * D_TOY * 4  # uploads stay dense
    scaffold = _algo(_down(_cfg("scaffold"), "efsign"))  # x_t encoded, c dense, in one message
    scaffold.run_round(0)
    model = -(-wire_bits(EFSign(), D_TOY, torch.float32) // 8)
    assert scaffold.ledger.bytes("down", round=0) == 3 * (model + D_TOY * 4)


def test_absent_download_compression_changes_nothing():
    for alg in ("fedavg", "fedadam"):
        plain, none = _algo(_cfg(alg)), _algo(_down(_cfg(alg), None))
        assert torch.equal(_rounds(plain, 2), _rounds(none, 2))
        assert plain.ledger.summary() == none.ledger.summary()
        assert "download" not in plain.state_dict()


def test_download_and_upload_compression_resume_identically(tmp_path):
    cfg = {**_cfg("fedadam", rounds=4), "compression": {"download": {"name": "topk", "ratio": 0.2}, "upload": "efsign"}}
    full = fedweave.run(cfg, run_dir=tmp_path / "full")
    cfg2 = {**cfg, "output": {**cfg["output"], "checkpoint_every": 2}}
    fedweave.run({**cfg2, "rounds": 2}, run_dir=tmp_path / "part")
    resumed = run_config(load({**cfg2, "rounds": 4}), run_dir=tmp_path / "part", resume=True)
    assert torch.equal(resumed.algorithm.x, full.algorithm.x)
    assert torch.equal(resumed.algorithm.download.store[REPLICA], full.algorithm.download.store[REPLICA])
    assert [r["bytes_down"] for r in resumed.metrics] == [r["bytes_down"] for r in full.metrics]


@pytest.mark.parametrize(
    "download, alg, expect",
    [
        ({"name": "topk"}, "fedavg", "compression.download: give exactly one of k (values kept) and ratio"),
        ({"name": "nosuch"}, "fedavg", "compression.download.name: unknown compressor 'nosuch'"),
        ({"name": "topk", "k": 10_000}, "fedavg", "compression.download.k (10000) exceeds the 148 values of a message"),
        ("efsign", "fedmim", "compression.download: algorithm 'fedmim' (centralized) does not compress its down"),
        ("efsign", "feddyn", "compression.download: algorithm 'feddyn' (centralized) does not compress its down"),
        ("efsign", "fedprox", "compression.download: algorithm 'fedprox' (centralized) does not compress its down"),
        ("efsign", "fedprox", "downloads yet (its clients' rule or update reads the server's model, not only where"),
        # the reason an asynchronous method gives is its own, not the synchronous methods' rule
        ("efsign", "fedbuff", "downloads yet (its asynchronous rounds keep no per-client copy of the server's model)"),
        ("efsign", "fedasync", "downloads yet (its asynchronous rounds keep no per-client copy of the server's model)"),
    ],
)
def test_bad_download_compression_config_is_one_line(download, alg, expect):
    with pytest.raises(ConfigError) as e:
        _algo({**_cfg(alg), "compression": {"download": download}})
    assert expect in str(e.value) and "\n" not in str(e.value)


def test_the_hierarchical_family_and_flower_refuse_compressed_downloads(tmp_path, monkeypatch, capsys):
    with pytest.raises(
        ConfigError, match=r"compression.download: algorithm 'hier_fedavg' \(hierarchical\) does not"
    ) as e:
        _algo({**_hier("hier_fedavg", None), "compression": {"download": "efsign"}})
    assert "downloads yet; fedavg" in str(e.value)  # no reason borrowed from the centralized methods
    monkeypatch.chdir(tmp_path)
    cfg = {**_cfg("fedavg"), "dataset": {"name": "_toy"}, "partition": {"name": "iid", "num_clients": 4}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    assert cli_main(["flower-app", "c.yaml", "app", "compression.download=efsign"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "compression.download: compressed downloads cannot be deployed on Flower" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]


def test_compressed_downloads_compose_with_the_other_server_stages(tmp_path):
    """Downloads and uploads compressed, a quarter of the clients flipping their updates, the median at the
    server: every stage runs (the attack on the updates measured from what the clients held), the run stays
    finite and each direction is billed below its dense bytes."""
    stages = {
        "compression": {"download": {"name": "topk", "ratio": 0.2}, "upload": {"name": "qsgd", "levels": 8}},
        "faults": {"byzantine": {"clients": [1, 5], "attack": "sign_flip"}},
        "aggregator": "median",
    }
    dense = fedweave.run({**_cfg("fedadam", rounds=3), **{k: v for k, v in stages.items() if k != "compression"}},
                         run_dir=tmp_path / "dense").metrics  # fmt: skip
    got = fedweave.run({**_cfg("fedadam", rounds=3), **stages}, run_dir=tmp_path / "all").metrics
    assert all(math.isfinite(m["test_loss"]) for m in got)
    assert sum(m["byzantine_clients"] for m in got) == sum(m["byzantine_clients"] for m in dense) > 0
    for way in ("bytes_down", "bytes_up"):
        assert 0 < got[-1][way] < dense[-1][way] / 2, way


def test_a_non_finite_message_leaves_the_error_feedback_residual_as_it_was():
    """e_{t+1} = e_t + x_t - C(e_t + x_t) (Karimireddy et al. 2019, Alg. 2), by hand over 3 rounds with top-1 on
    two clients; in round 2 client 0's local training gave NaN. Its NaN row still reaches the server (a robust
    aggregator drops it, a plain mean stops the run), but its residual keeps e_2 instead of turning NaN for good:
    round 3 sends e_2 + x_3 as a client that skipped round 2 would."""
    from types import SimpleNamespace

    from fedweave.compression import UploadCompression
    from fedweave.execution.placement import CPU

    ledger = SimpleNamespace(store=lambda *a: None)
    ctx = SimpleNamespace(dtype=torch.float32, placement=CPU, ledger=ledger, seeds=Seeds(0), float_bytes=4)
    up = UploadCompression(TopK(k=1), 3, 2, ctx)
    clients = np.array([0, 1])
    x1 = torch.tensor([[3.0, 1.0, -2.0], [0.5, -4.0, 1.0]])
    out, _ = up.transmit(1, clients, 0, "update", x1)
    assert torch.equal(out, torch.tensor([[3.0, 0.0, 0.0], [0.0, -4.0, 0.0]]))
    e1 = torch.tensor([[0.0, 1.0, -2.0], [0.5, 0.0, 1.0]])
    assert torch.equal(up.store.rows("update", clients), e1)
    x2 = torch.tensor([[math.nan, 0.0, 0.0], [0.0, 0.0, 2.0]])
    out, _ = up.transmit(2, clients, 0, "update", x2)
    assert torch.isnan(out[0]).any() and torch.equal(out[1], torch.tensor([0.0, 0.0, 3.0]))
    e2 = torch.tensor([[0.0, 1.0, -2.0], [0.5, 0.0, 0.0]])
    assert torch.equal(up.store.rows("update", clients), e2)  # client 0 keeps e_1: the NaN message is not folded in
    x3 = torch.tensor([[0.0, 0.0, 0.5], [-1.0, 0.0, 0.0]])
    out, _ = up.transmit(3, clients, 0, "update", x3)
    assert torch.equal(out, torch.tensor([[0.0, 0.0, -1.5], [-0.5, 0.0, 0.0]]))  # top-1 of e_2 + x_3
    assert torch.equal(up.store.rows("update", clients), torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_int8_stays_finite_and_unbiased_where_the_range_leaves_the_float_range(dtype):
    """A finite vector whose max - min overflows (float32: [-3e38, 3e38]) decoded to NaN (0 * inf); its 256
    levels still lie between its finite bounds, and the rounding is still unbiased."""
    big = torch.finfo(dtype).max * 0.9
    v = torch.tensor([-big, -big / 3, 0.0, big / 7, big], dtype=dtype)
    draws = _draws(Int8(), v, 4000)
    assert torch.isfinite(draws).all()
    assert torch.equal(draws[:, 0], v[0].expand(len(draws))) and torch.equal(draws[:, -1], v[-1].expand(len(draws)))
    # in units of big (the sum of 4000 draws would overflow float64 too): the step is 1.8 / 255, sd <= step / 2
    mean = (draws.double() / big).mean(0)
    assert ((mean - v.double() / big).abs() <= 5 * (1.8 / 255 / 2) / math.sqrt(len(draws))).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_efsign_scale_stays_finite_where_the_l1_sum_leaves_the_float_range(dtype):
    """||v||_1 / d (Karimireddy et al. 2019, Alg. 1) of [0.9 max, 0.9 max, -0.9 max] is 0.9 max, a float; the sum
    overflowed and the scale was inf."""
    big = torch.finfo(dtype).max * 0.9
    v = torch.tensor([big, big, -big], dtype=dtype)
    c = EFSign()
    out = c.decode(c.encode(v, None))
    assert torch.isfinite(out).all()
    assert torch.allclose(out / big, torch.tensor([1.0, 1.0, -1.0], dtype=dtype))
