"""LEAF's Shakespeare next-character model: embedding 8 → 2-layer LSTM 256 → Linear to the vocabulary.

The LSTM is written out with plain Linear layers and a loop over time instead of ``nn.LSTM``:
``torch.func.vmap`` has no batching rule for ``aten::lstm`` ("Batching rule not implemented for
aten::lstm.input. We could not generate a fallback." with torch 2.13), so ``nn.LSTM`` cannot be
batched over clients. The loop length is the sequence length, fixed by the input shape, so there is no
data-dependent control flow.

Each layer has one bias per gate, like LEAF's TensorFlow ``BasicLSTMCell``, which also adds a constant
``forget_bias`` (1.0) to the forget gate. ``nn.LSTM`` would carry a second, redundant bias vector
(4·hidden more parameters per layer). Gate order is PyTorch's (input, forget, cell, output), so weights
map one to one onto ``nn.LSTM`` (``bias_ih`` = our bias, ``bias_hh`` = forget_bias on the forget slice).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from fedweave.models.head import HeadedModel
from fedweave.models.options import (
    Opt,
    check_classes,
    check_shape,
    finalize,
    number,
    parse_options,
    pos_int,
)
from fedweave.registry import MODELS


class LSTMLayer(nn.Module):
    """One LSTM layer over a whole sequence: gates = ih(x_t) + hh(h_{t-1})."""

    def __init__(self, input_size: int, hidden: int, forget_bias: float) -> None:
        super().__init__()
        self.hidden_size = hidden
        self.forget_bias = forget_bias
        self.ih = nn.Linear(input_size, 4 * hidden)
        self.hh = nn.Linear(hidden, 4 * hidden, bias=False)
        bound = 1.0 / math.sqrt(hidden)  # nn.LSTM's init: U(-1/√H, 1/√H) for every weight and bias
        for p in self.parameters():
            nn.init.uniform_(p, -bound, bound)

    def forward(self, x: torch.Tensor, keep_sequence: bool) -> torch.Tensor:
        """x (B, T, in) → hidden states (B, T, H) if ``keep_sequence`` else the last one (B, H)."""
        batch, steps = x.shape[0], x.shape[1]
        pre = self.ih(x)  # input projections for all steps at once
        h = pre.new_zeros(batch, self.hidden_size)
        c = pre.new_zeros(batch, self.hidden_size)
        outs = []
        for t in range(steps):
            i, f, g, o = (pre[:, t] + self.hh(h)).chunk(4, dim=-1)
            c = torch.sigmoid(f + self.forget_bias) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            if keep_sequence:
                outs.append(h)
        return torch.stack(outs, dim=1) if keep_sequence else h


class CharLSTM(HeadedModel):
    """int64 characters (B, T) → logits for the next character (B, vocab), from the last step."""

    classifier = ("fc",)

    def __init__(
        self, vocab: int, embed_dim: int, hidden: int, num_layers: int, num_classes: int, forget_bias: float
    ) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, embed_dim)
        sizes = (embed_dim,) + (hidden,) * num_layers
        self.lstm = nn.ModuleList(LSTMLayer(a, hidden, forget_bias) for a in sizes[:-1])
        self.fc = nn.Linear(hidden, num_classes)
        self.featurizer = (f"lstm.{num_layers - 1}",)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embedding(x)
        last = len(self.lstm) - 1
        for k, layer in enumerate(self.lstm):
            h = layer(h, keep_sequence=k < last)
        return h  # the last step's hidden state

    def head(self, z: torch.Tensor) -> torch.Tensor:
        return self.fc(z)


_OPTS = {
    "embed_dim": Opt(8, pos_int, "a positive int (LEAF: 8)"),
    "hidden": Opt(256, pos_int, "a positive int (LEAF: 256)"),
    "num_layers": Opt(2, pos_int, "a positive int (LEAF: 2)"),
    "vocab_size": Opt(None, lambda v: v if v is None else pos_int(v), "a positive int or null (= num_classes)"),
    "forget_bias": Opt(1.0, number, "a finite number (LEAF/TensorFlow BasicLSTMCell: 1.0)"),
}


@MODELS.register("char_lstm")
def build_char_lstm(input_shape: tuple[int, ...], num_classes: int, **options: Any) -> nn.Module:
    """LEAF Shakespeare LSTM; ``input_shape = (seq_len,)`` of int64 character ids, ``num_classes`` = vocab.

    817,872 parameters for LEAF's 80-character vocabulary.
    """
    check_shape("char_lstm", input_shape, ndim=1)
    k = check_classes("char_lstm", num_classes)
    opts = parse_options("char_lstm", options, _OPTS)
    vocab = opts["vocab_size"] or k
    model = CharLSTM(vocab, opts["embed_dim"], opts["hidden"], opts["num_layers"], k, opts["forget_bias"])
    return finalize(model)
