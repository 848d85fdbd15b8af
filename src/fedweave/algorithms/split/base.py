"""Federated split learning mechanics, the split family's base: clients, a main server, a fed server (cse-fsl
spec §1).

One template of each part (client-side model, auxiliary net, server-side model) is reused for every
client: a client's parameters are rows of stacked flat tensors loaded into the template for its local
epoch and read back afterwards (no model object per client). The main server holds either one
server-side model (FSL_OC, CSE-FSL) or n stacked copies (FSL_MC, FSL_AN), and the fed server averages the
client-side models and auxiliary nets every round (eq. 14).

Every message goes through the ledger with its exact size: ``smashed`` and ``labels`` (client -> server),
``gradient`` (server -> client), ``client_model`` and ``aux_model`` (fed_server <-> client). Server storage
is recorded the way the paper's Table V counts it (spec §7.3): ``server_models`` (copies × P_s) and
``client_models`` (the n received client-side models and auxiliary nets), plus the ``queue_peak``.

The CSE-FSL server queue is simulated on a clock (spec §1.6), written here with the faults on it
(:class:`TimedSplit`): client i takes τ_i per local batch (τ_i ~ U[1, speed_spread] from the ``clock``
stream, fixed per client), an upload after batch m arrives at (m+1)·τ_i + latency, and a server step takes
``server_step_time``. The processing order is ``ordered`` (window by window, clients by id: the authors'
code), ``random`` (a random client order per window, Fig. 6), ``event`` (FIFO by arrival time: the
asynchronous event-triggered server) or ``sync`` (a barrier per window, then client order). Client updates
do not depend on the server model, so training all clients first and then draining the queue in that order
is the same computation as true interleaving. The synchronous methods (FSL_MC, FSL_OC, FSL_AN) fill in the
round template :meth:`SplitAlgorithm.run_round` with their exchanges.

Placement: the three parts, their stacked rows and the smashed data live on the run's device; under
``bf16-mixed`` every forward pass autocasts (smashed data travel in bfloat16) while the parts and their
updates stay float32. Losses stay on the device until the round's metrics read them once. Dropout masks
come from the device's generator seeded from the named stream: the same per device, not across devices.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from torch import nn

from fedweave.accounting import split as accounting
from fedweave.accounting.split import upload_batches
from fedweave.algorithms.base import Algorithm, RunContext, aggregation_weights, checked_augment, model_memory
from fedweave.config import ConfigError, RunConfig
from fedweave.data.partition import clients_with_data
from fedweave.execution import LocalTrainer, ParamLayout, evaluate_task
from fedweave.ledger import nbytes
from fedweave.models.split import SPLIT_MODELS, build_split_model, split_builder
from fedweave.privacy.split import private_average, split_privacy
from fedweave.topology.samplers import make_sampler, weighting_under

ORDERS = ("ordered", "random", "event", "sync")


@dataclass
class SplitHparams:
    """Options shared by the split family (spec §2.5, §3)."""

    clients_per_round: int | None = None  # null: every client, every round (CIFAR setting)
    weighting: Literal["samples", "uniform"] = "samples"  # eq. (14) is uniform; the code weights by |D_i| (A20)
    client_lr: float | None = None  # null: local.lr (the paper uses one lr for all three optimizers, A16)
    aux_lr: float | None = None
    server_lr: float | None = None
    lr_decay_every: int = 1  # local.lr_decay applies every this many rounds (CIFAR: 0.99 every 10, A15)
    clip: float | None = None  # clip_grad_norm_ max norm on the client-side and server-side updates

    def __post_init__(self) -> None:
        if self.clients_per_round is not None and self.clients_per_round < 1:
            raise ConfigError(f"algorithm.clients_per_round must be >= 1 or null, got {self.clients_per_round}")
        for key in ("client_lr", "aux_lr", "server_lr", "clip"):
            v = getattr(self, key)
            if v is not None and v <= 0:
                raise ConfigError(f"algorithm.{key} must be > 0 or null, got {v}")
        if self.lr_decay_every < 1:
            raise ConfigError(f"algorithm.lr_decay_every must be >= 1, got {self.lr_decay_every}")


@dataclass
class Upload:
    """One item of the server's dataQueue: a client's smashed mini-batch and its labels."""

    pos: int  # the client's position in this round's client list
    window: int  # k: the client's k-th upload of the round
    batch: int  # m: the local batch it came from
    smashed: torch.Tensor
    labels: torch.Tensor
    arrival: float = 0.0


@dataclass
class InFlight:
    """A smashed upload that arrives in a later round (straggler policy ``late``)."""

    due: int  # the round whose queue it joins
    client: int
    upload: Upload  # ``arrival`` is the time within round ``due``


@dataclass
class Trained:
    """What a synchronous split round's exchanges leave (``SplitAlgorithm.train_round``)."""

    xc_rows: torch.Tensor  # the reporting clients' client-side models, stacked
    xa_rows: torch.Tensor  # their auxiliary nets (unused without one)
    losses: list  # the clients' losses, one per local step
    server_losses: list  # the server's losses, one per server step


def process_order(mode: str, items: list[Upload], rng: np.random.Generator) -> list[int]:
    """The order in which the server dequeues ``items`` (spec §1.6 table)."""
    if mode in ("ordered", "sync"):
        return sorted(range(len(items)), key=lambda j: (items[j].window, items[j].pos))
    if mode == "random":  # a random client order within each window (Fig. 6 "randomly ordered")
        windows = sorted({it.window for it in items})
        rank = {w: rng.permutation(1 + max(it.pos for it in items)) for w in windows}
        return sorted(range(len(items)), key=lambda j: (items[j].window, rank[items[j].window][items[j].pos]))
    if mode == "event":  # FIFO by arrival time (ties: client position)
        return sorted(range(len(items)), key=lambda j: (items[j].arrival, items[j].pos))
    raise ValueError(f"server order must be one of {', '.join(ORDERS)}, got {mode!r}")


