"""Exact, analytic checks of the split family (cse-fsl spec §9.1 and the §9.3 byte/storage tables)."""

from __future__ import annotations

import pytest

from fedweave.accounting.split import (
    CIFAR,
    FEMNIST,
    GIB,
    PAPER_SETUPS,
    PAPER_TABLE_V,
    SplitSizes,
    load_gib,
    round_bytes,
    server_copies,
    server_steps,
    storage_params,
    table_v_row,
    upload_batches,
)
from fedweave.models.split import build_split_model, count


def _parts(name, shape, classes, **opts):
    m = build_split_model(name, shape, classes, opts)
    return count(m.client), count(m.server), count(m.aux), m.smashed_floats


def test_paper_model_parameter_counts():
    # spec §9.1 item 1 / §4.2: to the unit
    assert _parts("split_cifar", (3, 24, 24), 10) == (107_328, 960_970, 23_050, 2304)
    assert _parts("split_cifar", (3, 24, 24), 10, pool="max2") == (107_328, 960_970, 23_050, 2304)
    assert _parts("split_femnist", (1, 28, 28), 62) == (18_816, 1_187_774, 571_454, 9216)
    assert _parts("split_femnist", (1, 28, 28), 62, client_relu=False)[:2] == (18_816, 1_187_774)
    assert (CIFAR.client, CIFAR.server, CIFAR.aux, CIFAR.smashed) == (107_328, 960_970, 23_050, 2304)
    assert (FEMNIST.client, FEMNIST.server, FEMNIST.aux, FEMNIST.smashed) == (18_816, 1_187_774, 571_454, 9216)


@pytest.mark.parametrize("c, expected", [(54, 22_960), (27, 11_485), (14, 5_960), (7, 2_985)])
def test_cifar_cnn_aux_table_iii(c, expected):
    assert _parts("split_cifar", (3, 24, 24), 10, aux="cnn", aux_channels=c)[2] == expected == 425 * c + 10


@pytest.mark.parametrize("c, expected", [(64, 575_614), (32, 287_838), (8, 72_006), (2, 18_048)])
def test_femnist_cnn_aux_table_iv(c, expected):
    assert _parts("split_femnist", (1, 28, 28), 62, aux="cnn", aux_channels=c)[2] == expected == 8993 * c + 62


def test_paper_preset_cifar_crop_gives_the_papers_q():
    # 32x32 CIFAR images with the 24x24 crop of the authors' pipeline: q = 2,304 (not 4,096), same sizes
    assert _parts("split_cifar", (3, 32, 32), 10, crop=24) == (107_328, 960_970, 23_050, 2304)
    assert _parts("split_cifar", (3, 32, 32), 10)[3] == 4096  # without the crop


@pytest.mark.parametrize(
    "name, shape, opts, expect",
    [
        # a bool or string used to reach torch (a TypeError naming no option: a traceback in a run); the
        # config-wide check (config.check_options) refuses them
        ("split_small", (1, 8, 8), {"hidden": "64"}, r"^model\.hidden must be an integer, got '64'$"),
        # crop: true was read as a 1x1 crop
        ("split_cifar", (3, 32, 32), {"crop": True}, r"^model\.crop must be int or null, got True$"),
        # an input the client layers shrink to nothing: the forward's RuntimeError, not this line
        ("split_femnist", (1, 4, 4), {}, r"^model 'split_femnist': input shape \(1, 4, 4\) is too small"),
        ("split_small", (1, 1, 1), {}, r"^model 'split_small': input shape \(1, 1, 1\) is too small"),
    ],
)
def test_bad_split_model_options_are_one_line_naming_the_option(name, shape, opts, expect):
    with pytest.raises(ValueError, match=expect):
        build_split_model(name, shape, 10, opts)


def test_an_allocation_failure_in_the_shape_probe_is_not_called_too_small():
    # the split family turns it into "does not fit in memory" (docs/reliability.md), so it must pass through
    import torch

    from fedweave.models.split import _cut_shape

    class Huge(torch.nn.Module):
        def forward(self, x):
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 10 bytes")

    with pytest.raises(RuntimeError, match="allocate"):
        _cut_shape(torch.nn.Sequential(Huge(), torch.nn.Flatten()), (1, 4, 4), "split_small")


