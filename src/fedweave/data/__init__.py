"""Data layer: sources (cache, checksums, mirrors), dataset loaders, partitioners, augmentation."""

from fedweave.data.base import Dataset

__all__ = ["Dataset"]