def simulate_server(items: list[Upload], order: list[int], step_time: float, barrier: bool) -> dict[str, float]:
    """Server timeline for processing ``items`` in ``order``: finish time, idle time, queue high-water mark.

    A step starts when the server is free and its item has arrived (with ``barrier``: when every item of
    its window has arrived, the synchronous server).
    """
    if not items:
        return {"finish": 0.0, "idle": 0.0, "queue_peak": 0}
    arrival = np.array([it.arrival for it in items])
    ready = arrival.copy()
    if barrier:
        win = np.array([it.window for it in items])
        for w in np.unique(win):
            ready[win == w] = arrival[win == w].max()
    start = np.empty(len(items))
    t = idle = 0.0
    for j in order:
        s = max(t, ready[j])
        idle += s - t
        start[j] = s
        t = s + step_time
    # items that have arrived and not yet been taken up, seen at each dequeue
    waiting = (arrival[None, :] <= start[:, None]) & (start[None, :] >= start[:, None])
    return {"finish": float(t), "idle": float(idle), "queue_peak": int(waiting.sum(1).max())}


@dataclass
class ClientEpoch:
    """What one client's local work of a round segment produces (Alg. 1 lines 5-13 of CSE-FSL; FSL_AN's
    client uploads every batch)."""

    xc: torch.Tensor  # its client-side model after the segment
    xa: torch.Tensor  # its auxiliary net
    uploads: list[tuple[int, int, torch.Tensor, torch.Tensor]]  # (window k, batch m, smashed, labels)
    losses: list[float]  # the local loss of each step
    batches: int  # the client's local batches in the round


@dataclass
class BackpropClient:
    """A client of traditional split learning between two of its batches (FSL_MC, FSL_OC; Fig. 1 steps
    2-4): its client-side model, the state of its own dropout stream, and where it is in its batches.

    This is all a client keeps from one exchange with the server to the next, so a deployed client can
    keep it in a file between messages; the forward graph of the batch at the server (``live``) is kept
    only while the template still holds this client's model, and is otherwise computed again from ``xc``
    and ``rng``, which gives the same bits."""

    client: int
    round: int
    xc: torch.Tensor  # its client-side model now
    rng: torch.Tensor  # its dropout stream's state before the forward pass of batch ``batch``
    batch: int = 0  # the next batch to go up; while ``sent``, the batch whose smashed data is at the server
    sent: bool = False
    live: torch.Tensor | None = None  # the smashed data of ``batch`` with its graph
    rng_after: torch.Tensor | None = None  # the stream after that forward pass


