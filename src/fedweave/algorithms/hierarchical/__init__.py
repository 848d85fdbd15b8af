"""Hierarchical / bilevel FL: a server with its own data above personalized clients (ZO-HFL and baselines)."""

from fedweave.algorithms.hierarchical import baselines, zo_hfl  # noqa: F401
