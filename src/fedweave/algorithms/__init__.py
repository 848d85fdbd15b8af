"""Algorithm families; importing this package registers every algorithm by name."""

from fedweave.algorithms import centralized  # noqa: F401
