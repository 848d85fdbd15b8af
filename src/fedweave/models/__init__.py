"""Model zoo; every builder is registered by name in ``fedweave.registry.MODELS``."""
