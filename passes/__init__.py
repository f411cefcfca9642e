"""Graph rewrites, one per file. Each is ``program -> (program, PassReport)``, except
the split, which cuts one program into two: ``program -> (body, head, SplitReport)``."""
from .logits_processors_pass import logits_processors_pass
from .mask_logits_pass import mask_logits_pass
from .replacement_tap_pass import Tap, replacement_tap_pass
from .split_at_mask_pass import SplitReport, split_at_mask_pass

__all__ = ["Tap", "replacement_tap_pass", "mask_logits_pass", "logits_processors_pass", "split_at_mask_pass",
           "SplitReport"]
