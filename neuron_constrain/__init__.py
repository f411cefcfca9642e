"""neuron-constrain: compiler passes that make exported decoders grammar-constrainable."""
from neuron_constrain.errors import EmptyMaskRowError, Error, InputError, PassError, TransformError
from neuron_constrain.loading import LoadError, load
from neuron_constrain.tap_interface import Tap
from neuron_constrain.report import PassReport, TransformReport
from neuron_constrain.transform import Transformed, transform
# nc.backend is the submodule decoding/backend.py, callable as the factory: nc.backend(inner=...)
# and nc.backend.default_backend both work.
from neuron_constrain.decoding import backend
from neuron_constrain.decoding.backend import Backend, Compiled, compile

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "Compiled",
    "EmptyMaskRowError",
    "Error",
    "InputError",
    "LoadError",
    "PassError",
    "PassReport",
    "Tap",
    "TransformError",
    "TransformReport",
    "Transformed",
    "backend",
    "compile",
    "load",
    "transform",
]
