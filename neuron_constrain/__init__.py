"""neuron-constrain: compiler passes that make exported decoders grammar-constrainable."""
from neuron_constrain.core.errors import EmptyMaskRowError, Error, InputError, PassError, TransformError
from neuron_constrain.loading import LoadError, load
from neuron_constrain.core.tap_interface import Tap
from neuron_constrain.core.report import PassReport, TransformReport
from neuron_constrain.core.transform import Transformed, transform
# the torch.compile backend: nc.compile(model, ...), nc.backend(inner=...) (a Backend), and
# nc.default_backend, registered with dynamo as backend="neuron_constrain"
from neuron_constrain.decoding.dynamo_backend import Backend, TorchCompiled, backend, compile, default_backend

__version__ = "0.2.0"  # setup.cfg reads it; CHANGELOG.md says what each version changed

__all__ = [
    "Backend",
    "EmptyMaskRowError",
    "Error",
    "InputError",
    "LoadError",
    "PassError",
    "PassReport",
    "Tap",
    "TransformError",
    "TorchCompiled",
    "TransformReport",
    "Transformed",
    "backend",
    "compile",
    "default_backend",
    "load",
    "transform",
]
