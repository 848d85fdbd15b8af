"""Model zoo; every builder is registered by name in ``fedweave.registry.MODELS``.

Importing this package runs the registrations. Use ``build_model(name, input_shape, num_classes,
**options)``; ``docs/models.md`` lists the models, their layers and parameter counts.
"""

from fedweave.models import char_lstm, cnn, linear, resnet  # noqa: F401  (registrations)
from fedweave.models.build import build_model, count_parameters, layer_parameter_names
from fedweave.models.head import HasHead, HeadedModel, has_head

__all__ = ["HasHead", "HeadedModel", "build_model", "count_parameters", "has_head", "layer_parameter_names"]
