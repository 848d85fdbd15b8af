"""Algorithm families. Each family is a subpackage (``centralized``, ``decentralized``, ``split``,
``hierarchical``, ``confederated``) whose ``__init__`` imports all its algorithm modules, which register
themselves by name at their definition. The registries (``fedweave.registry.ALGORITHM_FAMILIES``) import the
families on first use, one at a time until the name looked up is found, so importing a topology or an
algorithm module directly never imports the other families (and never cycles back to itself)."""
