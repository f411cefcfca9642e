"""Graph rewrites, one per file (``<verb>_<object>_pass.py``). Each is
``program -> (program, PassReport)``, except the split, which cuts one program into
two: ``program -> (body, head, SplitReport)``. The first three in the order ``transform()``
runs them; the split cuts its result (``pipeline.split_step``):

    tap_modules_pass.py     replacement_tap_pass     reference tensors may replace named modules' outputs
    mask_logits_pass.py     mask_logits_pass         a logit_mask input per head, applied before sampling
    process_logits_pass.py  logits_processors_pass   min_tokens, logit_bias, penalties, min_p after the mask
    split_at_mask_pass.py   split_at_mask_pass       the program cut into a body and a masked head
"""
from .mask_logits_pass import mask_logits_pass
from .process_logits_pass import logits_processors_pass
from .split_at_mask_pass import SplitReport, split_at_mask_pass
from .tap_modules_pass import Tap, replacement_tap_pass

__all__ = ["Tap", "replacement_tap_pass", "mask_logits_pass", "logits_processors_pass", "split_at_mask_pass",
           "SplitReport"]
