"""Grammar engines behind one contract (``base.py``): xgrammar, llguidance, and ``auto``.

    engine = make_engine("auto", tokenizer)          # or "xgrammar", "llguidance"
    compiled = engine.compile(json_schema(schema))    # ConstraintError (one line) if refused or malformed
    matcher = engine.matcher(compiled)                # fill_next_token_bitmask / accept_token / rollback / is_terminated
    failures = engine.batch_fill([m0, m1], buffer, [0, 3])   # many rows in one call; [(index, error)]

| module | what it holds |
| --- | --- |
| ``base.py`` | the contract (``GrammarEngine``, ``GrammarMatcher``, ``CompiledGrammar``) and the row checks |
| ``xgrammar/`` | xgrammar (``engine.py``); its grammars (``grammars.py``), worker processes, fill threads |
| ``llguidance/`` | llguidance, its matcher adapted to the contract (``engine.py``); ``tokenizer.py``, ``ebnf_to_lark.py`` |
| ``auto.py``, ``race.py`` | xgrammar where it enforces the whole constraint, llguidance for the rest; where both are exact, the race |
| ``item_tracker.py`` | ``uniqueItems``/``contains``, and ``minProperties`` on open objects, ``not`` over members, enforced on the host, in front of an engine's matcher |

Both engines write the same packed rows the graph's ``logit_mask`` takes, for every
constraint kind: JSON schema, any JSON, regex, choice and EBNF (xgrammar's dialect;
converted to Lark for llguidance). Engines compile from the schema compiler's prepared form
(``schema/prepare.py``): ``keywords.py`` decides which keywords an engine would not enforce, refused by default.
"""
from __future__ import annotations

from neuron_constrain.structured.engines.auto import AutoEngine
from neuron_constrain.structured.engines.base import CompiledGrammar, GrammarEngine, GrammarMatcher, check_rows
from neuron_constrain.structured.engines.llguidance.ebnf_to_lark import ebnf_to_lark
from neuron_constrain.structured.engines.xgrammar.fill_threads import FillTimeout, RowFillers
from neuron_constrain.structured.engines.llguidance.engine import LLGuidanceEngine, LLGuidanceMatcher
from neuron_constrain.structured.engines.xgrammar.engine import XGrammarEngine

__all__ = ["AutoEngine", "CompiledGrammar", "ENGINES", "ENGINE_CHOICES", "FillTimeout", "GrammarEngine",
           "GrammarMatcher", "LLGuidanceEngine", "LLGuidanceMatcher", "RowFillers", "XGrammarEngine", "allowlists",
           "auto", "base", "check_rows", "ebnf_to_lark", "item_tracker", "llguidance", "make_engine", "race",
           "xgrammar"]

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
