"""Deployment on Flower's deployment engine (SuperLink and SuperNodes): see docs/deployment.md.

Importing this package does not import ``flwr``; only :mod:`fedweave.deploy.server_app` and
:mod:`fedweave.deploy.client_app`, which Flower loads, do (``pip install 'fedweave[flower]'``).
"""