def test_paper_models_default_to_the_authors_init_spec_a28():
    import torch

    torch.manual_seed(0)
    for name, shape, k in (("split_cifar", (3, 24, 24), 10), ("split_femnist", (1, 28, 28), 62)):
        m = build_split_model(name, shape, k)
        flat = torch.cat([p.detach().flatten() for part in (m.client, m.server, m.aux) for p in part.parameters()])
        assert abs(float(flat.mean())) < 1e-3 and float(flat.std()) == pytest.approx(0.05, rel=0.01), name
        bias = m.server[0].bias.detach()  # biases too: N(0, 0.05^2), PyTorch would give U(+-1/sqrt(q))
        assert float(bias.abs().max()) > 1 / 2304**0.5
    small = build_split_model("split_small", (1, 8, 8), 10)  # fedweave's own model keeps PyTorch's init
    w = small.server[0].weight.detach()
    assert float(w.abs().max()) <= 1 / 512**0.5 + 1e-7


def test_aux_percentages_tables_iii_iv():
    # "% of whole model" = |a| / (|x_c| + |x_s|)
    assert round(100 * 23_050 / CIFAR.whole, 2) == 2.16
    assert round(100 * 2_985 / CIFAR.whole, 2) == 0.28
    assert round(100 * 571_454 / FEMNIST.whole, 2) == 47.36
    assert round(100 * 287_838 / FEMNIST.whole, 2) == 23.86
    assert round(100 * 18_048 / FEMNIST.whole, 1) == 1.5


def test_digits_mini_model():
    # spec §9.3: client 9,568, q 512, aux 5,130, server 66,954
    assert _parts("split_small", (1, 8, 8), 10) == (9_568, 66_954, 5_130, 512)


@pytest.mark.parametrize("dataset", ["cifar10", "femnist"])
def test_table_v_loads_and_storage(dataset):
    for key, (_, _, load, storage) in PAPER_TABLE_V[dataset].items():
        got_load, got_storage = table_v_row(dataset, key)
        assert round(got_storage, 2) == storage, key
        if dataset == "femnist" and key in ("fsl_mc", "fsl_oc"):
            continue  # spec A21: the paper's baselines used ≈209 samples per client (checked below)
        assert round(got_load, 2) == load, key


def test_femnist_baseline_load_implies_209_samples():
    assert round(load_gib("fsl_mc", FEMNIST, [200] * 5, 10, 500), 2) == 34.68
    assert round(load_gib("fsl_mc", FEMNIST, [209] * 5, 10, 500), 2) == 36.23


def test_cifar_ten_clients_and_label_bytes():
    # spec §7.2 cross-check: with 10 clients (5,000 samples each) MC 173.26, CSE h=5 19.11 GiB
    assert round(load_gib("fsl_mc", CIFAR, [5000] * 10, 50, 200), 2) == 173.26
    assert round(load_gib("cse_fsl", CIFAR, [5000] * 10, 50, 200, h=5), 2) == 19.11
    # int64 labels would add 0.075 GiB to FSL_MC's 200 epochs
    assert round(round_bytes("fsl_mc", CIFAR, [10_000] * 5, 50)["labels"] * 200 / GIB, 3) == 0.075


def test_table_ii_savings_claims():
    s = PAPER_SETUPS["cifar10"]
    an, cse = storage_params("fsl_an", CIFAR, 5), storage_params("cse_fsl", CIFAR, 5)
    assert 1 - cse / an > 0.70  # ">70 %" storage saving over FSL_AN (CIFAR)
    assert round(1 - storage_params("cse_fsl", FEMNIST, 5) / storage_params("fsl_an", FEMNIST, 5), 3) == 0.534
    # streaming aggregation gives Table II's |w| + |a|
    assert storage_params("cse_fsl", CIFAR, 5, streaming=True) == CIFAR.whole + CIFAR.aux
    assert s["clients"] == 5


