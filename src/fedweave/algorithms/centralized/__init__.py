"""Centralized (star) FL: FedAvg and, with FedMIM, its baselines."""

from fedweave.algorithms.centralized import fedavg  # noqa: F401
