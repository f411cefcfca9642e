"""Graph rewrites, one per file. Each is ``program -> (program, PassReport)``."""
from .mask_logits_pass import mask_logits_pass

__all__ = ["mask_logits_pass"]
