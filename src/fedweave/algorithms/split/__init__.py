"""Federated split learning: CSE-FSL and the baselines FSL_MC, FSL_OC, FSL_AN (cse-fsl spec)."""

from fedweave.algorithms.split import cse_fsl, fsl_an, fsl_mc, fsl_oc  # noqa: F401  (registrations)
