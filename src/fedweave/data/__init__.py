"""Data layer: sources (cache, checksums, mirrors), dataset loaders, partitioners, augmentation."""

import fedweave.data.datasets  # noqa: F401  (registers loaders)
import fedweave.data.partition  # noqa: F401  (registers partitioners)
from fedweave.data.base import Dataset

__all__ = ["Dataset"]
