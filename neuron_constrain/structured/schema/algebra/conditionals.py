"""The conditional keywords as ``anyOf`` over their cases, the complement written positively.

    {dependentRequired: {a: [b]}}          -> anyOf [{properties: {a: false}}, {required: [a, b]}]
    {dependentSchemas: {a: S}}             -> anyOf [{properties: {a: false}}, {required: [a]} ∧ S]
    {if: I, then: T, else: E}              -> anyOf [I ∧ T, not-I ∧ E]          (not-I: logic.complement)
    {oneOf: [A, B]}  (proven disjoint)     -> anyOf [A, B]
    {oneOf: [A, B]}  (may overlap)         -> anyOf [A ∧ not-B, B ∧ not-A]      (where both complements exist;
                                              a finite A: the values of A that B refuses, judged)
    {not: S}                               -> the complement of S
    {allOf: [A, B]}  (plain branches)      -> A and B merged into the node (logic.merge)
    then/else without if, if alone, min/maxContains without contains, minContains 0 alone,
    uniqueItems: false, empty dependencies  -> dropped (they assert nothing)

Absence is written ``{"properties": {k: false}}`` (a value for ``k`` fails, so ``k`` is absent;
a non-object passes, as it passes ``dependentRequired``). A rewrite adds its result to the node as
one more conjunct (``attach``): merged where that keeps the meaning, else the node's ``anyOf``
(if free) or its ``allOf``; a subtree holding a keyword no rewrite took is never moved (``stuck``),
so what is refused is named where the user wrote it.
"""
from __future__ import annotations

from neuron_constrain.structured.schema import rewrite as rewrite
from neuron_constrain.structured.schema.algebra import logic
from neuron_constrain.structured.schema.algebra.caps import over
from neuron_constrain.structured.schema.algebra.disjoint import apart_beyond_empty, disjoint, empty_overlap, finite_values
from neuron_constrain.structured.schema.algebra.logic import is_true, join, meet
from neuron_constrain.structured.schema.algebra.negation import complement

# Keywords the algebra removes where it can; left in a subtree, they make it stuck (never moved).
ELIMINATED = frozenset({"if", "then", "else", "not", "dependentRequired", "dependentSchemas", "dependencies",
                        "contains", "minContains", "maxContains", "uniqueItems", "unevaluatedItems",
                        "unevaluatedProperties", "$dynamicRef", "$recursiveRef", "additionalItems"})


def stuck(*schemas) -> bool:
    return any(ELIMINATED & set(node) for schema in schemas for _, node in rewrite.walk(schema))


def attach(node: dict, conjunct):
    """``node`` ∧ ``conjunct``: merged into the node where exact, else in its free ``anyOf`` or its ``allOf``."""
    if conjunct is False:
        return False
    if is_true(conjunct):
        return node
    merged = logic.merge(logic.assertions(node), conjunct) if isinstance(conjunct, dict) else None
    if merged is False:
        return False
    if merged is not None:
        for key in logic.assertions(node):
            del node[key]
        node.update(merged)
    elif set(conjunct) == {"anyOf"} and "anyOf" not in node:
        node["anyOf"] = conjunct["anyOf"]
    else:
        node["allOf"] = [*node.get("allOf", []), conjunct]
    return node


def conjunction(node: dict, path: str, judge):
    """``allOf``'s plain branches (no combinator, ``$ref`` or keyword left unrewritten) written into the
    node where ``logic.merge`` keeps the meaning: patterns intersected, bounds tightened, properties
    met name by name. An engine then reads one node (xgrammar does not intersect branches that share
    a keyword; llguidance gives up deciding whether several patterns leave any string)."""
    branches = node.get("allOf")
    plain = [isinstance(b, dict) and logic.simple(b) and not stuck(b) for b in branches] if isinstance(
        branches, list) else []
    if not any(plain):
        return node  # as written (engines generate properties in the order the keywords give them)
    del node["allOf"]
    for branch, merge in zip(branches, plain):
        if merge:
            node = attach(node, branch)
            if node is False:
                return False
        else:
            node["allOf"] = [*node.get("allOf", []), branch]
    return node


