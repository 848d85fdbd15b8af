"""Decentralized (peer-to-peer) FL: AFIND+ and its baselines and plug-ins."""

from fedweave.algorithms.decentralized import afind_plus, dfedavg, dispfl, ditto, federico, fomo, local, pens  # noqa: F401
