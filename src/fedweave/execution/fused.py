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

from collections.abc import Sequence

import torch

from fedweave.execution.batched import layer_spec
from fedweave.execution.params import ParamLayout
from fedweave.execution.placement import take_rows

GATHER = 64  # batches gathered from the training set in one indexing operation
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
        self.dtype = value.dtype  # the run's precision: every work tensor below is made in it
        self.device = value.device  # ... on the parameters' device
        self.gather = layout.placement.rows
        self._ones: dict[int, torch.Tensor] = {}
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
        batches: Sequence[torch.Tensor],
        lrs: Sequence[float],
        momentum: float = 0.0,
        weight_decay: float = 0.0,
    ) -> torch.Tensor:
        """SGD steps (momentum buffers starting at zero) on the rows ``batches[t]`` of the training set
        ``(x, y)`` with step sizes ``lrs[t]``; returns the sum of the steps' mean batch losses (a float64
        0-d tensor on the device, read by the caller without a round trip to the host). Rows are gathered
        where the training set lives and brought to the parameters' device (``Placement.rows``)."""
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
        dev = self.device
        # per step: sum_b <log softmax(z_b), onehot(y_b)>, a 0-d tensor each, stacked at the end
        dots: list[torch.Tensor] = []
        sizes = torch.tensor([len(b) for b in batches], dtype=self.dtype, device=dev)
        eye = torch.eye(self.classes, dtype=self.dtype, device=dev)
        for lo in range(0, len(batches), GATHER):
            chunk = batches[lo : lo + GATHER]
            idx = torch.cat(list(chunk))
            counts = [len(b) for b in chunk]
            xs = gather(x, idx).reshape(len(idx), -1).split(counts)
            targets = take_rows(eye, gather(y, idx)).split(counts)
            for t, (xb, target) in enumerate(zip(xs, targets), start=lo):
                self.step(xb, target, lrs[t], dots)
        return -(torch.stack(dots) / sizes).sum().to(wide)

    def step(self, x: torch.Tensor, target: torch.Tensor, lr: float, dots: list[torch.Tensor]) -> None:
        """One SGD step on rows ``x`` (n, in) with one-hot targets (n, C); appends the summed target
        log-probabilities (0-d) to ``dots``. Written for few operations a step: on 10-row batches each
        operation's dispatch costs about as much as its arithmetic (docs/performance.md)."""
        layers = self.layers
        acts = [x]  # h_0 .. h_{L-1}
        for _, Wt, b in layers[:-1]:
            x = (x.mm(Wt) if b is None else torch.addmm(b, x, Wt)).relu_()
            acts.append(x)
        _, Wt, b = layers[-1]
        z = x.mm(Wt) if b is None else torch.addmm(b, x, Wt)
        logp = torch.log_softmax(z, 1)
        dots.append(torch.dot(logp.view(-1), target.view(-1)))
        dz = logp.exp_().sub_(target)  # n * dloss/dz
        n = x.shape[0]
        ones = self.ones(n)
        plain = not self.momentum and not self.weight_decay
        alpha = -lr / n
        for layer in range(len(layers) - 1, -1, -1):
            W, _, b = layers[layer]
            h = acts[layer]
            dzt = dz.t()
            if layer:  # the next layer down's gradient, at the weights before this step
                dh = _threshold_backward(dz.mm(W), h, 0)
            if plain:  # W -= lr g_W with g_W = (1/n) dz^T h; b -= lr g_b with g_b = (1/n) dz^T 1
                W.addmm_(dzt, h, alpha=alpha)
                if b is not None:
                    b.addmv_(dzt, ones, alpha=alpha)
            else:
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


def fused_sgd(layout: ParamLayout, value: torch.Tensor) -> FusedSGD | None:
    """The fused SGD kernel on ``value`` when the model is a fedweave MLP or softmax regression."""
    return FusedSGD(layout, value) if layer_spec(layout) is not None else None
