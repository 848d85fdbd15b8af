"""Confederated FL: edge servers on a graph, each with its own users (CFL-SAGA and its baselines)."""

from fedweave.algorithms.confederated import cfl_admm, cfl_saga, gt_saga, gt_sarah, gt_svrg  # noqa: F401
