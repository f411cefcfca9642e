"""Grammar engines behind one contract (``base.py``): xgrammar, llguidance, and ``auto``.

    engine = make_engine("auto", tokenizer)          # or "xgrammar", "llguidance"
    compiled = engine.compile(json_schema(schema))    # ConstraintError (one line) if refused or malformed
    matcher = engine.matcher(compiled)                # fill_next_token_bitmask / accept_token / rollback / is_terminated
    failures = engine.batch_fill([m0, m1], buffer, [0, 3])   # many rows in one call; [(index, error)]

| module | what it holds |
| --- | --- |
| ``base.py`` | the contract (``GrammarEngine``, ``GrammarMatcher``, ``CompiledGrammar``) and the row checks |
| ``xgrammar/engine.py`` | xgrammar; its batch fill on ``xgrammar/fill_threads.py``'s threads when asked for more than one |
| ``xgrammar/grammars.py`` | every grammar xgrammar builds (a constraint's, tool calls', vLLM's kinds, EBNF checks) and its vocabulary |
| ``llguidance/engine.py`` | llguidance, its matcher adapted to the contract; ``llguidance/tokenizer.py``, ``ebnf_to_lark.py`` |
| ``auto.py`` | xgrammar where it enforces the whole constraint, llguidance for the rest |

Both engines write the same packed rows the graph's ``logit_mask`` takes, for every
constraint kind: JSON schema, any JSON, regex, choice and EBNF (xgrammar's dialect;
converted to Lark for llguidance). Before a JSON schema is compiled, ``keywords.py``
decides which of its keywords the engine would not enforce and refuses them by default.
"""
from __future__ import annotations

from neuron_constrain.structured.engines.auto import AutoEngine
from neuron_constrain.structured.engines.base import CompiledGrammar, GrammarEngine, GrammarMatcher, check_rows
from neuron_constrain.structured.engines.llguidance.ebnf_to_lark import ebnf_to_lark
from neuron_constrain.structured.engines.xgrammar.fill_threads import FillTimeout, RowFillers
from neuron_constrain.structured.engines.llguidance.engine import LLGuidanceEngine, LLGuidanceMatcher
from neuron_constrain.structured.engines.xgrammar.engine import XGrammarEngine

ENGINES = ("xgrammar", "llguidance")  # the engines themselves
ENGINE_CHOICES = ("auto", *ENGINES)  # what engine= takes
_CLASSES = {"auto": AutoEngine, "xgrammar": XGrammarEngine, "llguidance": LLGuidanceEngine}


def allowlists():
    """What each engine enforces of JSON Schema (``keywords.Allowlist``), by engine name."""
    return {name: _CLASSES[name].enforces for name in ENGINES}  # the same lists keywords.allowlists() holds


def make_engine(name: str, tokenizer, *, fill_threads: int = 1, fill_timeout: float = 120.0, limits=None,
                compile_processes: int = 0) -> GrammarEngine:
    """The engine called ``name`` (one of :data:`ENGINE_CHOICES`) for ``tokenizer``'s vocabulary;
    ``fill_timeout``: the longest wait for one of its ``fill_threads`` (when there are several).
    ``limits``: what one constraint may hold and cost (``limits.Limits``); ``compile_processes``:
    xgrammar compiles in that many worker processes, killed past the limits (0: in the caller)."""
    engine = _CLASSES.get(name)
    if engine is None:
        raise ValueError(f"unknown grammar engine {name!r}; pick one of {', '.join(ENGINE_CHOICES)}")
    extra = {} if name == "llguidance" else {"compile_processes": compile_processes}
    return engine(tokenizer, fill_threads=fill_threads, fill_timeout=fill_timeout, limits=limits, **extra)


__all__ = ["AutoEngine", "CompiledGrammar", "ENGINES", "ENGINE_CHOICES", "FillTimeout", "GrammarEngine", "GrammarMatcher",
           "LLGuidanceEngine", "LLGuidanceMatcher", "RowFillers", "XGrammarEngine", "allowlists", "check_rows",
           "ebnf_to_lark", "make_engine"]
