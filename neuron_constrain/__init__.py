"""neuron-constrain: compiler passes that make exported decoders grammar-constrainable."""
from neuron_constrain.errors import EmptyMaskRowError, InputError, TransformError
from neuron_constrain.passes.replacement_tap_pass import Tap
from neuron_constrain.report import PassReport, TransformReport
from neuron_constrain.transform import Transformed, transform
# After transform: binds nc.backend to the factory function (not the submodule).
from neuron_constrain.backend import Backend, Compiled, backend, compile

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "Compiled",
    "EmptyMaskRowError",
    "InputError",
    "PassReport",
    "Tap",
    "TransformError",
    "TransformReport",
    "Transformed",
    "backend",
    "compile",
    "transform",
]
