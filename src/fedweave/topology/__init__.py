"""Who can talk: the peer graphs (``graph``), the confederation's server graph, mixing matrix and ledger roles
(``confederation``) and the samplers of who takes part in a round (``samplers``). Passive descriptions only:
the protocols that use them are the families' bases, ``fedweave.algorithms.<family>.base``, and no module
here imports ``fedweave.algorithms`` (a contract in pyproject.toml, checked by tests/test_architecture.py)."""
