"""The shared mechanics of decentralized FL (DFL): the protocol base of the family.

* The graph (who *can* talk) is ``fedweave.topology.graph``; which neighbours a client talks to in a round
  is sampled per round from the ``("neighbour_sampling", round, client)`` stream (part of the protocol).
* Synchronous, double-buffered rounds: every algorithm reads the round-start models ``W`` (an ``(N, P)``
  tensor in a :class:`StateStore`) and commits a new tensor at the end of the round, so no client ever sees
  a neighbour's half-updated model.
* Every peer-to-peer transfer is a ledger entry ``peer -> peer`` with its exact bytes (kinds ``model``,
  ``feature_proxy``, ``loss``, ``mask``, ...).
* What a peer holds beyond its own model is ledger storage of role ``client``, per peer as the star family's
  per-client storage, each figure the peak over peers and rounds (:meth:`GraphAlgorithm.hold`): the method's
  state where it is created, the neighbours' models it gathers in a round (``received_models``), the buffer
  of heavy-ball local steps (``momentum``).
* Personalized evaluation: each client's model, fine-tuned ``finetune_epochs`` local epochs (the
  FedAvg-FT backbone of afind-plus §4.5), on its own test set drawn with its train label distribution
  (``client_test_split``); ``test_accuracy`` is the unweighted mean over clients.
* Placement: the models ``W`` and every per-client table a round reads whole live on the run's device;
  the bookkeeping of neighbour selection (probabilities, thresholds, losses, weights, mixing matrices)
  is float64 on the host, and :meth:`GraphAlgorithm.on_device` moves weights where they mix models.
* Injected faults (docs/reliability.md): a client that drops out in a round neither sends, receives,
  trains nor changes any of its state; a lost link carries nothing. Every method filters the peers it
  contacts with :meth:`GraphAlgorithm.reachable`, so only delivered messages reach the ledger and the
  mixing weights are re-normalized over what arrived.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from fedweave.algorithms.base import Algorithm, RunContext, make_trainer, with_local  # noqa: F401 (re-exported)
from fedweave.config import MAX_BATCH_SIZE, MAX_LOCAL_EPOCHS, ConfigError, Section
from fedweave.execution import (
    LocalResult,
    LocalRule,
    LocalTrainer,
    ParamLayout,
    StateStore,
    client_means,
    evaluate_clients,
    evaluate_clients_task,
    with_samples,
)
from fedweave.execution.dpsgd import PrivateTrainer
from fedweave.execution.local import PLAIN, reindexed
from fedweave.privacy import graph_privacy
from fedweave.topology.graph import READ_BY, TOPOLOGIES, Topology, build_graph, neighbour_lists

# batch-stream keys (``("batches", round, client, *key)``) of the jobs a DFL round may run besides the
# client's own training (key ()): fine-tuning before evaluation, and copies trained for another client.
FINETUNE_KEY = 1_000_003
COPY_KEY = 1_000_033  # + target client id

# storage (ledger.store) of a peer: role ``client`` and per peer, as the star family records its clients' state
PEER_STORAGE = "client"
RECEIVED = "received_models"  # the neighbours' models a peer holds at once in a round to mix or score them


# --------------------------------------------------------------------------------------------- hparams
@dataclass
class GraphHparams:
    """Topology, per-round neighbour budget, evaluation backbone and DP noise shared by DFL methods."""

    topology: Topology = "full"
    edge_prob: float = 0.5  # erdos_renyi
    degree: int = 4  # random_regular, small_world (ring neighbours k)
    rewire_prob: float = 0.1  # small_world
    torus_rows: int = 0  # torus: 0 = the most square factorization
    edge_file: str | None = None  # edgelist
    neighbours: int = 10  # |B_i^t|: neighbours available (contacted) per round; "10 neighbours" (C.3)
    finetune_epochs: int = 1  # FedAvg-FT backbone: local epochs on a copy before evaluation (C.3)
    test_per_client: int | None = None  # per-client test size; null = ceil(N_test / m) (spec 4.2)
    dp_sigma: float = 0.0  # Table 4 sigma_2 (0 = no DP); the noise multiplier of dp_mode
    dp_clip: float = 1.0  # C: per-sample clipping norm (sgd) / the noise scale sigma_2 * C / L (exchange)
    # A27: sgd = per-sample clipped DP-SGD on every local step that produces a shared model (resolution);
    # exchange = every exchanged tensor received as x + N(0, (sigma_2 C / L)^2 I), L = local batch size
    dp_mode: Literal["sgd", "exchange"] = "sgd"

    def __post_init__(self) -> None:
        if self.topology not in TOPOLOGIES:
            raise ConfigError(f"algorithm.topology must be one of {', '.join(TOPOLOGIES)}; got {self.topology!r}")
        # each graph option is read by one topology only (build_graph checks it there, with the clients it needs):
        # a value no topology could take is refused whatever the topology, not kept unread
        if not 0 < self.edge_prob <= 1:
            raise ConfigError(f"algorithm.edge_prob must be in (0, 1], got {self.edge_prob}")
        if not 0 <= self.rewire_prob <= 1:
            raise ConfigError(f"algorithm.rewire_prob must be in [0, 1], got {self.rewire_prob}")
        if self.degree < 1:
            raise ConfigError(f"algorithm.degree must be >= 1, got {self.degree}")
        if self.torus_rows < 0:
            raise ConfigError(
                f"algorithm.torus_rows must be >= 0 (0 = the most square factorization), got {self.torus_rows}"
            )
        if self.neighbours < 1:
            raise ConfigError(f"algorithm.neighbours must be >= 1, got {self.neighbours}")
        if not 0 <= self.finetune_epochs <= MAX_LOCAL_EPOCHS:  # bounded as local.epochs is: 1e300 would never end
            raise ConfigError(
                f"algorithm.finetune_epochs must be in [0, {MAX_LOCAL_EPOCHS:,}], got {self.finetune_epochs:.6g}"
            )
        if self.dp_sigma < 0:
            raise ConfigError(f"algorithm.dp_sigma must be >= 0, got {self.dp_sigma}")
        if self.dp_clip <= 0:
            raise ConfigError(f"algorithm.dp_clip must be > 0, got {self.dp_clip}")
        # a sample count, bounded as local.batch_size is: 1e12 indices per client ended in numpy's allocation error
        if self.test_per_client is not None and not 1 <= self.test_per_client <= MAX_BATCH_SIZE:
            raise ConfigError(
                f"algorithm.test_per_client must be in [1, {MAX_BATCH_SIZE:,}] or null, got {self.test_per_client:.6g}"
            )


# ------------------------------------------------------------------------------------------ algorithm
# why a method whose peers score their neighbours' models on their own data does not deploy (docs/deployment.md)
SCORES_ON_OWN_DATA = (
    "each peer scores its neighbours' models on its own data, which the relaying ServerApp does not hold"
)


# why such a method is refused under privacy: the scores are unclipped, unnoised functions of the data
SCORED_ON_OWN_DATA = "its peers score their neighbours' models on their own data to choose or weigh them"


class GraphAlgorithm(Algorithm):
    """Base of DFL methods: graph, per-client models ``W`` (N, P), neighbour sampling, ledger, evaluation.

    Built from the run's context and the family's :class:`GraphHparams`: the peer graph (``topology``), a
    local trainer for every client at once, and the clients' model table in a :class:`StateStore`. A method
    writes :meth:`~fedweave.algorithms.base.Algorithm.run_round` with the helpers here: the clients that are
    up and the peers they reach under injected faults, peer messages in the ledger, and the evaluation of
    every client's own model.
    """

    family = "decentralized"
    own_test_sets = True  # every client's model on its own test set (eval.holdout: its held-out samples)
    Hparams = GraphHparams
    # the family evaluates its clients' models on their own test sets (docs/algorithms/decentralized.md)
    unread_config = {
        "eval.per_client": "evaluates every client's own model on its own test set (test_accuracy their mean, "
        "test_accuracy_min the worst) and reports no accuracy on the clients' training data",
    }
    # deployed on Flower, the ServerApp relays the gossip (docs/deployment.md): a method whose peers compute on
    # their own data only through their local trainers deploys, and says so with None here
    undeployable: ClassVar[str | None] = (
        "its peers compute on their own data beyond local training (scores, masks or personal models), which "
        "the ServerApp that relays the gossip does not hold"
    )
    # privacy (docs/privacy.md): DP-SGD at every peer bounds only what a peer computes from its data through its
    # private local trainer; a method that was checked to touch its data nowhere else says so with None here
    dp_refusal: ClassVar[str | None] = "it has not been checked to read each peer's data only in local training"
    # Every DFL method here filters its peers with ``reachable`` and holds dropped clients (reliability.md).
    handles_faults: ClassVar[tuple[str, ...]] = ("dropout", "link_loss")

    def __init__(self, ctx: RunContext, hp: GraphHparams) -> None:
        super().__init__(ctx, hp)
        # a family option the method would not read, set to other than its default: a config that writes a
        # default out (configs/decentralized/afind_plus_fmnist.yaml's neighbours: 10) is not refused
        defaults = {f.name: f.default for f in fields(hp)}
        for key, why in self.unread_options(hp).items():
            if getattr(hp, key) != defaults[key]:
                raise ConfigError(f"algorithm.{key}: {why}; leave it out")
        # a graph option the topology does not read, likewise (a forgotten topology: edgelist trained on the full
        # graph, its edge_file never opened)
        for key, readers in READ_BY.items():
            if hp.topology not in readers and getattr(hp, key) != defaults[key]:
                raise ConfigError(
                    f"algorithm.{key}: topology {hp.topology!r} does not read it (only {' and '.join(readers)} "
                    f"do); set algorithm.topology or leave {key} out"
                )
        if ctx.config.sampler != Section("uniform"):  # the section would be ignored: nobody samples here
            raise ConfigError(
                f"sampler: the decentralized family has every client train every round (the graph and the method "
                f"choose the peers it hears from), so sampler {ctx.config.sampler.name} would be ignored; leave the "
                "sampler section out"
            )
        # a client's test set is drawn from the test split (spec 4.2): more than the split holds only repeats its
        # samples, and 10**8 (under the hparams' bound) drew 10**8 indices per client and evaluated on them all
        n_test = len(ctx.dataset.test_y)
        if hp.test_per_client is not None and ctx.config.eval.holdout:  # the test sets are not the test split's
            raise ConfigError(
                f"algorithm.test_per_client: under eval.holdout ({ctx.config.eval.holdout:g}) each client is "
                "evaluated on its own held-out training samples, not on a draw from the test split; leave it out"
            )
        if hp.test_per_client is not None and hp.test_per_client > n_test:
            raise ConfigError(
                f"algorithm.test_per_client must be at most the test split's {n_test:,} samples (or null: "
                f"ceil(N_test / m)), got {hp.test_per_client:,}"
            )
        n = ctx.num_clients
        self.num_clients = n
        self.graph = build_graph(
            hp.topology,
            n,
            self.seeds.int_seed("topology") % 2**31,
            edge_prob=hp.edge_prob,
            degree=hp.degree,
            rewire_prob=hp.rewire_prob,
            torus_rows=hp.torus_rows,
            edge_file=hp.edge_file,
        )
        self.neighbours = neighbour_lists(self.graph)
        self.trainer = make_trainer(ctx, n)
        self.ft_trainer = with_local(self.trainer, epochs=hp.finetune_epochs or 1, steps=None)
        if hp.dp_sigma and hp.dp_mode == "sgd":  # the fine-tuning copy is never sent: it stays plain SGD
            self.trainer = PrivateTrainer.of(self.trainer, hp.dp_clip, hp.dp_sigma)
        self.privacy = graph_privacy(self)  # privacy: DP-SGD accounted per client (privacy.level: sample)
        self.layout: ParamLayout = self.trainer.layout
        self.store = StateStore(n, dtype=ctx.dtype, placement=ctx.placement)
        # every client trains every round: its table lives where the computation is
        self.store.create("model", self.layout.numel, fill=self.layout.flatten(), on_device=True)
        self.model_bytes = self.layout.numel * ctx.float_bytes  # one model row
        self._up: tuple[int, np.ndarray] | None = None
        self.hold_momentum()  # local.momentum's buffer (a method that sets its own momentum records it again)

    def unread_options(self, hp: GraphHparams) -> dict[str, str]:
        """The family's options (:class:`GraphHparams`) this method does not read under ``hp``, each with why: a
        config that sets one to other than its default (the method's ``Hparams`` default) is refused in one line
        instead of being silently ignored. None by default."""
        return {}

    # ---- state -----------------------------------------------------------------------------------
    @property
    def W(self) -> torch.Tensor:
        """Round-start personalized models, one row per client."""
        return self.store["model"]

    @staticmethod
    def on_device(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Host bookkeeping (weights, losses) where and in the dtype that ``like`` computes."""
        return t.to(device=like.device, dtype=like.dtype)

    def commit(self, name: str, new: torch.Tensor) -> None:
        """End of round: replace state ``name`` by ``new`` (computed from round-start values only)."""
        self.store[name].copy_(new)

    def state_dict(self) -> dict[str, Any]:
        out = {"store": self.store.state_dict(), **super().state_dict()}
        if self.privacy is not None:  # privacy: each client's DP-SGD steps so far
            out["privacy"] = self.privacy.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        self.store.load_state_dict(state.pop("store"))
        private = state.pop("privacy", None)
        if private is not None and self.privacy is not None:  # privacy
            self.privacy.load_state_dict(private)
        super().load_state_dict(state)

    # ---- storage ---------------------------------------------------------------------------------
    def hold(self, what: str, nbytes: int) -> None:
        """Record that a peer holds ``nbytes`` of ``what`` beyond its own model (ledger storage of role
        ``client``, per peer). The ledger keeps the peak, so a figure that differs between peers (a
        degree-dependent table) or rounds (the models received) is the largest any peer needs."""
        self.ledger.store(PEER_STORAGE, what, nbytes)

    def hold_received(self, count: int, nbytes_each: int | None = None) -> None:
        """A peer holds ``count`` neighbours' messages of ``nbytes_each`` bytes (default: one model row, the
        model's width) at once this round, to mix or score them together: ``received_models``."""
        self.hold(RECEIVED, int(count) * (self.model_bytes if nbytes_each is None else nbytes_each))

    def hold_momentum(self) -> None:
        """Heavy-ball local steps keep one buffer the size of the whole model while a peer trains (the local
        trainer's ``momentum``; DFedAvgM's by default): ``momentum``. Nothing without momentum."""
        if self.trainer.local.momentum:
            self.hold("momentum", self.layout.numel * self.ctx.float_bytes)

    # ---- faults ----------------------------------------------------------------------------------
    def up(self, r: int) -> np.ndarray:
        """Bool mask over clients: True where the client takes part in round ``r`` (not dropped out)."""
        if self._up is None or self._up[0] != r:
            self._up = (r, ~self.faults.dropped(r, np.arange(self.num_clients)))
        return self._up[1]

    def is_up(self, r: int, i: int) -> bool:
        """Whether client ``i`` takes part in round ``r``: always without faults, else as :meth:`up` says."""
        return not self.faulty or bool(self.up(r)[i])

    def reachable(self, r: int, i: int, peers: np.ndarray) -> np.ndarray:
        """The ``peers`` that exchange messages with i in round ``r``: both up and the link {i, j} up.

        Empty for a dropped i. Without injected faults: ``peers`` unchanged (the same array)."""
        if not self.faulty:
            return peers
        peers = np.asarray(peers, dtype=np.int64)
        if not self.up(r)[i]:
            return peers[:0]
        keep = self.up(r)[peers] & self.faults.links_up(r, i, peers)
        return peers[keep]

    def clients_up(self, r: int) -> np.ndarray:
        """The ids of the clients that take part in round ``r`` (all of them without injected faults)."""
        return np.flatnonzero(self.up(r)) if self.faulty else np.arange(self.num_clients)

    def train_up(
        self, r: int, trainer: LocalTrainer, starts: torch.Tensor, rule: LocalRule = PLAIN, key: tuple[int, ...] = ()
    ) -> LocalResult:
        """Local training in round ``r`` of every client from its row of ``starts``, except that a dropped
        client trains nothing (see :meth:`fill_dropped`). ``rule``'s per-job tensors are indexed by client,
        as for a call over all clients."""
        n = self.num_clients
        starts = starts if starts.dim() == 2 else starts.expand(n, -1)
        up = self.clients_up(r)
        if len(up) == n:
            return trainer.train(starts, range(n), r, rule=rule, key=key)
        res = trainer.train(starts[torch.as_tensor(up, device=starts.device)], up, r, rule=reindexed(rule, up), key=key)
        return self.fill_dropped(r, res, starts)

    def fill_dropped(self, r: int, res: LocalResult, starts: torch.Tensor) -> LocalResult:
        """``res``, a result over :meth:`clients_up` in order, as rows over all clients: a dropped client's row
        keeps its start, with 0 steps and a NaN loss (which :meth:`mean_over_up` never reads)."""
        n = self.num_clients
        dev = res.params.device
        up = torch.as_tensor(self.clients_up(r), device=dev)
        if len(up) == n:
            return res
        params = (starts if starts.dim() == 2 else starts.expand(n, -1)).clone()
        params[up] = res.params
        steps = torch.zeros(n, dtype=res.steps.dtype, device=dev)
        steps[up] = res.steps
        loss = torch.full((n,), float("nan"), dtype=res.loss.dtype, device=dev)
        loss[up] = res.loss
        return LocalResult(params, steps, loss)

    def hold_dropped(self, r: int, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        """``new`` rows for the clients that took part, ``old`` rows for those that dropped out."""
        if not self.faulty:
            return new
        return torch.where(torch.as_tensor(self.up(r), device=new.device)[:, None], new, old)

    def all_down(self, r: int) -> bool:
        """Nobody takes part in round ``r``: the method skips it (state unchanged, ``reported_clients`` 0)."""
        return self.faulty and not self.up(r).any()

    def round_fault_metrics(self, r: int) -> dict[str, float]:
        """``reported_clients`` (those that took part in round ``r``) when faults are injected; 0 = skipped."""
        return self.fault_metrics(int(self.up(r).sum()) if self.faulty else 0)

    def train_loss(self, r: int, local: LocalResult) -> float:
        """``train_loss`` of round ``r``: the mean of ``local``'s losses over the clients that trained
        (:meth:`~fedweave.execution.LocalResult.trained_loss`: a dropped one has none, :meth:`fill_dropped`)."""
        if not bool((local.steps > 0).any()):  # none trained (live clients without samples): as it always was
            return self.mean_over_up(r, local.loss)
        return local.trained_loss()

    def mean_over_up(self, r: int, values: torch.Tensor) -> float:
        """Mean of a per-client quantity over the clients that took part in round ``r``."""
        if not self.faulty:
            return float(values.mean())
        return float(values[torch.as_tensor(self.up(r), device=values.device)].mean())

    # ---- protocol --------------------------------------------------------------------------------
    def available(self, r: int, i: int, k: int | None = None) -> np.ndarray:
        """B_i^t: ``k`` (default ``neighbours``) of i's graph neighbours, uniformly without replacement,
        restricted to those that are reachable this round (sampling first, so faults leave the stream)."""
        nb = self.neighbours[i]
        k = min(self.hp.neighbours if k is None else k, len(nb))
        rng = self.seeds.numpy("neighbour_sampling", r, i)
        picked = np.sort(rng.choice(nb, size=k, replace=False)) if k < len(nb) else nb.copy()
        return self.reachable(r, i, picked)

    def peer(self, r: int, kind: str, nbytes_each: int, count: int = 1) -> None:
        """``count`` peer-to-peer messages of ``nbytes_each`` bytes each."""
        if count:
            self.ledger.record(r, "peer", "peer", kind, nbytes_each * count, count)

    def send_model(self, r: int, sender: int, count: int) -> None:
        """``count`` messages carrying ``sender``'s round-start model, e.g. to neighbours that compute a proxy
        at it: one model row, unless the method's models are sparse (DisPFL sends values and a bitmap)."""
        self.peer(r, "model", self.model_bytes, count)

    def noisy(self, x: torch.Tensor, r: int, sender: int, receiver: int, what: int = 0) -> torch.Tensor:
        """The tensor as received under ``dp_mode: exchange``: x + N(0, (sigma_2 C / L)^2 I) (A27), else x."""
        if not self.hp.dp_sigma or self.hp.dp_mode != "exchange":
            return x
        g = self.seeds.torch("dp_noise", r, sender, receiver, what)
        std = self.hp.dp_sigma * self.hp.dp_clip / self.config.local.batch_size
        noise = torch.randn(x.shape, generator=g, dtype=x.dtype, device="cpu")  # the same draws on every device
        return x + std * noise.to(x.device)

    def as_received(self, models: torch.Tensor, r: int, sender: int, receiver: int) -> torch.Tensor:
        """Row ``sender`` of ``models`` as ``receiver`` holds it when the method sends it (``noisy``, what 0):
        what a receiver that scores the models it mixes must score."""
        return self.noisy(models[sender], r, sender, receiver)

    @property
    def label_overlap(self) -> torch.Tensor:
        """O_ij = sum_c min(q_ic, q_jc) of the clients' train label distributions q (1 = same labels).

        Ground truth for diagnostics only (how alike the neighbours a method picks are); never used to train.
        """
        if getattr(self, "_overlap", None) is None:
            ds = self.ctx.dataset
            y = self.ctx.label_view(ds.train_y.numpy())
            nc = int(y.max(initial=0)) + 1
            q = np.stack([np.bincount(y[p], minlength=nc) / max(len(p), 1) for p in self.ctx.partition])
            q_t = torch.as_tensor(q, device="cpu")  # host bookkeeping (diagnostics)
            self._overlap = torch.minimum(q_t[:, None, :], q_t[None, :, :]).sum(-1)
        return self._overlap

    # ---- evaluation ------------------------------------------------------------------------------
    @property
    def test_parts(self) -> list[np.ndarray]:
        """Per-client test indices with each client's train label distribution (spec 4.2)."""
        return self.ctx.personal_test_parts(self.hp.test_per_client)

    def eval_models(self, r: int) -> torch.Tensor:
        """The models evaluated after round ``r`` (default: ``W``)."""
        return self.W

    def finetune_rule(self) -> LocalRule:
        """The rule of the fine-tuning before evaluation (``finetune_epochs``): plain SGD, unless the method's
        models live on a support of their own (DisPFL's sparse masks), which the fine-tuned copy keeps."""
        return PLAIN

    def evaluated_clients(self) -> np.ndarray | None:
        """The clients whose models the evaluation averages over: every one (None), or, with Byzantine peers
        (robustness), the honest ones: an attacker's own model is not what the run learns."""
        return None

    def model_metrics(self, models: torch.Tensor) -> dict[str, float]:
        """Metrics of the evaluated ``models`` (one row per evaluated client) beside the task's: none by
        default."""
        return {}

    def evaluate(self, r: int) -> dict[str, float]:
        """Mean over clients of per-client test accuracy, after ``finetune_epochs`` of local fine-tuning
        on a throw-away copy (afind-plus R10; training continues from the un-tuned models)."""
        models = self.eval_models(r)
        if self.hp.finetune_epochs:
            models = self.ft_trainer.train(
                models, range(self.num_clients), r, rule=self.finetune_rule(), key=(FINETUNE_KEY,)
            ).params
        ev, task = self.config.eval, self.ctx.task
        tx, ty, parts = self.ctx.personal_test_set(self.hp.test_per_client)  # eval.holdout: the clients' own
        keep = with_samples(parts, self.evaluated_clients())  # a client without a test sample has no figure
        if keep is not None:
            models, parts = models[torch.as_tensor(keep, device=models.device)], [parts[k] for k in keep]
        if not task.is_default:  # any task: each value's mean over clients, and the worst client's main metric
            per = evaluate_clients_task(self.layout, models, tx, ty, parts, task, ev.batch_size)
            means, worst = client_means(per, task.main, task.direction)
            out = {f"test_{k}": v for k, v in means.items()}
            return {**out, f"test_{task.main}_worst": worst, **self.model_metrics(models)}
        accs, losses = evaluate_clients(self.layout, models, tx, ty, parts, ev.batch_size)
        return {
            "test_accuracy": float(accs.mean()),
            "test_loss": float(losses.mean()),
            "test_accuracy_min": float(accs.min()),
            **self.model_metrics(models),
        }