class BackpropSession:
    """The clients' side of a round of FSL_MC or FSL_OC, run in this process: ``start`` gives the first
    smashed batch of the named clients, ``turn`` gives each client the server's gradient of its last batch
    and returns its next smashed batch (a client whose batches are done is left out), ``models`` the
    client-side models at the end. A deployment runs the same client methods on the nodes
    (``fedweave.deploy.split``); ``parallel`` says whether exchanges with several clients at once are
    cheaper than one client after another (the simulation: no; its template holds one client at a time)."""

    parallel = False

    def __init__(self, algo: SplitAlgorithm, r: int, clients: np.ndarray, xc_rows: torch.Tensor, lr: float) -> None:
        self.algo, self.lr = algo, lr
        self.states = [algo.backprop_client(r, int(i), xc_rows[k]) for k, i in enumerate(clients)]
        self.batches: dict[int, list] = {}

    def _batches(self, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if k not in self.batches:
            c = self.states[k]
            self.batches[k] = self.algo.local_batches(c.round, c.client)
        return self.batches[k]

    def start(self, ks: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        return self.turn(dict.fromkeys(ks))

    def turn(self, grads: dict[int, torch.Tensor | None]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        out = {}
        for k, g in grads.items():
            up = self.algo.client_turn(self.states[k], self._batches(k), g, self.lr)
            if up is not None:
                out[k] = up
        return out

    def models(self) -> torch.Tensor:
        return torch.stack([c.xc for c in self.states])


# why a family that scores only its global model refuses eval.personal_test and eval.per_client
GLOBAL_EVAL_ONLY = "evaluates the global model on the test split; per-client evaluation is the centralized family's"


class SplitAlgorithm(Algorithm):
    """Shared mechanics of the split family and the synchronous round template (:meth:`run_round`): a
    synchronous method (FSL_MC, FSL_OC, FSL_AN) writes only its exchanges, :meth:`train_round`; CSE-FSL,
    asynchronous, writes its own round on the simulated clock of :class:`TimedSplit`."""

    family = "split"
    Hparams = SplitHparams
    method: ClassVar[str] = ""  # the accounting name: fsl_mc, fsl_oc, fsl_an, cse_fsl
    uses_aux: ClassVar[bool] = False
    unread_config = {  # SplitAlgorithm.lrs: its own exponential decay
        "local.lr_schedule": "decays its rates by local.lr_decay every algorithm.lr_decay_every rounds (exponential)",
        "eval.personal_test": GLOBAL_EVAL_ONLY,
        "eval.per_client": GLOBAL_EVAL_ONLY,
        # before: accepted and silently not used (the summary recorded no backend)
        "backend": "trains its client and server parts in its own loop, on no execution backend",
        "memory.vmap_chunk": "trains its client and server parts in its own loop, on no execution backend",
    }
    # the synchronous template waits for its clients: a client past the deadline is dropped like a dropout
    handles_faults: ClassVar[tuple[str, ...]] = ("dropout", "deadline")
    counts_steps: ClassVar[bool] = True  # a client's work is its local batches (faults.work_unit: step applies)
    state_fields = ("xc", "xs", "xa")  # the client, server and auxiliary models
    # privacy: why the ``privacy`` section refuses this method (None: the fed server's average of the client-side
    # models is DP-FedAvg's release; fedweave.privacy.split)
    dp_refusal: ClassVar[str | None] = None

    # the methods whose clients back-propagate the gradients of a server-side model trained, unclipped and
    # unnoised, on every client's smashed data (FSL_MC, FSL_OC): one client's data move the others' client-side
    # updates, so the sum's sensitivity is not C (DP-FedAvg's bound, McMahan et al. 2018, needs each update to
    # depend on the other clients only through released models)
    SERVER_GRADIENTS: ClassVar[str] = (
        "its clients train on gradients from a server-side model fitted to every client's smashed data, so one "
        "client's data move the other clients' updates; use fsl_an or cse_fsl (local loss, no gradient back)"
    )

    @classmethod
    def check_model(cls, config: RunConfig) -> None:
        """A split model (:data:`~fedweave.models.split.SPLIT_MODELS`), not the zoo's: its name and options."""
        try:
            split_builder(config.model.name, config.model.options)
        except ValueError as e:
            raise ConfigError(str(e)) from e

    def __init__(self, ctx: RunContext, hp: SplitHparams) -> None:
        if ctx.objects.model is not None:  # before: "model.name 'python' is not a split model", naming no cause
            raise ConfigError(
                f"model: algorithm {ctx.config.algorithm.name!r} builds its client and server parts (and auxiliary "
                "net) from a split model (model.name: one of "
                f"{', '.join(sorted(SPLIT_MODELS._items))}, or one registered with "
                "fedweave.models.split.SPLIT_MODELS.register), so it takes no model from Python"
            )
        super().__init__(ctx, hp)
        cfg = ctx.config
        if cfg.local.momentum or cfg.local.weight_decay:
            raise ConfigError(
                "local.momentum and local.weight_decay must be 0 for split algorithms "
                "(the paper trains every part with plain SGD)"
            )
        if hp.lr_decay_every != 1 and cfg.local.lr_decay == 1:  # lrs: 1 ** (r // every) reads it for nothing
            raise ConfigError(
                f"algorithm.lr_decay_every ({hp.lr_decay_every}) spaces the decays of local.lr_decay, which is 1 "
                "(a constant rate); set local.lr_decay below 1 or leave algorithm.lr_decay_every out"
            )
        ds = ctx.dataset
        n = ctx.num_clients
        self.per_round = hp.clients_per_round or n
        self.sampler = make_sampler(ctx, self.per_round, family=self.family)
        hp.weighting = weighting_under(ctx, self.sampler, hp.weighting)  # equal weights after a draw by size
        self.loss = ctx.task.loss  # the local (auxiliary) and server losses: cross-entropy in the paper
        if self.per_round > n:
            raise ConfigError(f"algorithm.clients_per_round ({self.per_round}) exceeds partition.num_clients ({n})")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seeds.int_seed("model_init"))
            try:  # a part too large to allocate is one line as for the zoo's models (docs/reliability.md)
                with model_memory(cfg.model.name, dict(cfg.model.options)):
                    self.parts = build_split_model(
                        cfg.model.name, tuple(ds.input_shape), ds.num_classes, cfg.model.options
                    )
            except ValueError as e:
                raise ConfigError(str(e)) from e
        if not self.uses_aux:  # FSL_MC and FSL_OC train no auxiliary net: its options would be silently unread
            given = {
                "model.aux": cfg.model.options.get("aux", "mlp"),
                "model.aux_channels": cfg.model.options.get("aux_channels"),
                "algorithm.aux_lr": hp.aux_lr,
            }
            for key, value in given.items():
                if value not in ("mlp", None):  # the defaults (a paper preset writes aux: mlp for every method)
                    raise ConfigError(
                        f"{key}: algorithm {self.name!r} trains no auxiliary net (cse_fsl and fsl_an do); leave it out"
                    )
        pl = self.placement = ctx.placement
        for m in (self.parts.client, self.parts.server, self.parts.aux):
            m.to(device=ctx.device, dtype=ctx.dtype)  # the run's placement (in place: the parts keep their modules)
        self.client, self.server, self.aux = self.parts.client, self.parts.server, self.parts.aux
        self.lc, self.ls, self.la = (
            ParamLayout(self.client, pl),
            ParamLayout(self.server, pl),
            ParamLayout(self.aux, pl),
        )
        self.full = ParamLayout(nn.Sequential(self.client, self.server), pl)  # the inference model x_s ∘ x_c
        self.local_model = ParamLayout(nn.Sequential(self.client, self.aux), pl)  # a_c ∘ x_c (the local loss)
        # the task's loss reads the outputs of x_s ∘ x_c (the server's loss) and of a_c ∘ x_c (the local loss):
        # the run's model check (on logits under task.loss: nll, a split model trained to a negative loss, then NaN)
        ctx.check_model(self.full.model, cfg.model.name)
        if self.uses_aux:
            ctx.check_model(self.local_model.model, f"{cfg.model.name} (client part and auxiliary net)")
        self.xc, self.xs, self.xa = self.lc.flatten(), self.ls.flatten(), self.la.flatten()
        augment = checked_augment(ctx)  # the split parts read the crop (a model may centre-crop its test images)
        # only the batch plan (named ``batches`` stream) and augmentation of the foundation trainer are used
        self.batcher = LocalTrainer(
            self.client, ds.train_x, ds.train_y, ctx.partition, cfg.local, self.seeds, augment=augment, placement=pl
        )
        self.sizes = torch.tensor([len(p) for p in ctx.partition], dtype=ctx.dtype, device=ctx.device)
        self.server_copies = 1
        # the mean local batches of a client that holds data: the unit of a client's work under faults (one
        # without samples takes none, and its 0 would shrink the unit, as the star family's mean_round_steps)
        held = clients_with_data(ctx.partition).tolist()
        self.reference_batches = max(1, round(sum(self.batcher.num_steps(c) for c in held) / len(held)))
        self.privacy = split_privacy(self)  # privacy: DP-FedAvg on the client-side models (None without a section)

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        if self.privacy is not None:  # privacy: the accountant's releases and the (adaptive) clip
            out["privacy"] = self.privacy.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        private = state.pop("privacy", None)
        super().load_state_dict(state)
        if private is not None and self.privacy is not None:  # privacy
            self.privacy.load_state_dict(private)

    # ---- sizes ---------------------------------------------------------------------------------------
    @property
    def split_sizes(self) -> accounting.SplitSizes:
        """The parameter counts of the client-side, server-side and auxiliary parts and the smashed floats per
        sample (:class:`fedweave.accounting.split.SplitSizes`)."""
        return accounting.SplitSizes(self.lc.numel, self.ls.numel, self.la.numel, self.parts.smashed_floats)

    # ---- injected faults (docs/reliability.md) ------------------------------------------------------
    # A client that drops out received the fed server's download and delivers nothing in the round: no
    # smashed data, no model upload, and (FSL_MC, FSL_AN) no server-side copy is opened for it. Split
    # clients keep no state across rounds, so nothing else changes. The synchronous protocols (FSL_MC,
    # FSL_OC, FSL_AN wait for the round's clients) drop a client past the deadline like a dropout and refuse
    # ``late``; CSE-FSL times each upload on the simulated clock (``TimedSplit``). Aggregation re-weights over
    # the reporters.
    def client_steps(self, r: int, clients: np.ndarray) -> np.ndarray:
        """Each client's local batches: a client with twice the data is twice as slow."""
        return np.array([self.batcher.num_steps(int(c)) for c in clients], dtype=np.float64)

    def relative_work(self, steps: np.ndarray) -> np.ndarray:
        """Batches over ``reference_batches``, the mean client's."""
        return steps / self.reference_batches

    # ---- the synchronous round template --------------------------------------------------------------
    def run_round(self, r: int) -> dict[str, float]:
        """A synchronous split round: the fed server sends the round's clients its models (Alg. 1 line 3);
        the clients that report (dropouts and stragglers deliver nothing: no smashed data, no model, no
        server-side copy) run the method's exchanges with the main server (:meth:`train_round`); then they
        upload their models and the fed server averages them (eq. 14, re-weighted over the reporters). A
        round nobody reports leaves the models as they were (``reported_clients`` 0, a skipped round)."""
        clients = self.sample_clients(r)
        lrs = self.lrs(r)
        xc_rows, xa_rows = self.download(r, clients)
        clients = self.reporting(r, clients)
        if len(clients) == 0:
            self.release_nobody(clients)  # privacy: under amplification the noise alone is released
            return self.fault_metrics(0)  # nobody reported: the models stay, the runner logs the skip
        k = len(clients)
        done = self.train_round(r, clients, xc_rows[:k], xa_rows[:k], lrs)
        self.upload_models(r, clients)  # Alg. 1 lines 16-17
        self.aggregate(clients, done.xc_rows, done.xa_rows)  # eq. (14)
        out = self.round_metrics(r, k, len(done.server_losses), done.losses, done.server_losses)
        return {**out, **self.fault_metrics(k)}

    def train_round(
        self, r: int, clients: np.ndarray, xc_rows: torch.Tensor, xa_rows: torch.Tensor, lrs: tuple[float, ...]
    ) -> Trained:
        """The method's exchanges of round ``r`` between the reporting ``clients`` (starting from the models
        they downloaded, ``xc_rows``/``xa_rows``) and the main server, which updates its own model(s) here;
        ``lrs``: the (client, auxiliary, server) learning rates."""
        # not abstract: a method may write its own round instead (CSE-FSL)
        raise NotImplementedError(f"{type(self).__qualname__} defines neither train_round nor a round of its own")

    # ---- clients, weights, learning rates ------------------------------------------------------------
    def sample_clients(self, r: int) -> np.ndarray:
        """The round's clients from the run's sampler (uniformly without replacement by default; every client
        when ``clients_per_round`` is all of them; ``fixed`` for the authors' code's first five, spec A13)."""
        return self.sampler(r)

    def weights(self, clients: np.ndarray) -> torch.Tensor:
        """Aggregation weights p_i of eq. (14), summing to one."""
        return aggregation_weights(self.sizes, clients, self.hp.weighting)

    def lrs(self, r: int) -> tuple[float, float, float]:
        """(client, auxiliary, server) learning rates η_t of round r."""
        loc = self.config.local
        decay = loc.lr_decay ** (r // self.hp.lr_decay_every)
        hp = self.hp
        return tuple((v if v is not None else loc.lr) * decay for v in (hp.client_lr, hp.aux_lr, hp.server_lr))

    def local_batches(self, r: int, client: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Client ``client``'s shuffled mini-batches of round r (local.epochs epochs, or local.steps)."""
        gens: dict = {}
        idx = self.batcher.client_batches(client, r, (), None)
        return [self.batcher.batch_data(b, client, r, (), gens) for b in idx]

    def _fork_rng(self):
        """torch's global RNGs of the run's device, restored after the block."""
        dev = self.placement.device
        return torch.random.fork_rng(devices=[] if dev.type == "cpu" else [dev.index or 0], device_type=dev.type)

    @contextlib.contextmanager
    def stream(self, name: str, *keys: int) -> Iterator[None]:
        """Seed torch's global RNGs (dropout, on the run's device) from a named stream for the block."""
        with self._fork_rng():
            torch.manual_seed(self.seeds.int_seed(name, *keys))
            yield

    def _rng_state(self) -> torch.Tensor:
        dev = self.placement.device
        return torch.get_rng_state() if dev.type == "cpu" else torch.get_device_module(dev.type).get_rng_state(dev)

    def _set_rng_state(self, state: torch.Tensor) -> None:
        dev = self.placement.device
        if dev.type == "cpu":
            torch.set_rng_state(state)
        else:
            torch.get_device_module(dev.type).set_rng_state(state, dev)

    def stream_state(self, name: str, *keys: int) -> torch.Tensor:
        """The state of the device's RNG seeded from a named stream (to resume with :meth:`resumed`)."""
        with self._fork_rng():
            torch.manual_seed(self.seeds.int_seed(name, *keys))
            return self._rng_state()

    @contextlib.contextmanager
    def resumed(self, states: dict, key: Any) -> Iterator[None]:
        """Draw from the stream whose state is ``states[key]`` for the block, and keep where it got to: a
        party's dropout stream goes on across its steps while other parties' steps come in between."""
        with self._fork_rng():
            self._set_rng_state(states[key])
            yield
            states[key] = self._rng_state()

    # ---- messages ------------------------------------------------------------------------------------
    def download(self, r: int, clients: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Fed server -> clients: x_c^t (and a_c^t); returns the stacked per-client rows (Alg. 1 line 3)."""
        k = len(clients)
        self.ledger.record(r, "fed_server", "client", "client_model", k * self.lc.numel * self.ctx.float_bytes, k)
        if self.uses_aux:
            self.ledger.record(r, "fed_server", "client", "aux_model", k * self.la.numel * self.ctx.float_bytes, k)
        return self.xc.expand(k, -1).clone(), self.xa.expand(k, -1).clone()

    def upload_models(self, r: int, clients: np.ndarray) -> None:
        """Clients -> fed server: x_{c,i} (and a_{c,i}) for aggregation; the server holds all n (Table V)."""
        k = len(clients)
        per = self.lc.numel + (self.la.numel if self.uses_aux else 0)
        self.ledger.record(r, "client", "fed_server", "client_model", k * self.lc.numel * self.ctx.float_bytes, k)
        if self.uses_aux:
            self.ledger.record(r, "client", "fed_server", "aux_model", k * self.la.numel * self.ctx.float_bytes, k)
        self.ledger.store("fed_server", "client_models", k * per * self.ctx.float_bytes)

    def send_smashed(self, r: int, smashed: torch.Tensor, labels: torch.Tensor) -> None:
        """Client -> main server: one mini-batch of smashed data (in the dtype the client's forward gave them:
        bfloat16 under bf16-mixed where its last layer autocasts) and its labels."""
        self.ledger.record(r, "client", "server", "smashed", nbytes(smashed))
        self.ledger.record(r, "client", "server", "labels", nbytes(labels))

    def send_gradient(self, r: int, grad: torch.Tensor) -> None:
        """Main server -> client: the gradient of the loss with respect to the smashed data."""
        self.ledger.record(r, "server", "client", "gradient", nbytes(grad))

    def hold_server_models(self, copies: int) -> None:
        """The main server keeps ``copies`` server-side models (one, or one per client): recorded as its
        storage in the ledger and as ``server_copies`` in the round's metrics."""
        self.server_copies = copies
        self.ledger.store("server", "server_models", copies * self.ls.numel * self.ctx.float_bytes)

    # ---- the three updates ---------------------------------------------------------------------------
    def _sgd(self, module: nn.Module, lr: float) -> None:
        params = [p for p in module.parameters() if p.grad is not None]
        with torch.no_grad():
            if self.hp.clip is not None:
                nn.utils.clip_grad_norm_(params, self.hp.clip)
            if self.config.local.grad_clip is not None:
                nn.utils.clip_grad_norm_(params, self.config.local.grad_clip)
            for p in params:
                p.add_(p.grad, alpha=-lr)
                p.grad = None

    def local_step(
        self, x: torch.Tensor, y: torch.Tensor, lr_c: float, lr_a: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Eq. (8): one SGD step of the client-side model and auxiliary net on the local loss.

        Returns the (pre-update) smashed data of this batch, detached, and the loss (a 0-d tensor on the
        device: :meth:`round_metrics` reads the round's losses at once).
        """
        with self.placement.autocast():
            a = self.client(x)
            out = self.aux(a)
        loss = self.loss(out.to(self.ctx.dtype), y)  # the task's loss (cross-entropy in the paper)
        loss.backward()
        self._sgd(self.client, lr_c)
        self._sgd(self.aux, lr_a)
        return a.detach(), loss.detach()

    def server_step(self, smashed: torch.Tensor, y: torch.Tensor, lr: float, *, want_grad: bool = False):
        """Eq. (11): one SGD step of the loaded server-side model on a received smashed batch.

        Returns the loss (a 0-d tensor on the device) and, with ``want_grad`` (FSL_MC/OC), the gradient with
        respect to the smashed data.
        """
        a = smashed.detach().requires_grad_(want_grad)
        with self.placement.autocast():
            out = self.server(a)
        loss = self.loss(out.to(self.ctx.dtype), y)
        loss.backward()
        self._sgd(self.server, lr)
        return loss.detach(), (a.grad if want_grad else None)

    def smashed(self, x: torch.Tensor) -> torch.Tensor:
        """The smashed data of batch ``x``: the loaded client-side model's output, without gradients (in the
        run's autocast)."""
        with torch.no_grad(), self.placement.autocast():
            return self.client(x)

    # ---- the clients' side ---------------------------------------------------------------------------
    # Each party draws its dropout from its own stream: client i from ("dropout", r, i), the main server
    # from ("server_dropout", r) (one model) or ("server_dropout", r, i) (copy i), as on separate machines.
    upload_every: int = 1  # a client with an auxiliary net uploads the smashed data of every h-th batch
    upload_at: str = "end"
    recompute_smashed: bool = False

    def client_epoch(
        self, r: int, client: int, xc: torch.Tensor, xa: torch.Tensor, lrs: tuple[float, float], start: int,
        period: int, seg: int,
    ) -> ClientEpoch:  # fmt: skip
        """One client's local work in segment ``seg`` of round ``r`` (CSE-FSL, FSL_AN): local steps of its
        client-side model and auxiliary net (eq. 8) over its batches ``start .. start + period``, and the
        smashed data of the last batch of each h-window (Alg. 1 lines 10-13; FSL_AN: of every batch). The
        windows restart with each local epoch (:meth:`epoch_batches`); the k-th upload of the round is window k.
        Nothing here depends on the servers."""
        lr_c, lr_a = lrs
        self.load_client(xc, xa)
        batches = self.local_batches(r, client)
        sent = upload_batches(len(batches), self.upload_every, self.upload_at, self.epoch_batches(len(batches)))
        window = {m: w for w, m in enumerate(sent)}
        uploads, losses = [], []
        with self.stream("dropout", r, client, *((seg,) if seg else ())):
            for m in range(start, min(start + period, len(batches))):
                x, y = batches[m]
                a, loss = self.local_step(x, y, lr_c, lr_a)  # eq. (8)
                losses.append(loss)
                if m in window:
                    if self.recompute_smashed:
                        a = self.smashed(x)
                    uploads.append((window[m], m, a, y))
        # the epoch's losses come to the host once (a step keeps its loss on the device)
        return ClientEpoch(self.lc.flatten(), self.la.flatten(), uploads, host_floats(losses), len(batches))

    def check_built(self) -> None:
        """A method that uploads the smashed data of every h-th batch (CSE-FSL's ``h``) must upload some: where
        even the client with the most batches has no full h-window (``upload_at: end``), the main server never
        trains and the run goes on at chance without a word."""
        super().check_built()
        if self.upload_every == 1:
            return
        most = max(self.batcher.num_steps(c) for c in clients_with_data(self.ctx.partition).tolist())
        if upload_batches(most, self.upload_every, self.upload_at, self.epoch_batches(most)):
            return
        window, what = (self.epoch_batches(most), "local epoch") if self.epoch_batches(most) else (most, "round")
        batches = f"{window} batch{'es' * (window != 1)}"
        raise ConfigError(
            f"algorithm.h ({self.upload_every}) is more than the {batches} of the largest client's {what}, so no "
            f"client would upload smashed data (upload_at: {self.upload_at}: the last batch of each full h-window) "
            f"and the main server would never train; give h <= {window}, or more batches per {what}"
        )

    def epoch_batches(self, batches: int) -> int | None:
        """M_i, the batches of one local epoch of a client with ``batches`` local batches in the round (its
        ``local.epochs`` epochs have as many batches each); None for a round of ``local.steps`` steps, which has
        no epochs. Alg. 1 counts m from 0 over one pass of D_i (line 3), so the h-windows restart each epoch, as
        in the authors' code, whose rounds are one epoch with the count restarted (spec §2.5: ⌊M_i/h⌋ uploads
        per epoch)."""
        loc = self.config.local
        return batches // loc.epochs if loc.steps is None and batches else None

    def client_epochs(
        self, r: int, clients: np.ndarray, xc: torch.Tensor, xa: torch.Tensor, lrs: tuple[float, float], start: int,
        period: int, seg: int,
    ) -> list[ClientEpoch]:  # fmt: skip
        """The local work of ``clients`` (from their rows of ``xc`` and ``xa``), one after another on the
        templates; a deployment runs each on the client's node instead (``fedweave.deploy``)."""
        return [self.client_epoch(r, int(i), xc[k], xa[k], lrs, start, period, seg) for k, i in enumerate(clients)]

    def backprop_client(self, r: int, client: int, xc: torch.Tensor) -> BackpropClient:
        """A client of FSL_MC/FSL_OC at the start of round ``r``, from the fed server's x_c (Alg. line 3)."""
        return BackpropClient(client, r, self.placement.to(xc).clone(), self.stream_state("dropout", r, client))

    def client_turn(
        self, c: BackpropClient, batches: list[tuple[torch.Tensor, torch.Tensor]], grad: torch.Tensor | None,
        lr: float,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
        """The client's side of one exchange with the server (Fig. 1): back-propagate ``grad``, the server's
        gradient of the smashed batch it sent last, and step x_c (step 4); then the next batch's smashed
        data and labels (step 2), or None when its batches are done (its model is ``c.xc``)."""
        if grad is not None:
            if not c.sent:
                raise ValueError(f"client {c.client}: a gradient came back before any smashed data went up")
            if c.live is None or self._holder is not c:  # the template holds another model: the same forward again
                self._client_forward(c, batches)
            c.live.backward(grad)
            self._sgd(self.client, lr)
            c.xc, c.rng, c.batch, c.sent = self.lc.flatten(), c.rng_after, c.batch + 1, False
            c.live = c.rng_after = None
        elif c.sent:
            raise ValueError(f"client {c.client}: batch {c.batch}'s gradient is missing")
        if c.batch >= len(batches):
            return None
        a = self._client_forward(c, batches)
        return a.detach(), batches[c.batch][1]

    _holder: BackpropClient | None = None  # the client whose model the client template holds

    def _client_forward(self, c: BackpropClient, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        if self._holder is not c:
            self.load_client(c.xc)
            self._holder = c
        with self._fork_rng(), self.placement.autocast():
            self._set_rng_state(c.rng)
            c.live = self.client(batches[c.batch][0])
            c.rng_after = self._rng_state()
        c.sent = True
        return c.live

    def backprop_session(self, r: int, clients: np.ndarray, xc_rows: torch.Tensor, lr: float) -> BackpropSession:
        """The clients' side of a round of FSL_MC/FSL_OC (a deployment runs it on the nodes)."""
        return BackpropSession(self, r, clients, xc_rows, lr)

    def server_exchange(self, r: int, a: torch.Tensor, y: torch.Tensor, lr: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The main server's side of one batch of traditional split learning (Fig. 1 step 3): the smashed
        data and labels arrive, the loaded server-side model steps (eq. 11), the gradient goes back."""
        self.send_smashed(r, a, y)
        loss, g = self.server_step(a, y, lr, want_grad=True)
        self.send_gradient(r, g)
        return loss, g

    # ---- loading rows into the templates -------------------------------------------------------------
    def load_client(self, xc: torch.Tensor, xa: torch.Tensor | None = None) -> None:
        """Load the flat client-side weights ``xc`` (and the auxiliary net's ``xa``, if given) into the
        templates that :meth:`local_step` and :meth:`smashed` run."""
        self._holder = None
        self.lc.load_(xc)
        if xa is not None:
            self.la.load_(xa)

    def aggregate(self, clients: np.ndarray, xc_rows: torch.Tensor, xa_rows: torch.Tensor) -> None:
        """Eq. (14): the fed server averages the client-side models and auxiliary nets."""
        if self.privacy is not None:  # privacy: DP-FedAvg on each client's (x_c, a_c) update, one release
            nc = self.lc.numel
            if self.uses_aux:
                both = private_average(self.privacy, torch.cat([self.xc, self.xa]), torch.cat([xc_rows, xa_rows], 1))
                self.xc, self.xa = both[:nc], both[nc:]
            else:
                self.xc = private_average(self.privacy, self.xc, xc_rows)
            return
        p = self.weights(clients)
        self.xc = p @ xc_rows
        if self.uses_aux:
            self.xa = p @ xa_rows

    def release_nobody(self, clients: np.ndarray) -> None:
        """Privacy: a round no client's model reached the fed server is, under amplification by Poisson sampling,
        still DP-FedAvg's release (the noise on the empty sum, accounted); otherwise nothing happens."""
        if self.privacy is not None and self.privacy.releases_empty_rounds:
            self.aggregate(clients, self.xc.new_zeros(0, len(self.xc)), self.xa.new_zeros(0, len(self.xa)))

    # ---- metrics -------------------------------------------------------------------------------------
    def round_metrics(
        self, r: int, n: int, steps: int, losses: list[torch.Tensor], server_losses: list[torch.Tensor]
    ) -> dict:
        """The metrics of a round that ran ``steps`` server steps for ``n`` clients: the mean of its local
        ``losses`` (``train_loss``) and ``server_losses`` (``server_loss``), the server copies, the smashed uploads
        per client, and Table V's load in bytes and storage in parameters (all, and with a running-sum
        aggregation)."""
        # the round's losses come to the host once (one float per step, as they were computed)
        losses, server_losses = host_floats(losses), host_floats(server_losses)
        led = self.ledger
        load = sum(led.bytes(kind=k, upto_round=r) for k in ("smashed", "gradient", "client_model", "aux_model"))
        per = self.lc.numel + (self.la.numel if self.uses_aux else 0)
        out = {"train_loss": float(np.mean(losses))} if losses else {}
        if server_losses:  # a round may have no server step (CSE-FSL with fewer than h local batches)
            out["server_loss"] = float(np.mean(server_losses))
        return {
            **out,
            "server_steps": steps,
            "server_copies": self.server_copies,
            # cumulative, over the clients a round schedules (the sampler's mean): not this round's reporters,
            # whose number changes with the faults and would rescale the earlier rounds' uploads
            "smashed_uploads_per_client": led.count(kind="smashed") / (self.sampler.expected() or 1),
            "load_bytes": load,  # Table V load: smashed + gradients + models, labels excluded
            "storage_params": self.server_copies * self.ls.numel + n * per,  # Table V convention
            # running-sum aggregation: one buffer while models arrive, none in a round no client's model reached
            # the fed server (CSE-FSL under faults), which must not hold more than the buffered figure's n = 0
            "storage_params_streaming": self.server_copies * self.ls.numel + min(n, 1) * per,
        }

    def evaluate(self, r: int) -> dict[str, float]:
        """The task's metrics of x_s ∘ x_c on the test set (the auxiliary net is dropped at inference), and
        the main metric of the client side with its auxiliary net (``aux_test_<main>``)."""
        ds, ev, task = self.ctx.dataset, self.config.eval, self.ctx.task
        full = evaluate_task(self.full, torch.cat([self.xc, self.xs]), ds.test_x, ds.test_y, task, ev.batch_size)
        out = {f"test_{k}": v for k, v in full.items()}
        if self.uses_aux:
            w = torch.cat([self.xc, self.xa])
            aux = evaluate_task(self.local_model, w, ds.test_x, ds.test_y, task, ev.batch_size)
            out[f"aux_test_{task.main}"] = aux[task.main]
        return out


def host_floats(values: list[torch.Tensor] | list[float]) -> list[float]:
    """Losses as Python floats: 0-d tensors (on any device) with one trip to the host; floats as they are."""
    if values and isinstance(values[0], torch.Tensor):
        return torch.stack(values).tolist()
    return list(values)


class TimedSplit(SplitAlgorithm):
    """The simulated clock of an asynchronous split round, and the injected faults on it (CSE-FSL).

    Without ``faults.deadline`` client i takes τ_i ~ U[1, speed_spread] per local batch (the ``clock``
    stream, fixed per client) and its upload after batch m arrives at (m+1)·τ_i + latency (with ``agg_every``,
    from the start of its segment, when the fed server has averaged the one before). With a deadline the
    clock is the fault model's: the upload after batch m arrives at ``faults.arrival_times(r, i, w)`` (+ latency)
    with w the m + 1 batches in the clock's unit (``work_units``: ``(m + 1) / reference_batches``, or ``m + 1``
    under ``faults.work_unit: step``), the client's model at the end of its epoch, so the fed server aggregates
    exactly the clients of ``faults.reporting``. A smashed upload past the deadline is discarded (policy
    ``drop``) or, with policy ``late``, joins the server's queue ``ceil(t / deadline) - 1`` rounds later at
    time ``t - delay * deadline`` of that round (rounds last one deadline); uploads in transit are kept in
    the checkpoint. A client that drops out trains nothing and sends nothing in the round. The subclass's
    Hparams carry ``speed_spread`` and ``latency``.
    """

    handles_faults = ("dropout", "deadline", "late")

    def __init__(self, ctx: RunContext, hp: SplitHparams) -> None:
        super().__init__(ctx, hp)
        self.timed = ctx.config.faults.deadline is not None  # the fault model's clock replaces the ``clock`` stream
        self.in_flight: list[InFlight] = []
        if self.timed and hp.speed_spread != 1:
            raise ConfigError(
                f"algorithm.speed_spread ({hp.speed_spread}) cannot be combined with faults.deadline: the client "
                "speeds then come from faults.speed_sigma / faults.speed_jitter; leave speed_spread at 1"
            )

    @property
    def late_policy(self) -> bool:
        """True under straggler policy ``late``: a late smashed upload joins a later round's queue."""
        return "late" in self.faults.active()

    def batch_time(self, client: int) -> float:
        """τ_i: the simulated time client i needs per local batch (a fixed device speed)."""
        return float(self.seeds.numpy("clock", client).uniform(1.0, self.hp.speed_spread))

    def upload_times(self, r: int, client: int, batches: list[int], start: int = 0, offset: float = 0.0) -> np.ndarray:
        """Arrival times of client ``client``'s smashed uploads after the given local batches (0-based), in the
        round segment that starts with batch ``start`` at time ``offset`` (``agg_every``: when the fed server
        has averaged the segment before; without a deadline only, which allows one segment)."""
        if self.timed:
            work = self.work_units(np.asarray(batches, dtype=np.float64) + 1)  # batches 0..m: m + 1 of them
            return self.faults.arrival_times(r, np.full(len(batches), client), work) + self.hp.latency
        done = np.asarray(batches, dtype=np.float64) - start + 1  # the segment's batches up to m
        return offset + done * self.batch_time(client) + self.hp.latency

    def finish_time(self, r: int, client: int, batches: int, offset: float = 0.0) -> float:
        """When client ``client`` finishes its ``batches`` local batches of round ``r`` (of a segment that starts
        at ``offset``)."""
        if self.timed:
            return float(self.faults.arrival_times(r, [client], self.client_work(r, [client]))[0])
        return offset + batches * self.batch_time(client)

    def training_end(self, r: int, client: int, batches: int, offset: float = 0.0) -> float:
        """Until when round ``r`` waits for client ``client``'s training: its :meth:`finish_time`, cut at the
        deadline (the fed server stops waiting then; the next round starts at it)."""
        done = self.finish_time(r, client, batches, offset)
        return min(done, self.config.faults.deadline) if self.timed else done

    def dropped(self, r: int, clients: np.ndarray) -> np.ndarray:
        """Boolean mask over ``clients``: True for those that drop out of round ``r`` (train and send nothing)."""
        return self.faults.dropped(r, clients) if self.faulty else np.zeros(len(clients), dtype=bool)

    def models_on_time(self, r: int, clients: np.ndarray) -> set[int] | None:
        """The clients whose model reaches the fed server by the deadline (None: no deadline, every one)."""
        return set(self.reporting(r, clients).tolist()) if self.timed else None

    def deliver(
        self, r: int, pos: int, client: int, uploads: list, start: int = 0, offset: float = 0.0
    ) -> list[Upload]:
        """The smashed uploads ``(window, batch, smashed, labels)`` of client ``client`` (at position ``pos``
        of the round; in the segment from batch ``start`` at time ``offset``, :meth:`upload_times`) that reach
        the server's queue in round ``r``, in order, each through the ledger; the late ones are held in flight
        (policy ``late``) or discarded (``drop``)."""
        deadline, late_policy = self.config.faults.deadline, self.late_policy
        sent = [m for _, m, _, _ in uploads]
        times = dict(zip(sent, self.upload_times(r, client, sent, start, offset), strict=True))
        arrived = []
        for w, m, a, y in uploads:
            up = Upload(pos, w, m, a, y, arrival=float(times[m]))
            delay = 0 if deadline is None else max(math.ceil(up.arrival / deadline) - 1, 0)
            if delay == 0:
                self.send_smashed(r, a, y)
                arrived.append(up)
            elif late_policy:  # arrives `delay` rounds later (docs/reliability.md)
                up.arrival -= delay * deadline
                up.pos = client
                self.in_flight.append(InFlight(r + delay, client, up))
            # policy drop: past the deadline, discarded, never delivered
        return arrived

    def late_arrivals(self, r: int) -> list[InFlight]:
        """The stragglers' uploads of earlier rounds that reach the server's queue in round ``r`` (through
        the ledger now)."""
        due = [f for f in self.in_flight if f.due == r]
        self.in_flight = [f for f in self.in_flight if f.due != r]
        for f in due:
            self.send_smashed(r, f.upload.smashed, f.upload.labels)
        return due

    def nothing_delivered(self, delivered: set[int]) -> bool:
        """True when, under faults, nothing of any client reached a server this round."""
        return self.faulty and not delivered

    def skipped_round(self) -> dict[str, float]:
        """The metrics of a round in which nothing reached a server (the runner logs it as skipped)."""
        return self.fault_metrics(0)

    def timed_fault_metrics(self, delivered: int, late: int) -> dict[str, float]:
        """``reported_clients`` (clients of which something reached a server), the late uploads processed
        in this round and those still in transit, when faults are injected."""
        if not self.faulty:
            return {}
        return {**self.fault_metrics(delivered), "late_uploads": late, "in_flight_uploads": len(self.in_flight)}

    # ---- checkpoints: the uploads still in flight ------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        if self.in_flight:
            f = self.in_flight
            out["in_flight"] = {
                "ints": torch.tensor(
                    [[x.due, x.client, x.upload.pos, x.upload.window, x.upload.batch] for x in f], device="cpu"
                ),
                "arrival": torch.tensor([x.upload.arrival for x in f], dtype=torch.float64, device="cpu"),
                "smashed": [x.upload.smashed for x in f],
                "labels": [x.upload.labels for x in f],
            }
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        f = state.pop("in_flight", None)
        super().load_state_dict(state)
        self.in_flight = []
        if f is not None:
            for (due, client, pos, window, batch), t, a, y in zip(
                f["ints"].tolist(), f["arrival"].tolist(), f["smashed"], f["labels"]
            ):
                self.in_flight.append(InFlight(due, client, Upload(pos, window, batch, a, y, arrival=t)))
