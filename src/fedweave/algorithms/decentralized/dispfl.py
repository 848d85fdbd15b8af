"""DisPFL (Dai, Shen, He, Tian, Tao 2022): decentralized sparse training with personalized masks.

Each client i holds a binary mask M_i (density ``density``, Erdos-Renyi-Kernel layer densities, drawn
per client) and a sparse model w_i on it. Per round t (Alg. 1):
  1. receive the sparse models w_j of the selected neighbours with their supports S_j (random by default;
     AFIND+ plug-in with ``selection: afind``) and average each coordinate over the models that hold it, then
     apply its own mask: w_i[c] <- M_i[c] sum_j a_j S_j[c] w_j[c] / sum_j a_j S_j[c] over {i} + R_i;
  2. K local epochs of masked SGD on M_i (the gradient and the iterate are masked);
  3. evolve the mask: in every masked layer prune the ceil(r_t |M_i|) active weights of smallest magnitude,
     then regrow as many with the largest gradient magnitude among all weights inactive after the pruning
     (a weight just pruned may come back, as in RigL), with the cosine-annealed rate
     r_t = (alpha/2)(1 + cos(pi t / T)) (``anneal`` alpha = 0.5).
The model a client keeps, sends and is evaluated with is the trained one, on the mask it was trained on
(store ``mask``, its support S_i); the evolved mask (store ``next_mask``) takes effect at the next round's
aggregation, where a regrown weight starts from the neighbours' average (0 if none holds it). This is the
authors' code (rong-dai/DisPFL: ``fire_mask`` takes ceil, ``regrow_mask`` grows on the pruned mask, and the
trained weights are shared with the mask they were trained on), where the paper leaves it open.
Weights of conv and linear layers are masked; biases stay dense. Messages: the non-zero values (float32)
plus the mask as a bitmap (ledger kinds ``model`` and ``mask``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from fedweave.algorithms.base import RunContext
from fedweave.algorithms.decentralized.base import GraphAlgorithm, GraphHparams
from fedweave.algorithms.decentralized.selection import NeighbourSelector, SelectionHparams
from fedweave.config import ConfigError
from fedweave.execution import LocalRule
from fedweave.registry import ALGORITHMS


def erk_densities(shapes: list[tuple[int, ...]], density: float) -> list[float]:
    """Erdos-Renyi-Kernel densities (Evci et al. 2020): d_l proportional to sum(shape)/prod(shape),
    scaled so that the overall density is ``density``; layers that would exceed 1 become dense."""
    n = [math.prod(s) for s in shapes]
    raw = [sum(s) / math.prod(s) for s in shapes]
    dense: set[int] = set()
    while True:
        if len(dense) == len(n):
            return [1.0] * len(n)
        budget = density * sum(n) - sum(n[k] for k in dense)
        eps = budget / sum(raw[k] * n[k] for k in range(len(n)) if k not in dense)
        over = [k for k in range(len(n)) if k not in dense and eps * raw[k] > 1]
        if not over:
            return [1.0 if k in dense else eps * raw[k] for k in range(len(n))]
        dense.update(over)


class MaskedRule(LocalRule):
    """Masked SGD: only the coordinates in the client's mask move."""

    def __init__(self, masks: torch.Tensor) -> None:
        self.masks = masks

    def direction(self, w, grad, jobs):
        return grad(w) * self.masks[jobs]

    def project(self, w, jobs):
        return w * self.masks[jobs]


@dataclass
class DisPFLHparams(SelectionHparams, GraphHparams):
    density: float = 0.5
    anneal: float = 0.5  # alpha of the cosine-annealed prune rate
    finetune_epochs: int = 0  # DisPFL evaluates its personalized sparse models as they are

    def __post_init__(self) -> None:
        GraphHparams.__post_init__(self)
        SelectionHparams.__post_init__(self)
        if not 0 < self.density <= 1:
            raise ConfigError(f"algorithm.density must be in (0, 1], got {self.density}")
        if not 0 <= self.anneal < 1:
            raise ConfigError(f"algorithm.anneal must be in [0, 1), got {self.anneal}")