def test_spec_runtime_byte_example():
    # spec §9.2: CSE h=2, 5 clients × 200 samples, B=50 on the CIFAR model
    b = round_bytes("cse_fsl", CIFAR, [200] * 5, 50, h=2)
    assert b["smashed"] == 5 * 2 * 50 * 9216 == 4_608_000
    assert b["client_model"] + b["aux_model"] == 2 * 5 * (107_328 + 23_050) * 4 == 5_215_120
    mc = round_bytes("fsl_mc", CIFAR, [200] * 5, 50)
    assert mc["gradient"] == mc["smashed"]
    assert server_steps("cse_fsl", [200] * 5, 50, h=2) == 5 * (4 // 2)


DIGITS = SplitSizes(client=9_568, server=66_954, aux=5_130, smashed=512)


@pytest.mark.parametrize(
    "method, h, expected",
    [
        ("fsl_mc", 1, 6_117_120),
        ("fsl_oc", 1, 6_117_120),
        ("fsl_an", 1, 3_455_120),
        ("cse_fsl", 1, 3_455_120),
        ("cse_fsl", 2, 2_021_520),
        ("cse_fsl", 4, 1_304_720),
        ("cse_fsl", 7, 997_520),
        ("cse_fsl", 14, 792_720),
    ],
)
def test_digits_bytes_per_round(method, h, expected):
    # spec §9.3 table: 5 IID clients × 280 samples, B = 10
    assert round_bytes(method, DIGITS, [280] * 5, 10, h=h)["load"] == expected


@pytest.mark.parametrize(
    "n, mc, oc, an, cse",
    [(5, 382_610, 114_794, 408_260, 140_444), (2, 153_044, 86_090, 163_304, 96_350),
     (10, 765_220, 162_634, 816_520, 213_934)],
)  # fmt: skip
def test_digits_storage(n, mc, oc, an, cse):
    got = [storage_params(m, DIGITS, n) for m in ("fsl_mc", "fsl_oc", "fsl_an", "cse_fsl")]
    assert got == [mc, oc, an, cse]
    assert [server_copies(m, n) for m in ("fsl_mc", "fsl_oc", "fsl_an", "cse_fsl")] == [n, 1, n, 1]


def test_upload_windows():
    assert upload_batches(28, 4) == [3, 7, 11, 15, 19, 23, 27]
    assert len(upload_batches(10, 4)) == 2  # ⌊M/h⌋: trailing batches are not uploaded
    assert upload_batches(10, 4, "start") == [0, 4, 8]  # ⌈M/h⌉, Alg. 1 as written
    with pytest.raises(ValueError, match="upload_at"):
        upload_batches(10, 4, "middle")
    with pytest.raises(ValueError, match="unknown split method"):
        server_copies("fsl_xx", 3)


def test_upload_windows_restart_each_epoch():
    # E = 2 epochs of M_i = 7 batches, h = 4: Alg. 1's m restarts with each pass over D_i, so each epoch uploads
    # its batch 3 and trains its last 3 unsent (A27). Before, one run of windows over the 14 batches uploaded
    # batches 3, 7 and 11: a window held the end of one epoch and the start of the next
    assert upload_batches(14, 4, epoch=7) == [3, 10]
    assert upload_batches(14, 4, "start", epoch=7) == [0, 4, 7, 11]  # ⌈M_i/h⌉ per epoch
    assert upload_batches(14, 4) == [3, 7, 11]  # no epochs (local.steps): one run over the round
    assert server_steps("cse_fsl", [70, 40], 10, h=4, epochs=2) == 2 * 1 + 2 * 1
    assert round_bytes("cse_fsl", CIFAR, [70], 10, h=4, epochs=2)["labels"] == 2 * 10 * 8
    assert server_steps("cse_fsl", [80], 10, h=4, epochs=3) == 3 * 2  # h | M_i: the same as one run


@pytest.mark.parametrize(
    "kwargs, expect",
    [
        ({"batch_size": 0}, "batch_size must be >= 1, got 0"),
        ({"epochs": 0}, "epochs must be >= 1, got 0"),
        ({"samples": [100, -5]}, "samples must be >= 0, got -5"),
        ({"agg_every": 0}, "agg_every must be >= 1 or None, got 0"),
        ({"agg_every": -2}, "agg_every must be >= 1 or None, got -2"),
    ],
)
def test_closed_forms_refuse_bad_sizes_in_one_line(kwargs, expect):
    # a zero batch divided by zero, a negative agg_every gave negative model bytes, no epochs or a negative
    # client size silently billed no smashed data
    args = {"samples": [100, 60], "batch_size": 10, **kwargs}
    with pytest.raises(ValueError) as e:
        round_bytes("cse_fsl", CIFAR, args.pop("samples"), args.pop("batch_size"), **args)
    assert str(e.value) == expect
