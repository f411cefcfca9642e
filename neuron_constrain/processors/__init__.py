"""Logits processors, host side: the state that feeds the graph inputs the process-logits
pass adds (``state.py``, writing through ``rows.py``), with what a processor is re-exported
from the graph core (``neuron_constrain/core/processor_interface.py``).

Built-ins, in graph order (see ``neuron_constrain.passes.process_logits_pass``)::

    min_tokens   stop ids masked while a row still has to generate tokens
    logit_bias   sparse per-row token biases (fixed K ids/values per row)
    penalties    repetition / frequency / presence on the distinct tokens a row has seen
                 (prompt and output; fixed L ids per row, with output counts)
    thinking_budget  once a row's thought has its budget of tokens, only the end marker's next
                 token (``RequestParams(thinking_token_budget=N)``; ``ProcessorState(thinking=Thinking(...))``)
    min_p        probability-space threshold; with a per-row temperature before it
                 (sampling paths only: both are argmax-invariant)

Custom processors subclass :class:`LogitsProcessor` and are named in
``processors=[...]`` as an entry point of the ``neuron_constrain.processors`` group or
as ``"module:Qualname"``; a name that does not load, or does not name a
``LogitsProcessor``, raises :class:`ProcessorError` when the list is resolved (at
transform time and when the host state is built), never skipped.

Host state: :class:`ProcessorState` keeps every processor's per-request values in
persistent batch slots (one row per slot, shaped like the graph inputs) and applies
a :class:`BatchUpdate` in the order removed, added, moved (one-way or swap)::

    state = ProcessorState.for_model(transformed, max_num_reqs=64, eos_token_id=eos)
    state.update(BatchUpdate(batch_size=2, added=[(0, RequestParams(min_tokens=5), prompt_ids), ...]))
    tokens = transformed(ids, **state.inputs())        # fixed-shape inputs, one per graph input
    state.append_tokens(tokens)                         # output counts, min_tokens countdown

``inputs()`` returns the same dict object while nothing changed, and for a processor
no request uses it returns cached neutral tensors without touching per-slot data
(the graph still receives every input).
"""
from neuron_constrain.core.processor_interface import (
    BUILTIN_INPUTS,
    BUILTIN_PROCESSORS,
    ENTRY_POINT_GROUP,
    LogitsProcessor,
    ProcessorError,
    builtin_inputs,
    RequestParams,
    Thinking,
    resolve_processors,
)
from neuron_constrain.processors.state import MOVE, SWAP, BatchUpdate, ProcessorState

__all__ = [
    "BUILTIN_INPUTS",
    "BUILTIN_PROCESSORS",
    "MOVE",
    "SWAP",
    "builtin_inputs",
    "ENTRY_POINT_GROUP",
    "BatchUpdate",
    "LogitsProcessor",
    "ProcessorError",
    "ProcessorState",
    "RequestParams",
    "Thinking",
    "resolve_processors",
]
