"""The ``privacy`` section on the star template: which methods and samplers it allows, and with what
sampling rate the accountant is told each round was drawn.

Sampling must match the proof (docs/privacy.md). Opacus's accountants bound the Poisson-subsampled Gaussian
mechanism: ``sampler: bernoulli`` (each client independently with probability q = clients_per_round / N) is
accounted with that q. Neither accountant bounds a fixed-size uniform sample without replacement, so
``sampler: uniform`` (the default) is refused unless ``privacy.amplification: none``, which accounts every
round with q = 1 (no amplification: always valid, more epsilon). A fixed set of clients or a fixed schedule
gets q = 1. A sampler that chooses by the clients' losses would leak them through who takes part: refused.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
from torch.nn.modules.batchnorm import _BatchNorm

from fedweave.config import ConfigError, PrivacyConfig
from fedweave.privacy.accountant import Accountant, against_target, below_floor, calibrate
from fedweave.privacy.buffered import BufferedDP
from fedweave.privacy.ftrl import FTRLDP, planned_sensitivity
from fedweave.privacy.mechanism import UserDP
from fedweave.privacy.sample import AccountedTrainer, SampleDP, sample_rates

NO_AMPLIFICATION = ("fixed", "schedule")  # the samplers whose clients are known in advance: q = 1

log = logging.getLogger(__name__)


def check_delta(cfg: PrivacyConfig, n: int, units: str) -> None:
    """One warning when ``privacy.delta`` is not below 1/n, n the number of protected ``units`` (the clients at
    user level, the training samples at sample level): publishing one unit's data in the clear, chosen at random,
    is (0, 1/n)-DP, so an epsilon at such a delta rules out no disclosure (Dwork and Roth 2014, §2.3). Allowed
    (the config may mean it), but rarely meant."""
    if n > 0 and cfg.delta >= 1 / n:
        log.warning(
            "privacy.delta %g is not below 1/n = %.3g (n = %d %s): publishing one of them, drawn at random, in the "
            "clear is (0, 1/n)-DP, so epsilon at this delta guarantees little; choose delta well below 1/n",
            cfg.delta,
            1 / n,
            n,
            units,
        )


def sampling(
    cfg: PrivacyConfig, sampler: Any, per_round: int, num_clients: int, amplify: bool = True
) -> tuple[float, int | float]:
    """The sampling rate q the accountant is told and E, the expected number of clients of a round (a ``schedule``'s
    mean count); a sampler that does not match the accountant's proof is one ConfigError. ``amplify`` False (local
    DP, whose messages the server sees with their senders): q = 1 whatever the sampler."""
    name = sampler.name
    _loss_blind(sampler)
    expected = sampler.expected()  # per_round, fixed's count or the schedule's mean count
    if not amplify or cfg.amplification == "none" or name in NO_AMPLIFICATION or per_round >= num_clients:
        return 1.0, expected  # (every client every round: nothing to amplify, whatever the sampler)
    if name == "bernoulli":
        return per_round / num_clients, expected
    raise ConfigError(
        f"privacy: sampler {name!r} draws a fixed-size sample, for which Opacus's accountants (Poisson "
        "subsampling) give no bound; use sampler: bernoulli (accounted with q = clients_per_round / N) or "
        "privacy.amplification: none (accounted with q = 1)"
    )


def _loss_blind(sampler: Any) -> None:
    """A sampler that chooses clients by their losses is one ConfigError: who takes part would leak them."""
    if sampler.reads_context:
        raise ConfigError(
            f"privacy: sampler {sampler.name!r} chooses clients by their losses, which would leak through who takes "
            "part; use sampler: bernoulli"
        )


def make_privacy(
    algo: Any, per_round: int | None = None, num_clients: int | None = None, numels: list[int] | None = None
) -> UserDP | SampleDP | None:
    """The DP stages of a server-based algorithm from the run's ``privacy`` section (None without one); a
    method, sampler or setting the proof does not cover is one ConfigError naming ``privacy``. ``per_round``
    and ``num_clients``: the clients a round samples and the population (default: the star's
    ``clients_per_round`` and the partition's clients); ``numels``: the layers' sizes of a clipped update, for
    ``per_layer`` (default: the algorithm's layout)."""
    cfg: PrivacyConfig | None = algo.config.privacy
    if cfg is None:
        return None
    name = algo.config.algorithm.name
    if algo.dp_refusal:
        raise ConfigError(f"privacy: algorithm {name!r} is refused: {algo.dp_refusal}")
    if cfg.level == "user" and algo.config.algorithm.options.get("weighting") == "samples":
        # DP-FedBuff's weight is per upload, over its buffer (fedweave.privacy.buffered), not per expected client
        counts = (
            "each upload counts 1/K, K the algorithm.buffer_size"
            if getattr(algo, "asynchronous", False)
            else "each client counts 1/E, E the expected clients per round"
        )
        raise ConfigError(
            "privacy: algorithm.weighting: samples would weigh a client by its data size, which DP-FedAvg's bound "
            f"does not cover; leave it out ({counts})"
        )
    if getattr(algo.hp, "server_data", "none") == "client":
        raise ConfigError(
            "privacy: algorithm.server_data: client trains the server's share as one more client, outside the "
            "per-user bound; leave it at none"
        )
    if cfg.level == "user" and cfg.mechanism == "local" and algo.config.compression.upload is not None:
        # the compression stage encodes each upload before the clipping stage runs, so the local noise would be
        # added on the server to what already crossed the link un-noised: no local guarantee for the wire
        raise ConfigError(
            "privacy.mechanism: local noises each update at its client before it is sent, but compression.upload "
            "encodes the update before it is clipped and noised, so the server would receive it un-noised; use "
            "mechanism: central (the trusted server clips and noises the decoded updates) or remove "
            "compression.upload"
        )
    ctx = algo.ctx
    if getattr(algo, "asynchronous", False):  # DP-FedBuff: its own stages and per-client accounting
        return _buffered(algo, cfg)
    per_round = algo.hp.clients_per_round if per_round is None else per_round
    population = ctx.num_clients if num_clients is None else num_clients
    if cfg.mechanism == "ftrl" and algo.family != "centralized":
        raise ConfigError(
            f"privacy.mechanism: ftrl is supported in the centralized family, not in the {algo.family} family yet; "
            "use mechanism: central"
        )
    accountant = Accountant(cfg.accountant, cfg.delta)
    if cfg.level == "sample":
        if algo.family != "centralized":
            raise ConfigError(
                f"privacy.level: sample is not supported in the {algo.family} family yet; use level: user"
            )
        # each client is accounted by the DP-SGD steps it did, whoever drew it: the client sampler amplifies
        # nothing here and only has to be blind to the losses (privacy.amplification is about the batches)
        _loss_blind(algo.sampler)
        return _sample_level(algo, cfg, accountant)
    check_delta(cfg, population, "clients, the units user-level DP protects")
    # local DP and DP-FTRL get no amplification: q = 1 whatever the (loss-blind) sampler
    q, expected = sampling(cfg, algo.sampler, per_round, population, amplify=cfg.mechanism == "central")
    count_noise = cfg.count_noise if cfg.count_noise is not None else expected / 20  # Andrew et al.: m / 20
    z = cfg.noise_multiplier
    if z == "auto":  # the accounted multiplier that spends target_epsilon in the planned rounds
        local = cfg.mechanism == "local"
        if cfg.mechanism == "ftrl":  # the trees compose to one Gaussian of squared sensitivity sum_trees depth
            z = calibrate(cfg.accountant, cfg.target_epsilon, cfg.delta, 1.0, 1)
            z *= math.sqrt(planned_sensitivity(algo.config.rounds, cfg.restart_every))
        else:
            z = calibrate(cfg.accountant, cfg.target_epsilon, cfg.delta, 1.0 if local else q, algo.config.rounds)
            z = 2 * z if local else z  # local DP is accounted with z / 2 (sensitivity 2C)
    if cfg.adaptive and z and not 2 * count_noise > z:
        raise ConfigError(
            f"privacy.count_noise ({count_noise:g}) must exceed noise_multiplier / 2 ({z / 2:g}): adaptive clipping "
            "spends part of the noise on the count (Andrew et al. 2021, Theorem 1)"
        )
    kind: Any = UserDP
    extra: dict[str, Any] = {"mechanism": cfg.mechanism}
    if cfg.mechanism == "ftrl":  # DP-FTRL: the tree's prefix sums (fedweave.privacy.ftrl)
        kind, extra = FTRLDP, {"restart_every": cfg.restart_every, "momentum": cfg.momentum}
    dp = kind(
        **extra,
        clip=cfg.clip,
        z=z,
        expected=expected,
        sample_rate=q,
        seeds=ctx.seeds,
        accountant=accountant,
        numels=(numels or list(algo.layout.numels)) if cfg.per_layer else None,
        adaptive=cfg.adaptive,
        target_quantile=cfg.target_quantile,
        clip_lr=cfg.clip_lr,
        count_noise=count_noise,
    )
    if isinstance(dp, FTRLDP):  # the budget's look-ahead asks who the next round samples
        dp.upcoming = algo.sample_clients
    if dp.releases_empty_rounds and algo.sampler.name == "bernoulli":
        # Poisson sampling as the proof has it: an empty draw is kept (not drawn again) and released as noise
        if algo.sampler.options.get("redraw") is True:  # written in the config: refused, not replaced in silence
            raise ConfigError(
                "privacy: sampler.redraw: true draws a round again when nobody was drawn, which is not the Poisson "
                "sampling the accountant's amplification assumes; leave redraw out (the privacy section keeps the "
                "empty draw) or set privacy.amplification: none"
            )
        algo.sampler.options = {**algo.sampler.options, "redraw": False}
    check_first_release(cfg, dp)
    return dp


def _buffered(algo: Any, cfg: PrivacyConfig) -> BufferedDP:
    """DP-FedBuff (fedweave.privacy.buffered): user-level central DP, each client accounted by its uploads per
    server step, no amplification; what its proof does not cover is one ConfigError naming the key. The first
    step's look-ahead is checked by the method once its clock exists (:func:`check_first_release`)."""
    name = algo.config.algorithm.name
    for key, value, allowed in (
        ("level", cfg.level, "user"),
        ("mechanism", cfg.mechanism, "central"),
        ("adaptive", cfg.adaptive, False),
    ):
        if value != allowed:
            raise ConfigError(
                f"privacy.{key}: {name} supports user-level central DP only (each upload clipped, Gaussian noise on "
                f"the buffer's sum), not {key} {value}; use privacy.{key}: {allowed}"
            )
    if cfg.noise_multiplier == "auto":
        raise ConfigError(
            f"privacy.noise_multiplier: auto needs the clients' contributions in advance, which {name}'s schedule "
            "decides as it runs; set a noise_multiplier (privacy.target_epsilon then stops the run at the budget)"
        )
    check_delta(cfg, algo.ctx.num_clients, "clients, the units user-level DP protects")
    return BufferedDP(
        num_clients=algo.ctx.num_clients,
        clip=cfg.clip,
        z=cfg.noise_multiplier,
        expected=algo.hp.buffer_size,
        seeds=algo.ctx.seeds,
        accountant=Accountant(cfg.accountant, cfg.delta),
        numels=list(algo.layout.numels) if cfg.per_layer else None,
    )


def graph_privacy(algo: Any) -> SampleDP | None:
    """The ``privacy`` section in the decentralized family, which has no server to clip or noise at: sample-level
    DP-SGD at every client (AFIND+'s DP rule, ``dp_mode: sgd``), accounted per client. The algorithm's own
    ``dp_sigma``/``dp_clip``, when set, must be the section's: one noise, accounted once."""
    cfg: PrivacyConfig | None = algo.config.privacy
    if cfg is None:
        return None
    hp = algo.hp
    name = algo.config.algorithm.name
    # DP-SGD's epsilon bounds what a peer computes from its data through its private steps, nothing else: a score
    # of the neighbours' models on its own data, or a mask grown from a plain gradient, decides what it sends
    why = algo.dp_refusal
    if not why and getattr(hp, "selection", "random") != "random":
        why = f"algorithm.selection: {hp.selection} scores the neighbours' models on each peer's own data"
    if why:
        raise ConfigError(
            f"privacy: algorithm {name!r} reads each peer's data outside its DP-SGD steps ({why}), which the "
            "accountant does not count; use dfedavg, choco_sgd, ditto or local, with selection: random"
        )
    if cfg.level != "sample":
        raise ConfigError(
            "privacy: the decentralized family has no server to clip and noise the clients' updates; use "
            "privacy.level: sample (DP-SGD at every client)"
        )
    if hp.dp_sigma and hp.dp_mode != "sgd":
        raise ConfigError(
            f"privacy: algorithm.dp_mode: {hp.dp_mode} noises the exchanged models, which no accountant here covers; "
            "use dp_mode: sgd"
        )
    if hp.dp_sigma and (cfg.noise_multiplier, cfg.clip) != (hp.dp_sigma, hp.dp_clip):
        raise ConfigError(
            f"privacy: algorithm.dp_sigma/dp_clip ({hp.dp_sigma:g}/{hp.dp_clip:g}) differ from "
            f"privacy.noise_multiplier/"
            f"clip ({cfg.noise_multiplier}/{cfg.clip:g}); set the noise once (privacy.*, which is accounted)"
        )
    return _sample_level(algo, cfg, Accountant(cfg.accountant, cfg.delta))


def _sample_level(algo: Any, cfg: PrivacyConfig, accountant: Accountant) -> SampleDP:
    """DP-SGD at every client: the algorithm's trainer becomes a private one that counts steps."""
    if getattr(algo.hp, "sam_rho", 0) or algo.config.algorithm.name == "fedsam":
        raise ConfigError(
            f"privacy.level: sample with algorithm {algo.config.algorithm.name!r}: its SAM step takes two gradients "
            "per local step, which the accountant (one noisy gradient per step) does not count"
        )
    # DP-SGD takes each sample's gradient through the model applied to that sample alone: a BatchNorm layer would
    # then normalize every sample by its own statistics, another network than the one plain training and the
    # evaluation run on a whole batch (and batch statistics mix the samples, which per-sample clipping cannot bound)
    norms = sorted({type(m).__name__ for m in algo.trainer.layout.model.modules() if isinstance(m, _BatchNorm)})
    if norms:
        raise ConfigError(
            f"privacy.level: sample: the model has {', '.join(norms)} layers, whose batch statistics mix the samples "
            "of a batch, so DP-SGD's per-sample gradients would train another network; use a model without "
            "BatchNorm (model.norm: none for the cnn_* models) or privacy.level: user"
        )
    local = algo.config.local
    sizes = [len(p) for p in algo.ctx.partition]
    # one sample of one client is what differs between neighbouring datasets: the units are all clients' samples
    check_delta(cfg, sum(sizes), "training samples of all clients, the units sample-level DP protects")
    if local.steps is not None and not local.full_batch:
        # fixed-size batches cut from a stream of reshuffled epochs: a batch that spans two epochs (n not a multiple
        # of B, k B > n) can hold one sample twice, and that step's sum then moves by 2C, not the C accounted
        bs = local.batch_size
        for c, n in enumerate(sizes):
            k = algo.trainer.num_steps(c)
            if n and n % bs and k * bs > n:
                raise ConfigError(
                    f"privacy.level: sample with local.steps: client {c}'s {n} samples are reshuffled inside its "
                    f"{k} batches of {bs}, so one batch can hold a sample twice and move the step by more than "
                    "privacy.clip; use local.epochs (an epoch's batches are disjoint), local.full_batch: true, or "
                    "local.steps * local.batch_size <= each client's samples"
                )
    # the batches are a shuffled pass, not the Poisson batches Opacus's accountants assume: amplification: none
    # accounts each step at q = 1, a bound that holds for any batching (each step is the Gaussian mechanism on
    # whatever batch it drew); auto gives the usual q_i = B / n_i
    rates = sample_rates(sizes, local.batch_size, local.full_batch or cfg.amplification == "none")
    z = cfg.noise_multiplier
    if z == "auto":  # as if one client had the most steps and the largest rate (an upper bound for each)
        steps = max(algo.trainer.num_steps(c) for c in range(algo.ctx.num_clients)) * algo.config.rounds
        z = calibrate(cfg.accountant, cfg.target_epsilon, cfg.delta, float(rates.max()), steps)
    trainer = AccountedTrainer.of(algo.trainer, cfg.clip, z)
    trainer.steps_done = np.zeros(algo.ctx.num_clients, dtype=np.int64)
    trainer.steps_per_round = max(trainer.num_steps(c) for c in range(algo.ctx.num_clients))
    # each client's round of steps (none for a client without data), until a call shows it does more
    trainer.round_steps = np.array([trainer.num_steps(c) if n else 0 for c, n in enumerate(sizes)], dtype=np.int64)
    algo.trainer = trainer
    dp = SampleDP(trainer, z, rates, accountant)
    check_first_release(cfg, dp)
    return dp


def check_first_release(cfg: PrivacyConfig, dp: UserDP | SampleDP) -> None:
    """A target epsilon that the first round alone exceeds is a configuration error, not a run of no rounds."""
    if cfg.target_epsilon is None:
        return
    first = dp.epsilon_after_next()
    if first > cfg.target_epsilon:
        if floor := below_floor(cfg.accountant, cfg.target_epsilon, cfg.delta):  # no noise multiplier would do
            raise ConfigError(floor)
        shown, target = against_target(first, cfg.target_epsilon)
        shown = "inf (no noise)" if math.isinf(first) else shown
        raise ConfigError(
            f"privacy.target_epsilon ({target}) is exceeded by the first round alone (epsilon {shown}); "
            "raise privacy.noise_multiplier or use noise_multiplier: auto"
        )
