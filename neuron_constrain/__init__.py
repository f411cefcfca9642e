"""neuron-constrain: compiler passes that make exported decoders grammar-constrainable."""
from neuron_constrain.errors import EmptyMaskRowError, InputError, TransformError
from neuron_constrain.report import PassReport, TransformReport
from neuron_constrain.transform import Transformed, transform

__version__ = "0.1.0"

__all__ = [
    "EmptyMaskRowError",
    "InputError",
    "PassReport",
    "TransformError",
    "TransformReport",
    "Transformed",
    "transform",
]
