"""Decentralized (peer-to-peer) FL: AFIND+ and its baselines and plug-ins, and CHOCO-SGD's compressed gossip."""

from fedweave.algorithms.decentralized import afind_plus, choco, dfedavg, dispfl, ditto, federico, fomo, local, pens  # noqa: F401
