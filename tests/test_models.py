"""Model zoo: shapes, parameter counts from the specs, functional/vmap use, determinism, validation."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from fedweave.models import HasHead, build_model, count_parameters, has_head, layer_parameter_names
from fedweave.registry import MODELS, UnknownNameError

IMAGE_MODELS = [
    "cnn_cifar",
    "cnn_femnist",
    "cnn_fmnist",
    "cnn_mnist",
    "cnn_small",
    "logistic",
    "mlp",
    "resnet18_gn",
    "resnet18_gn_cifarstem",
]
MNIST, CIFAR = (1, 28, 28), (3, 32, 32)


def _input(name: str, shape: tuple[int, ...], batch: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if name == "char_lstm":
        return torch.randint(0, 80, (batch, *shape), generator=g)
    return torch.randn(batch, *shape, generator=g)


def _build(name: str, shape: tuple[int, ...], classes: int = 10, **opts) -> nn.Module:
    torch.manual_seed(0)
    return build_model(name, shape, classes, **opts)


def _cases() -> list[tuple[str, tuple[int, ...], int]]:
    return [(n, s, 10) for n in IMAGE_MODELS for s in (MNIST, CIFAR)] + [("char_lstm", (80,), 80)]


def test_registry_lists_every_model() -> None:
    # Other packages (and test fixtures) may register more models; the zoo's own must all be there.
    assert set(IMAGE_MODELS) | {"char_lstm"} <= set(MODELS.names())
    with pytest.raises(UnknownNameError, match="Did you mean 'cnn_mnist'"):
        build_model("cnn_mnst", MNIST, 10)


@pytest.mark.parametrize(("name", "shape", "classes"), _cases())
def test_logit_shape_float32_no_buffers(name: str, shape: tuple[int, ...], classes: int) -> None:
    model = _build(name, shape, classes)
    out = model(_input(name, shape, 2))
    assert out.shape == (2, classes) and out.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert list(model.buffers()) == []
    # BatchNorm would carry running statistics and Dropout randomness; neither may appear (vmap, averaging).
    banned = (nn.modules.batchnorm._NormBase, nn.modules.dropout._DropoutNd, nn.LSTM, nn.RNNBase)
    assert not [m for m in model.modules() if isinstance(m, banned)]


# Counts the specs state, with the section that states them.
SPEC_COUNTS = [
    ("cnn_fmnist", MNIST, 10, {}, 28_938),  # afind-plus §4.3: 416 + 12,832 + 15,690
    ("cnn_cifar", CIFAR, 10, {}, 878_538),  # afind-plus §4.3 and §9.2: 2,432 + 51,264 + 819,712 + 5,130
    ("cnn_femnist", MNIST, 62, {}, 6_603_710),  # afind-plus §4.3: 832 + 51,264 + 6,424,576 + 127,038
    ("resnet18_gn", CIFAR, 10, {}, 11_181_642),  # fedmim §4.4
    ("resnet18_gn", CIFAR, 100, {}, 11_227_812),  # fedmim §4.4
    ("resnet18_gn", (3, 64, 64), 200, {}, 11_279_112),  # fedmim §4.4 (TinyImageNet)
    ("resnet18_gn_cifarstem", CIFAR, 10, {}, 11_173_962),  # fedmim §4.4 "Alternative"
    ("mlp", (32,), 10, {"hidden": [64]}, 2_762),  # fedmim §9.2: MLP 32 → 64 → 10
    ("logistic", MNIST, 10, {"bias": False}, 7_840),  # zo-hfl §4.3: d = 784·10
    ("logistic", CIFAR, 10, {"bias": False}, 30_720),  # zo-hfl §4.3: d = 3072·10
    ("logistic", (64,), 10, {"bias": False}, 640),  # zo-hfl §9.2: load_digits, W ∈ R^{64×10}
]


@pytest.mark.parametrize(("name", "shape", "classes", "opts", "expected"), SPEC_COUNTS)
def test_parameter_counts_from_specs(name, shape, classes, opts, expected) -> None:
    assert count_parameters(_build(name, shape, classes, **opts)) == expected


def test_resnet18_cifarstem_gn32_cifar100_is_about_11_22m() -> None:
    # afind-plus §4.3: CIFAR-100 ResNet-18 (CIFAR stem, GroupNorm 32 groups) "≈ 11.22 M".
    model = _build("resnet18_gn_cifarstem", CIFAR, 100, groups=32)
    assert count_parameters(model) == 11_220_132
    norms = [m for m in model.modules() if isinstance(m, nn.GroupNorm)]
    assert len(norms) == 1 + 4 * 2 * 2 + 3 and all(m.num_groups == 32 for m in norms)
    assert all(m.num_groups == 2 for m in _build("resnet18_gn", CIFAR).modules() if isinstance(m, nn.GroupNorm))


def test_hand_computed_counts() -> None:
    # cnn_mnist on 28×28, no padding: 28 -conv5-> 24 -pool-> 12 -conv5-> 8 -pool-> 4, so 64·4·4 = 1024 features.
    # conv1 1·32·25 + 32 = 832; conv2 32·64·25 + 64 = 51,264; fc1 1024·512 + 512 = 524,800;
    # fc2 512·10 + 10 = 5,130; total 582,026.
    assert count_parameters(_build("cnn_mnist", MNIST)) == 832 + 51_264 + 524_800 + 5_130 == 582_026
    # padding 2 ('same', McMahan et al.): 64·7·7 = 3136 features; fc1 3136·512 + 512 = 1,606,144.
    assert count_parameters(_build("cnn_mnist", MNIST, padding=2)) == 832 + 51_264 + 1_606_144 + 5_130
    # cnn_small: conv1 1·16·25 + 16 = 416; conv2 16·32·25 + 32 = 12,832; 32·4·4 = 512 features;
    # fc1 512·64 + 64 = 32,832; fc2 64·10 + 10 = 650.  CIFAR: conv1 3·16·25 + 16 = 1,216, 32·5·5 = 800.
    assert count_parameters(_build("cnn_small", MNIST)) == 416 + 12_832 + 32_832 + 650 == 46_730
    assert count_parameters(_build("cnn_small", CIFAR)) == 1_216 + 12_832 + (800 * 64 + 64) + 650 == 65_962
    # char_lstm (LEAF, vocab 80): embedding 80·8; layer 1: 8·1024 + 1024 + 256·1024; layer 2:
    # 256·1024 + 1024 + 256·1024; fc 256·80 + 80.
    lstm = 640 + (8 * 1024 + 1024 + 256 * 1024) + (256 * 1024 + 1024 + 256 * 1024) + 256 * 80 + 80
    assert count_parameters(_build("char_lstm", (80,), 80)) == lstm == 817_872
    # logistic with bias on MNIST: 784·10 + 10; mlp 784 → 64 → 10 (afind-plus §9.1): 50,240 + 650.
    assert count_parameters(_build("logistic", MNIST)) == 7_850
    assert count_parameters(_build("mlp", MNIST)) == 50_890
    assert count_parameters(_build("mlp", (64,), hidden=[64, 64])) == 64 * 64 * 2 + 128 + 650


def test_featurizer_and_classifier_layers() -> None:
    def size(model: nn.Module, role: str) -> int:
        params = dict(model.named_parameters())
        return sum(params[n].numel() for n in layer_parameter_names(model, role))

    # afind-plus §4.3: ϕ = fc1 of the CIFAR CNN, 819,712 params; ResNet-18 ϕ = layer4[-1] conv2 + GN affine
    # (512·512·9 + 2·512 ≈ 2.36 M), classifier 51,300 for 100 classes.
    assert size(_build("cnn_cifar", CIFAR), "featurizer") == 819_712
    resnet = _build("resnet18_gn_cifarstem", CIFAR, 100, groups=32)
    assert size(resnet, "featurizer") == 512 * 512 * 9 + 2 * 512
    assert size(resnet, "classifier") == 51_300
    # afind-plus §9.1: MLP ϕ = the hidden layer (784×64 + 64); §4.3: FMNIST CNN featurizer = conv2.
    assert size(_build("mlp", MNIST), "featurizer") == 784 * 64 + 64
    assert layer_parameter_names(_build("cnn_fmnist", MNIST), "featurizer") == ["conv2.weight", "conv2.bias"]
    # with norm: batch the features leave conv2 through bn2, whose affine weights end the layer (as ResNet's
    # norm2 ends its featurizer); before, the featurizer stopped at conv2 and the proxy left bn2 out
    batch = _build("cnn_fmnist", MNIST, norm="batch")
    assert layer_parameter_names(batch, "featurizer") == ["conv2.weight", "conv2.bias", "bn2.weight", "bn2.bias"]


# The CIFAR-stem ResNet keeps full-resolution maps in its first stage: a small input keeps these fast.
HEAD_CASES = [(n, (3, 8, 8) if n.startswith("resnet") else s, c) for n, s, c in _cases() if s != MNIST]


def test_every_registered_model_follows_the_features_and_head_convention() -> None:
    """Every model of the zoo (fedweave's own registrations) has a head, or says why it has none."""
    zoo = [n for n in MODELS.names() if MODELS.get(n).__module__.startswith("fedweave.")]
    assert set(zoo) == set(IMAGE_MODELS) | {"char_lstm"}  # a new model is added to the cases above
    for name in zoo:
        model = _build(name, *next((s, c) for n, s, c in HEAD_CASES if n == name))
        assert has_head(model) or (not isinstance(model, HasHead) and model.no_head), name


@pytest.mark.parametrize(("name", "shape", "classes"), HEAD_CASES)
def test_features_and_head_compose_to_the_model_bit_for_bit(name: str, shape: tuple[int, ...], classes: int):
    model = _build(name, shape, classes)
    x = _input(name, shape, 3)
    z = model.features(x)
    assert z.ndim == 2 and z.shape[0] == 3
    assert torch.equal(model.head(z), model(x))
    # head_names() are exactly the parameters the head uses: a loss on head(z) reaches those and no others
    z = z.detach().requires_grad_()
    model.head(z).square().sum().backward()
    touched = [n for n, p in model.named_parameters() if p.grad is not None]
    assert touched == model.head_names() and touched == layer_parameter_names(model, "classifier")


def _perturbed(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: p.detach() + 0.05 * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


# The CIFAR-stem ResNet keeps full-resolution maps in its first stage: use a small input to stay fast.
FUNCTIONAL_CASES = [c for c in _cases() if not c[0].startswith("resnet")] + [
    ("resnet18_gn", CIFAR, 10),
    ("resnet18_gn_cifarstem", (3, 8, 8), 10),
]


@pytest.mark.parametrize(("name", "shape", "classes"), FUNCTIONAL_CASES)
def test_functional_call_equals_module_call(name: str, shape: tuple[int, ...], classes: int) -> None:
    model = _build(name, shape, classes)
    x = _input(name, shape, 2)
    params = _perturbed(model, 1)
    out = functional_call(model, params, (x,))
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(params[n])
        ref = model(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


VMAP_CASES = [
    ("logistic", MNIST, 10),
    ("mlp", MNIST, 10),
    ("cnn_small", MNIST, 10),
    ("cnn_fmnist", MNIST, 10),
    ("resnet18_gn", (3, 16, 16), 10),
    ("char_lstm", (12,), 80),
]


@pytest.mark.parametrize(("name", "shape", "classes"), VMAP_CASES)
def test_vmap_over_clients_equals_separate_calls(name: str, shape: tuple[int, ...], classes: int) -> None:
    model = _build(name, shape, classes)
    sets = [_perturbed(model, s) for s in range(3)]
    stacked = {n: torch.stack([s[n] for s in sets]) for n in sets[0]}
    xs = torch.stack([_input(name, shape, 4, seed=s) for s in range(3)])  # (clients, B, *shape)
    out = vmap(lambda p, x: functional_call(model, p, (x,)))(stacked, xs)
    for c in range(3):
        torch.testing.assert_close(out[c], functional_call(model, sets[c], (xs[c],)), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["mlp", "char_lstm"])
def test_vmap_of_grad_equals_separate_grads(name: str) -> None:
    # The engine batches clients as vmap(grad(loss)); the LSTM is the model that needed care.
    shape, classes = ((10,), 80) if name == "char_lstm" else (MNIST, 10)
    model = _build(name, shape, classes, hidden=16) if name == "char_lstm" else _build(name, shape)
    sets = [_perturbed(model, s) for s in range(3)]
    stacked = {n: torch.stack([s[n] for s in sets]) for n in sets[0]}
    xs = torch.stack([_input(name, shape, 4, seed=s) for s in range(3)])
    ys = torch.randint(0, classes, (3, 4), generator=torch.Generator().manual_seed(9))

    def loss(p, x, y):
        return nn.functional.cross_entropy(functional_call(model, p, (x,)), y)

    batched = vmap(grad(loss))(stacked, xs, ys)
    for c in range(3):
        single = grad(loss)(sets[c], xs[c], ys[c])
        for n in single:
            torch.testing.assert_close(batched[n][c], single[n], rtol=1e-4, atol=1e-6)


def test_char_lstm_matches_torch_lstm() -> None:
    # Known answer: copy the weights into nn.LSTM (same gate order i, f, g, o); the second bias carries
    # LEAF's constant forget_bias on the forget-gate slice.
    hidden, vocab = 16, 30
    model = _build("char_lstm", (7,), vocab, hidden=hidden)
    ref = nn.LSTM(8, hidden, num_layers=2, batch_first=True)
    with torch.no_grad():
        for k, layer in enumerate(model.lstm):
            getattr(ref, f"weight_ih_l{k}").copy_(layer.ih.weight)
            getattr(ref, f"weight_hh_l{k}").copy_(layer.hh.weight)
            getattr(ref, f"bias_ih_l{k}").copy_(layer.ih.bias)
            bias_hh = torch.zeros(4 * hidden)
            bias_hh[hidden : 2 * hidden] = 1.0
            getattr(ref, f"bias_hh_l{k}").copy_(bias_hh)
        x = torch.randint(0, vocab, (3, 7), generator=torch.Generator().manual_seed(0))
        seq, _ = ref(model.embedding(x))
        torch.testing.assert_close(model(x), model.fc(seq[:, -1]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["mlp", "cnn_small", "resnet18_gn_cifarstem", "char_lstm"])
def test_deterministic_init(name: str) -> None:
    shape, classes = ((20,), 80) if name == "char_lstm" else (CIFAR, 10)

    def flat(m: nn.Module) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in m.parameters()])

    torch.manual_seed(5)
    a = flat(build_model(name, shape, classes))
    torch.manual_seed(5)
    b = flat(build_model(name, shape, classes))
    torch.manual_seed(6)
    c = flat(build_model(name, shape, classes))
    assert torch.equal(a, b) and not torch.equal(a, c)
    # With a generator: reproducible from it, and the global RNG stream is left untouched.
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    d = flat(build_model(name, shape, classes, generator=torch.Generator().manual_seed(1)))
    assert torch.equal(torch.random.get_rng_state(), before)
    e = flat(build_model(name, shape, classes, generator=torch.Generator().manual_seed(1)))
    assert torch.equal(d, e)


def test_init_options() -> None:
    zeros = _build("logistic", MNIST, init="zeros")  # zo-hfl §9.2: x̂_0 = 0
    assert all(torch.count_nonzero(p) == 0 for p in zeros.parameters())
    # fedmim §9.2: W1 ~ N(0, 2/32), W2 ~ N(0, 1/64), zero biases. Use a wide layer to check the std.
    mlp = _build("mlp", (32,), hidden=[4096], init="normal_fan_in")
    assert torch.count_nonzero(mlp.hidden[0].bias) == 0 and torch.count_nonzero(mlp.out.bias) == 0
    assert abs(mlp.hidden[0].weight.std().item() - (2 / 32) ** 0.5) < 0.01 * (2 / 32) ** 0.5 * 5
    assert abs(mlp.out.weight.std().item() - (1 / 4096) ** 0.5) < 0.05 * (1 / 4096) ** 0.5


@pytest.mark.parametrize(
    ("name", "shape", "opts", "pattern"),
    [
        ("mlp", MNIST, {"hiden": [8]}, r"unknown option model\.hiden.*allowed options: model\.bias"),
        ("mlp", MNIST, {"hidden": [8, 0]}, r"model\.hidden = \[8, 0\].*allowed: a positive int"),
        ("mlp", MNIST, {"hidden": "64"}, r"model\.hidden"),
        ("logistic", MNIST, {"bias": "no"}, r"model\.bias = 'no'.*true or false"),
        ("logistic", MNIST, {"init": "xavier"}, r"model\.init.*'torch'.*'zeros'"),
        ("cnn_mnist", MNIST, {"padding": 1}, r"model\.padding = 1.*0 .* or 2"),
        ("cnn_small", MNIST, {"padding": 2}, r"unknown option model\.padding.*allowed options: model\.norm$"),
        ("resnet18_gn", CIFAR, {"groups": 3}, r"model\.groups = 3.*\[1, 2, 4, 8, 16, 32, 64\]"),
        ("resnet18_gn", CIFAR, {"stem": "tiny"}, r"model\.stem = 'tiny'.*'imagenet'.*'cifar'"),
        ("char_lstm", (80,), {"hidden": 0}, r"model\.hidden = 0"),
        ("char_lstm", (80,), {"num_layers": 1.5}, r"model\.num_layers = 1\.5"),
        # a float equal to an allowed int used to pass the check and fail in torch without naming the option
        ("cnn_mnist", MNIST, {"padding": 2.0}, r"model\.padding = 2\.0 .*0 .* or 2"),
        ("resnet18_gn", CIFAR, {"groups": 2.0}, r"model\.groups = 2\.0 .*\[1, 2, 4, 8, 16, 32, 64\]"),
        # a NaN forget bias used to build a model whose every logit is NaN
        ("char_lstm", (80,), {"forget_bias": float("nan")}, r"model\.forget_bias = nan .*a finite number"),
    ],
)
def test_bad_options_name_the_option(name, shape, opts, pattern) -> None:
    with pytest.raises(ValueError, match=pattern):
        build_model(name, shape, 10, **opts)


def test_bad_shapes_and_classes() -> None:
    with pytest.raises(ValueError, match=r"input_shape must be \(channels, height, width\)"):
        build_model("cnn_small", (784,), 10)
    with pytest.raises(ValueError, match="too small"):
        build_model("cnn_mnist", (1, 8, 8), 10)
    # the line names the input and the least size the two conv + pool stages take (it used to say only
    # "spatial size 2 is too small for kernel 5", the size after the first stage, for 8x8 digits)
    with pytest.raises(ValueError, match=r"input_shape \(1, 8, 8\) is too small.*at least 16×16 pixels"):
        build_model("cnn_small", (1, 8, 8), 10)
    with pytest.raises(ValueError, match=r"input_shape \(1, 3, 40\) is too small.*padding 2.*at least 4×4"):
        build_model("cnn_fmnist", (1, 3, 40), 10)
    assert build_model("cnn_small", (1, 16, 16), 10)(torch.randn(2, 1, 16, 16)).shape == (2, 10)
    assert build_model("cnn_femnist", (1, 4, 4), 10)(torch.randn(2, 1, 4, 4)).shape == (2, 10)
    with pytest.raises(ValueError, match="num_classes must be a positive int"):
        build_model("logistic", MNIST, 0)
    with pytest.raises(ValueError, match="input_shape"):
        build_model("char_lstm", (1, 80), 80)
    # Any spatial size that survives the two conv + pool stages works, e.g. 12×12 with padding 2.
    assert build_model("cnn_fmnist", (3, 12, 12), 5)(torch.randn(2, 3, 12, 12)).shape == (2, 5)


def test_numpy_integers_are_integers() -> None:
    # a dataset of one's own often computes its classes as y.max() + 1, a NumPy integer: it used to be refused
    # as "num_classes must be a positive int, got np.int64(10)"
    import numpy as np

    ten, shape = np.int64(10), tuple(np.array(MNIST))
    for name in ("logistic", "mlp", "cnn_small", "resnet18_gn"):
        assert count_parameters(_build(name, shape, ten)) == count_parameters(_build(name, MNIST, 10)), name
    assert count_parameters(_build("mlp", MNIST, hidden=[np.int64(64)])) == 50_890
    assert count_parameters(_build("char_lstm", (np.int64(80),), np.int64(80), hidden=np.int32(256))) == 817_872
    with pytest.raises(ValueError, match="num_classes must be a positive int"):
        build_model("logistic", MNIST, np.bool_(True))


@pytest.mark.parametrize("name", ["cnn_mnist", "cnn_small", "cnn_fmnist"])
def test_two_conv_cnn_equals_the_textbook_layer_order_bit_for_bit(name):
    """The CNNs apply each ReLU after its max-pool (cheaper); values and gradients must be those of
    conv -> ReLU -> pool exactly."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = build_model(name, MNIST, 10)

    def textbook(x):
        x = F.max_pool2d(F.relu(model.conv1(x)), 2)
        x = F.max_pool2d(F.relu(model.conv2(x)), 2).reshape(x.shape[0], -1)
        for fc in model.fcs[:-1]:
            x = F.relu(fc(x))
        return model.fcs[-1](x)

    x, y = torch.randn(16, *MNIST), torch.randint(0, 10, (16,))
    grads = []
    for f in (model, textbook):
        model.zero_grad()
        out = f(x)
        F.cross_entropy(out, y).backward()
        grads.append((out.detach(), [p.grad.clone() for p in model.parameters()]))
    (out_a, g_a), (out_b, g_b) = grads
    assert torch.equal(out_a, out_b)
    assert all(torch.equal(a, b) for a, b in zip(g_a, g_b))


def test_a_token_id_beyond_the_vocabulary_is_refused_when_the_run_is_built(tmp_path) -> None:
    import fedweave
    from fedweave.config import ConfigError

    # the vocabulary is num_classes (10); one id of 12, in a sample the two trial samples miss, used to pass the
    # build and fail in round 1 with torch's "index out of range in self"
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 10, (64, 20), generator=g), torch.arange(64) % 10
    x[40, 3] = 12
    cfg = {"rounds": 1, "model": {"name": "char_lstm"}, "partition": {"name": "iid", "num_clients": 2}}
    cfg |= {"algorithm": {"name": "fedavg", "clients_per_round": 2}, "output": {"progress": False, "plots": False}}
    with pytest.raises(ConfigError, match=r"char_lstm.*does not fit.*ids 0\.\.12.*index out of range"):
        fedweave.run(cfg, dataset=(x, y, x, y), run_dir=tmp_path / "r")


def test_split_smalls_second_pool_follows_the_height_its_docstring_names():
    # the docstring said "8 pixels wide" where the code reads the height: a tall narrow and a short wide map differ
    from fedweave.models.split import split_small

    assert split_small((1, 16, 40), 10).cut_shape == (32, 4, 10)  # 8 high after the first pool: pooled again
    assert split_small((1, 8, 40), 10).cut_shape == (32, 4, 20)  # 4 high, 20 wide: not
    assert "pixels high" in split_small.__doc__
