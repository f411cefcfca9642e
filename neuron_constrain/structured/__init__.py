"""Structured outputs and tool calling on a transformed decoder, driven by a grammar engine
(xgrammar, llguidance, or ``auto``: ``engines/``).

    tok = from_mistral(mistral_data_file("tekken_240911.json"))   # or from_huggingface(AutoTokenizer...)
    model = transform_decoder(GreedyStep(m), (ids,), vocab_size=tok.vocab_size,
                              dynamic_shapes=({0: Dim("batch")},))   # logit_mask input added
    runtime = StructuredRuntime.for_model(model, tok, max_rows=8)    # reuse: grammars cached, compiled async
    result = generate(model, ["a", "b"], [json_schema(schema), None], 32, tokenizer=tok, runtime=runtime)

Per decode step the host does (``StructuredRuntime``):

    step(batch=[r2, r0, r1], drafts={r0: [t1, t2]})
        rows  r2 | r0 r0+t1 r0+t1+t2 | r1           one row per logits row, batch order
        fill  the engine fills each constrained row in place in ONE reusable int32 buffer
              [max_rows, ceil(V/32)] (drafts: fill, accept draft, fill, ..., roll back);
              unconstrained rows are -1 (rewritten only when a grammar row used them)
        ->    buffer[:rows], a view: the packed mask the graph unpacks (V/8 bytes a row)
    accept_rows(batch, tokens) advance each grammar: .finished, and .failed {request: error naming it}

There is no compact mask and no reorder copy: rows are filled where the graph reads
them. Constraints: :func:`json_schema`, :func:`any_json`, :func:`regex`,
:func:`choice`, :func:`ebnf`, and OpenAI tools through :func:`tool_constraint`
(``required``/named -> a grammar in the model's format: JSON, Mistral ``[TOOL_CALLS]``,
Hermes ``<tool_call>``, Llama-3; ``auto``/``none`` -> free text, parsed by
:func:`parse_tool_calls`). Tokenizers: :mod:`tokenizers` (the protocol, adapters, audit). ``enable_structured_outputs=False`` transforms without a
mask input; a constrained request is then refused, never answered unconstrained.
"""
from neuron_constrain.structured.constraints import (
    WHITESPACE,
    Constraint,
    ConstraintError,
    any_json,
    choice,
    ebnf,
    json_schema,
    regex,
)
from neuron_constrain.structured.runtime.generate import GenerateResult, Generation, generate, transform_decoder
from neuron_constrain.structured.errors import (
    BatchLayoutError,
    DisallowedTokenError,
    GrammarFailedError,
    GrammarFillError,
    NoAllowedTokenError,
    RequestFailedError,
    StructuredOutputsDisabledError,
)
from neuron_constrain.structured.runtime.reasoning import Reasoning
from neuron_constrain.structured.runtime.structured_runtime import Accepted, StructuredRuntime
from neuron_constrain.structured.tokenizers import (
    Tokenizer,
    TokenizerInfoError,
    TokenizerLike,
    VocabularyInfo,
    audit,
    from_huggingface,
    from_mistral,
    mistral_data_file,
)
from neuron_constrain.structured.tools import TOOL_FORMATS, ToolCall, ToolCallStream, parse_tool_calls, tool_constraint
from neuron_constrain.structured.validation import validate_output

__all__ = [
    "Accepted",
    "Constraint",
    "ConstraintError",
    "DisallowedTokenError",
    "GrammarFailedError",
    "GrammarFillError",
    "NoAllowedTokenError",
    "RequestFailedError",
    "Tokenizer",
    "TokenizerInfoError",
    "TokenizerLike",
    "VocabularyInfo",
    "audit",
    "from_huggingface",
    "from_mistral",
    "mistral_data_file",
    "TOOL_FORMATS",
    "WHITESPACE",
    "BatchLayoutError",
    "StructuredOutputsDisabledError",
    "StructuredRuntime",
    "Generation",
    "GenerateResult",
    "Reasoning",
    "ToolCall",
    "ToolCallStream",
    "json_schema",
    "any_json",
    "regex",
    "choice",
    "ebnf",
    "tool_constraint",
    "parse_tool_calls",
    "validate_output",
    "transform_decoder",
    "generate",
]