def drop_vacuous(node: dict, path: str, judge):
    if "if" not in node:
        node.pop("then", None)
        node.pop("else", None)
    elif "then" not in node and "else" not in node:
        del node["if"]
    if "contains" not in node:
        node.pop("minContains", None)
        node.pop("maxContains", None)
    elif node.get("minContains") == 0 and "maxContains" not in node:
        del node["contains"], node["minContains"]
    if node.get("uniqueItems") is False or (node.get("uniqueItems") is True and node.get("maxItems") in (0, 1)):
        del node["uniqueItems"]
    for key in ("dependentRequired", "dependentSchemas"):
        if isinstance(node.get(key), dict) and not node[key]:
            del node[key]
    return node


def dependencies(node: dict, path: str, judge):
    required, schemas = node.get("dependentRequired"), node.get("dependentSchemas")
    if not isinstance(required or {}, dict) or not isinstance(schemas or {}, dict) or stuck(*(schemas or {}).values()):
        return node
    conjuncts = []
    for name, needed in (required or {}).items():
        if not isinstance(needed, list):
            return node
        more = [n for n in dict.fromkeys(needed) if n != name]
        if more:
            conjuncts.append(join([{"properties": {name: False}}, _present(name, {"required": more})]))
    for name, sub in (schemas or {}).items():
        conjuncts.append(join([{"properties": {name: False}}, _present(name, sub)]))
    node.pop("dependentRequired", None)
    node.pop("dependentSchemas", None)
    for conjunct in conjuncts:
        node = attach(node, conjunct)
        if node is False:
            return False
    return node


def _present(name: str, sub):
    """``name`` is present, and ``sub`` holds (the names declared, so engines write them in this order)."""
    declared = {"required": [name], "properties": {name: {}}}
    merged = meet(declared, sub)
    if isinstance(merged, dict) and "allOf" not in merged:
        return merged
    return meet({"required": [name]}, sub)


def conditional(node: dict, path: str, judge):
    if "if" not in node:
        return node
    condition, then, otherwise = node["if"], node.get("then", {}), node.get("else", {})
    if stuck(condition, then, otherwise):
        return node
    negated = complement(condition, judge.resolve)
    if negated is None:
        return node
    for key in ("if", "then", "else"):
        node.pop(key, None)
    return attach(node, join([meet(condition, then), meet(negated, otherwise)]))


def one_of(node: dict, path: str, judge):
    branches = node.get("oneOf")
    if not isinstance(branches, list) or stuck(*branches):
        return node
    within = logic.atoms({k: v for k, v in node.items() if k in ("type", "enum", "const")})
    overlapping = {(i, j) for i in range(len(branches)) for j in range(len(branches))
                   if i != j and not disjoint(branches[i], branches[j], judge, within)}
    emptied = empty_overlap(branches, judge, within) if overlapping else {}
    if emptied is not None and emptied:  # branches that overlap only on [], {}, "": those values excluded
        overlapping = {(i, j) for i, j in overlapping if not apart_beyond_empty(branches[i], branches[j], judge, within)}
    cases = []
    for i, branch in enumerate(branches):
        others = [branches[j] for j in range(len(branches)) if (i, j) in overlapping]
        case = _finite_case(branch, others, judge)
        if case is None:
            case = branch
            for other in others:
                negated = complement(other, judge.resolve)
                if negated is None:
                    return node
                case = meet(case, negated)
        cases.append(case)
    over("branches", len(cases))
    del node["oneOf"]
    node = attach(node, emptied) if emptied else node
    return node if node is False else attach(node, join(cases))


def _finite_case(branch, others: list, judge):
    """A finite ``oneOf`` branch's case: its values no other branch accepts (``jsonschema`` judges), as
    an ``enum`` beside it (False: none); None where the branch is not finite or a value is unjudged."""
    values = finite_values(branch)
    if values is None or not others:
        return None
    try:
        kept = [v for v in values if not any(judge.valid(other, v) for other in others)]
    except judge.Unjudged:
        return None
    return meet(branch, {"enum": kept}) if kept else False


def negation(node: dict, path: str, judge):
    if "not" not in node or stuck(node["not"]):
        return node
    negated = complement(node["not"], judge.resolve)
    if negated is None:
        return node
    del node["not"]
    return attach(node, negated)
