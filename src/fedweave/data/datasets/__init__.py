"""Dataset loaders, one module per format or family; importing this package registers them all."""

from fedweave.data.datasets import (  # noqa: F401  (each module registers its loaders)
    adult,
    bundled,
    cfl_logreg,
    cifar,
    idx,
    leaf,
    libsvm,
    mushroom,
    shakespeare,
    synthetic,
)
