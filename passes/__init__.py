"""Graph rewrites, one per file. Each is ``program -> (program, PassReport)``."""
from .logits_processors_pass import logits_processors_pass
from .mask_logits_pass import mask_logits_pass
from .replacement_tap_pass import Tap, replacement_tap_pass

__all__ = ["Tap", "replacement_tap_pass", "mask_logits_pass", "logits_processors_pass"]