@ALGORITHMS.register("dispfl")
class DisPFL(GraphAlgorithm):
    name = "dispfl"
    Hparams = DisPFLHparams
    state_fields = ("selector",)  # its neighbour selection's state (AFIND's thresholds)
    undeployable = "its peers grow their sparse masks from gradients on their own data, outside local training"
    dp_refusal = "its peers regrow the sparse masks they send from plain (unclipped, unnoised) gradients on their data"
    uses_total_rounds = True  # the prune rate r_t anneals over the run's T rounds

    def __init__(self, ctx: RunContext, hp: DisPFLHparams) -> None:
        super().__init__(ctx, hp)
        lay = self.layout
        offsets = np.cumsum([0, *lay.numels])
        # masked layers: the weights (ndim >= 2) of conv and linear layers
        self.layers = [(int(offsets[k]), int(offsets[k + 1])) for k, s in enumerate(lay.shapes) if len(s) >= 2]
        dens = erk_densities([lay.shapes[k] for k, s in enumerate(lay.shapes) if len(s) >= 2], hp.density)
        n, P = self.num_clients, lay.numel
        masks = self.store.create("mask", P, fill=1.0, on_device=True)
        for i in range(n):
            g = self.seeds.torch("dispfl_mask", i)
            for (lo, hi), d in zip(self.layers, dens, strict=True):
                k = round(d * (hi - lo))
                row = torch.zeros(hi - lo, device="cpu")  # drawn on the CPU: the same masks on every device
                row[torch.randperm(hi - lo, generator=g, device="cpu")[:k]] = 1.0
                masks[i, lo:hi] = row.to(masks.device)
        self.W.mul_(masks)
        # ``mask``: the support of the model a client holds and sends (the mask it was trained on); ``next_mask``:
        # the evolved mask it applies at the next aggregation (the same at the start)
        self.store.create("next_mask", P, fill=1.0, on_device=True).copy_(masks)
        self.hold("mask", masks[0].numel() * masks.element_size())  # held at the state store's dtype
        self.hold("next_mask", masks[0].numel() * masks.element_size())
        self.selector = NeighbourSelector(self, hp)

    def as_received(self, models: torch.Tensor, r: int, sender: int, receiver: int) -> torch.Tensor:
        """The sparse model of ``sender`` as ``receiver`` holds it: the (noised) values on the sender's mask."""
        return super().as_received(models, r, sender, receiver) * self.store["mask"][sender]

    def finetune_rule(self) -> LocalRule:
        """Fine-tuning before evaluation (``finetune_epochs`` > 0) is masked SGD on each client's mask: the model
        evaluated is the client's sparse model, as DisPFL's are, not a dense copy grown from it."""
        return MaskedRule(self.store["mask"])

    def prune_rate(self, r: int) -> float:
        return self.hp.anneal / 2 * (1 + math.cos(math.pi * r / self.config.rounds))

    def sparse_bytes(self, j: int, mask: torch.Tensor) -> int:
        return int(mask[j].sum()) * self.ctx.float_bytes

    def send_model(self, r: int, sender: int, count: int) -> None:
        """A client's sparse model goes out as its non-zero values plus its mask as a bitmap, also when a
        neighbour selection asks for it to compute a proxy at it."""
        self.peer(r, "model", self.sparse_bytes(sender, self.store["mask"]), count)
        self.peer(r, "mask", math.ceil(self.layout.numel / 8), count)

    def _gradient(self, w: torch.Tensor, client: int, r: int) -> torch.Tensor:
        """Dense gradient of F_i at w on one local batch (for regrowth)."""
        idx = self.trainer.client_batches(client, r, (2,), 1)[0]
        v = w.detach().clone().requires_grad_(True)
        tr = self.trainer
        x, y = tr.placement.rows(tr.train_x, idx), tr.placement.rows(tr.train_y, idx)
        with tr.placement.autocast():
            out = self.layout.functional(v, x)
        loss = tr.loss_fn(out.to(v.dtype), y)
        (g,) = torch.autograd.grad(loss, v)
        return g

    def run_round(self, r: int) -> dict[str, float]:
        if self.all_down(r):
            return self.round_fault_metrics(r)
        n, W0, M0, Mi = self.num_clients, self.W, self.store["mask"].clone(), self.store["next_mask"].clone()
        mask_bytes = math.ceil(self.layout.numel / 8)
        mixed = torch.empty_like(W0)
        picks = self.selector.select(r, W0)
        for i, (chosen, wts) in enumerate(picks):
            for j in chosen:
                self.peer(r, "model", self.sparse_bytes(int(j), M0))
            self.peer(r, "mask", mask_bytes, len(chosen))
            # held as dense rows at the model's width (the masked average reads every M_j and M_j * w_j at once)
            self.hold_received(len(chosen))
            self.hold("received_masks", len(chosen) * M0[0].numel() * M0.element_size())
            group = [i, *chosen.tolist()]
            rows = torch.stack([W0[i], *(self.as_received(W0, r, int(j), i) for j in chosen)])
            a = self.on_device(wts, W0)[:, None] * M0[group]
            num, den = (a * rows).sum(0), a.sum(0)
            # averaged over the models' own supports, then put on i's (evolved) mask
            mixed[i] = torch.where(den > 0, num / den.clamp_min(1e-12), W0[i]) * Mi[i]
        own = self.train_up(r, self.trainer, mixed, rule=MaskedRule(Mi))
        new_w, new_m = own.params.clone(), Mi.clone()
        rate = self.prune_rate(r)
        for i in range(n):  # mask evolution: magnitude prune, gradient regrow
            if not self.is_up(r, i):  # dropped out: model and masks unchanged
                new_w[i], Mi[i] = W0[i], M0[i]
                continue
            g = self._gradient(new_w[i], i, r)
            for lo, hi in self.layers:
                m, w, gr = new_m[i, lo:hi], new_w[i, lo:hi], g[lo:hi]
                active = m.bool()
                k = math.ceil(rate * int(active.sum()))  # the authors' fire_mask rounds up
                if k == 0:
                    continue
                mag = torch.where(active, w.abs(), torch.full_like(w, float("inf")))
                kept = active.clone()
                kept[torch.topk(mag, k, largest=False).indices] = False
                # regrow among every weight off the pruned mask, the k just pruned included (RigL's
                # ArgTopK over i not in theta minus I_drop; the authors' regrow_mask on the pruned mask)
                grow_score = torch.where(kept, torch.full_like(gr, -1.0), gr.abs())
                kept[torch.topk(grow_score, k).indices] = True
                m.copy_(kept.to(m.dtype))
        # the trained models stay on the masks they were trained on, which go out with them; the evolved masks
        # apply from the next aggregation
        self.commit("model", new_w)
        self.commit("mask", Mi)
        self.commit("next_mask", new_m)
        sizes = torch.tensor([float(len(c)) for c, _ in picks], dtype=torch.float64, device="cpu")
        return {
            "train_loss": self.train_loss(r, own),
            "selected_mean": self.mean_over_up(r, sizes),
            "density": float(new_m.mean()),
            **self.round_fault_metrics(r),
        }
