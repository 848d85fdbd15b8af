"""Decentralized (peer-to-peer) FL: AFIND+ and its baselines and plug-ins."""

from fedweave.algorithms.decentralized import afind_plus, dfedavg, federico, local, pens  # noqa: F401
