"""Plain local SGD on an MLP or softmax regression with backpropagation written out and the update fused
into it, for the loop backend.

With small models and small batches (the overhead-bound workloads: a 784-64-10 MLP, batch 10) a step is
dominated by per-operation dispatch, and autograd roughly doubles the number of operations. For the
flatten -> (Linear -> ReLU)* -> Linear models of ``fedweave.models.linear`` under cross-entropy, one step on
a batch of n rows is (the same equations as ``execution.batched``, for one job):

  forward   h_0 = x,  h_l = relu(h_{l-1} W_l^T + b_l),  z = h_{L-1} W_L^T + b_L
  loss      -(1/n) sum_b <log softmax(z_b), onehot(y_b)>
  backward  dz_L = softmax(z) - onehot(y)  (n times dloss/dz),
            dz_{l-1} = (dz_l W_l) * [h_{l-1} > 0]  (taken before W_l changes)
  update    W_l += -(lr/n) dz_l^T h_{l-1},  b_l += -(lr/n) dz_l^T 1

The update is one in-place ``addmm_`` / ``addmv_`` per parameter on the flat parameter buffer: no gradient
buffer, no autograd graph, no allocation for the parameters. Weight decay and heavy-ball momentum follow
``LocalTrainer.sgd_update`` (torch.optim.SGD): d = g + wd w, buf = m buf + d, w -= lr buf; with momentum the
gradient goes into the buffer by the same ``addmm_`` (beta = m). Gradient clipping needs the whole gradient
first, so it is not fused. The result equals autograd's SGD step to float rounding (tests in
``tests/test_execution_kernels.py``); on the 784-64-10 MLP at batch 10 it takes about half the CPU time
(docs/performance.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from fedweave.execution.batched import layer_spec
from fedweave.execution.params import ParamLayout
from fedweave.execution.placement import take_rows

GATHER = 64  # batches gathered from the training set in one indexing operation
# the loop backend gathers the rows of consecutive jobs together, up to this many bytes of inputs at once
GATHER_BYTES = 1 << 20


@dataclass
class Rows:
    """A job's batches already gathered: per step its input rows ``xs[t]`` (n, in), one-hot targets
    ``targets[t]`` (n, C), and the batch sizes ``sizes`` (a tensor in the parameters' dtype)."""

    xs: Sequence[torch.Tensor]
    targets: Sequence[torch.Tensor]
    sizes: torch.Tensor

    def __len__(self) -> int:
        return len(self.xs)


_threshold_backward = torch.ops.aten.threshold_backward.default  # the overload itself: no resolution per call


class FusedSGD:
    """In-place plain SGD steps on the flat parameter buffer ``value`` of an MLP or softmax regression."""

    def __init__(self, layout: ParamLayout, value: torch.Tensor) -> None:
        spec = layer_spec(layout)
        if spec is None:
            raise ValueError("FusedSGD needs a fedweave MLP or logistic model (see fused_sgd)")
        weights = [value[w0:w1].view(n_out, n_in) for (w0, w1), n_out, n_in, _ in spec]
        # (W, W^T, b): the transposed views made once, not at every step
        self.layers = [(w, w.t(), None if b is None else value[b[0] : b[1]]) for w, (*_, b) in zip(weights, spec)]
        self.classes = spec[-1][1]
        # the step's loops, unpacked once: (W^T, b) of the hidden layers, of the output layer, and
        # (index, W, b) of every layer from the top down
        self.hidden = [(Wt, b) for _, Wt, b in self.layers[:-1]]
        self.top = self.layers[-1][1:]
        self.down = [(i, W, b) for i, (W, _, b) in reversed(list(enumerate(self.layers)))]
        self.dtype = value.dtype  # the run's precision: every work tensor below is made in it
        self.device = value.device  # ... on the parameters' device
        self.gather = layout.placement.rows
        self._ones: dict[int, torch.Tensor] = {}
        self._eye: torch.Tensor | None = None
        self.momentum, self.weight_decay = 0.0, 0.0
        # heavy-ball buffers of (W, b) per layer, made on first use with momentum
        self.bufs: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None

    def ones(self, n: int) -> torch.Tensor:
        o = self._ones.get(n)
        if o is None:
            o = self._ones[n] = torch.ones(n, dtype=self.dtype, device=self.device)
        return o

    def run(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        batches: Sequence[torch.Tensor] | Rows,
        lrs: Sequence[float],
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        dots: list[torch.Tensor] | None = None,
    ) -> torch.Tensor | None:
        """SGD steps (momentum buffers starting at zero) on the rows ``batches[t]`` of the training set
        ``(x, y)`` (or on rows already gathered: ``Rows``, from :meth:`gathered`) with step sizes ``lrs[t]``;
        returns the sum of the steps' mean batch losses (a float64 0-d tensor on the device, read by the caller
        without a round trip to the host). Rows are gathered where the training set lives and brought to the
        parameters' device (``Placement.rows``).

        ``dots``: for ``Rows`` with at least one step, the steps' summed target log-probabilities are appended
        to this list instead and None is returned; :func:`job_losses` then reduces many jobs' at once, to
        the same bits."""
        wide = torch.float32 if self.device.type == "mps" else torch.float64  # MPS has no float64
        if not batches:
            return torch.zeros((), dtype=wide, device=self.device)
        gather = self.gather
        self.momentum, self.weight_decay = momentum, weight_decay
        if momentum:
            if self.bufs is None:
                zeros = torch.zeros_like
                self.bufs = [(zeros(W), None if b is None else zeros(b)) for W, _, b in self.layers]
            for bw, bb in self.bufs:
                bw.zero_()
                if bb is not None:
                    bb.zero_()
        if isinstance(batches, Rows):  # gathered by the caller (``gathered``), with others' rows
            step = self.step
            own = [] if dots is None else dots
            for xb, target, lr in zip(batches.xs, batches.targets, lrs):
                step(xb, target, lr, own)
            return None if dots is not None else -(torch.stack(own) / batches.sizes).sum().to(wide)
        dev = self.device
        # per step: sum_b <log softmax(z_b), onehot(y_b)>, a 0-d tensor each, stacked at the end
        dots = []
        sizes = torch.tensor([len(b) for b in batches], dtype=self.dtype, device=dev)
        eye = self.eye()
        for lo in range(0, len(batches), GATHER):
            chunk = batches[lo : lo + GATHER]
            idx = torch.cat(list(chunk))
            counts = [len(b) for b in chunk]
            xs = gather(x, idx).reshape(len(idx), -1).split(counts)
            targets = take_rows(eye, gather(y, idx)).split(counts)
            for t, (xb, target) in enumerate(zip(xs, targets), start=lo):
                self.step(xb, target, lrs[t], dots)
        return -(torch.stack(dots) / sizes).sum().to(wide)

    def eye(self) -> torch.Tensor:
        """The one-hot rows of the classes (made once)."""
        e = self._eye
        if e is None:
            e = self._eye = torch.eye(self.classes, dtype=self.dtype, device=self.device)
        return e

    def gathered(
        self, x: torch.Tensor, y: torch.Tensor, jobs: Sequence[tuple[torch.Tensor, list[int]]]
    ) -> Iterator[Rows | list[torch.Tensor]]:
        """Each job's batches for :meth:`run`, in order, from ``jobs``: per job the indices of its batches one
        after another and their sizes (``LocalTrainer.flat_batches``). The rows of consecutive jobs are gathered
        from the training set ``(x, y)`` in one indexing operation, up to ``GATHER_BYTES`` of inputs (one
        gather a job cost about as much as its steps' dispatch on 10-row batches); a job larger than that on
        its own gets its index batches, which :meth:`run` gathers ``GATHER`` at a time. The rows are copies,
        so the steps see the same values, whichever gather brought them."""
        features = x[:1].numel()
        budget = max(1, GATHER_BYTES // max(features * x.element_size(), 1))
        eye, gather, dev, k = self.eye(), self.gather, self.device, 0
        while k < len(jobs):
            flat, sizes = jobs[k]
            if len(flat) > budget:  # alone over the budget: gathered by run, GATHER batches at a time
                yield list(flat.split(sizes)) if sizes else []
                k += 1
                continue
            end, rows = k + 1, len(flat)
            while end < len(jobs) and rows + len(jobs[end][0]) <= budget:
                rows += len(jobs[end][0])
                end += 1
            group = jobs[k:end]
            idx = torch.cat([f for f, _ in group]) if end - k > 1 else flat
            counts = [c for _, s in group for c in s]
            xs = gather(x, idx).reshape(len(idx), features).split(counts)
            targets = take_rows(eye, gather(y, idx)).split(counts)
            sizes_all = torch.tensor(counts, dtype=self.dtype, device=dev)
            t = 0
            for _, s in group:
                yield Rows(xs[t : t + len(s)], targets[t : t + len(s)], sizes_all[t : t + len(s)])
                t += len(s)
            k = end

    def step(self, x: torch.Tensor, target: torch.Tensor, lr: float, dots: list[torch.Tensor]) -> None:
        """One SGD step on rows ``x`` (n, in) with one-hot targets (n, C); appends the summed target
        log-probabilities (0-d) to ``dots``. Written for few operations a step, and little Python: on 10-row
        batches each operation's dispatch costs about as much as its arithmetic (docs/performance.md)."""
        acts = [x]  # h_0 .. h_{L-1}
        for Wt, b in self.hidden:
            x = (x.mm(Wt) if b is None else torch.addmm(b, x, Wt)).relu_()
            acts.append(x)
        Wt, b = self.top
        logp = torch.log_softmax(x.mm(Wt) if b is None else torch.addmm(b, x, Wt), 1)
        dots.append(torch.dot(logp.view(-1), target.view(-1)))
        dz = logp.exp_().sub_(target)  # n * dloss/dz
        n = x.shape[0]
        ones = self._ones.get(n)
        if ones is None:
            ones = self.ones(n)
        if not self.momentum and not self.weight_decay:
            alpha = -lr / n
            for layer, W, b in self.down:
                h, dzt = acts[layer], dz.t()
                if layer:  # the next layer down's gradient, at the weights before this step
                    dz = _threshold_backward(dz.mm(W), h, 0)
                # W -= lr g_W with g_W = (1/n) dz^T h; b -= lr g_b with g_b = (1/n) dz^T 1
                W.addmm_(dzt, h, alpha=alpha)
                if b is not None:
                    b.addmv_(dzt, ones, alpha=alpha)
            return
        for layer, W, b in self.down:
            h, dzt = acts[layer], dz.t()
            if layer:
                dh = _threshold_backward(dz.mm(W), h, 0)
            bw, bb = self.bufs[layer] if self.momentum else (None, None)
            self._sgd(W, bw, dzt, h, lr)
            if b is not None:
                self._sgd(b, bb, dzt, ones, lr)
            if layer:
                dz = dh

    def _sgd(self, P: torch.Tensor, buf: torch.Tensor | None, A: torch.Tensor, B: torch.Tensor, lr: float) -> None:
        """One torch.optim.SGD step of parameter ``P`` in place, its gradient being g = (1/n) A B with n the
        batch size (``A.shape[1]``); a matrix product for a weight, a matrix-vector product for a bias."""
        n, wd = A.shape[1], self.weight_decay
        add_product = torch.Tensor.addmm_ if B.dim() == 2 else torch.Tensor.addmv_  # T = beta T + alpha A B
        if buf is None:  # no momentum: P - lr (g + wd P) = (1 - lr wd) P - lr g
            if wd:
                P.mul_(1.0 - lr * wd)
            add_product(P, A, B, alpha=-lr / n)
            return
        add_product(buf, A, B, beta=self.momentum, alpha=1.0 / n)  # buf = m buf + g
        if wd:
            buf.add_(P, alpha=wd)  # ... + wd P
        P.add_(buf, alpha=-lr)


def job_losses(dots: Sequence[torch.Tensor], sizes: Sequence[torch.Tensor], wide: torch.dtype) -> torch.Tensor:
    """Each job's sum of its steps' mean batch losses, as :meth:`FusedSGD.run` returns it for ``Rows``, for
    jobs whose steps appended their ``dots`` one job after another, ``sizes`` their batch sizes (``Rows.sizes``):
    one stack and one division for them all, then one sum a job (a sum of a slice is that of the same values
    alone: the same bits); a vector in ``wide``. Per job the stack, division, negation and conversion cost
    about as much as a step's dispatch."""
    q = torch.stack(list(dots)) / torch.cat(list(sizes))
    return (-torch.stack([part.sum() for part in q.split([len(s) for s in sizes])])).to(wide)


def fused_sgd(layout: ParamLayout, value: torch.Tensor) -> FusedSGD | None:
    """The fused SGD kernel on ``value`` when the model is a fedweave MLP or softmax regression."""
    return FusedSGD(layout, value) if layer_spec(layout) is not None else None
