"""Graph rewrites, one per file: ``<name>_pass.py`` defines ``<name>_pass``, whose
:class:`~neuron_constrain.core.contract.PassContract` (``fn.contract``) declares that one
name (the report key too), its options, what it requires and ensures, and the passes
it runs after. Each is ``program -> PassResult(program, report, programs)``; the split
cuts one program into two (``PassResult(body, SplitReport, {"head": head})``).
``transform()`` runs the first three (``transform.PASSES``, in the order their contracts
give: the list below); the split cuts its result (``pipeline.split_step``):

    tap_modules_pass.py     reference tensors may replace named modules' outputs
    mask_logits_pass.py     a logit_mask input per head, applied before sampling
    process_logits_pass.py  min_tokens, logit_bias, penalties, min_p after the mask
    split_at_mask_pass.py   the program cut into a body and a masked head
"""
from .mask_logits_pass import mask_logits_pass
from .process_logits_pass import process_logits_pass
from .split_at_mask_pass import SplitReport, split_at_mask_pass
from .tap_modules_pass import tap_modules_pass

__all__ = ["tap_modules_pass", "mask_logits_pass", "process_logits_pass", "split_at_mask_pass", "SplitReport"]
