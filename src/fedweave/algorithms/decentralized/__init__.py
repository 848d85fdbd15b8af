"""Decentralized (peer-to-peer) FL: AFIND+ and its baselines and plug-ins."""

from fedweave.algorithms.decentralized import afind_plus, dfedavg, local  # noqa: F401
