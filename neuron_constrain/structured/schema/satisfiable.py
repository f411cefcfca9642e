"""``check(schema)``: refuse a JSON schema that no value satisfies, or whose shortest value is too long.

    check(schema)                      # UnsatisfiableError: "the schema admits no value: ... at #/..."
    check(schema, answer_chars=16384)  # LimitError("answer_chars"): its shortest value has more characters
    shortest(schema)                   # a lower bound on its values' length as compact JSON (inf: none)

An engine compiles such a schema into a grammar with no way to finish (a ``$ref`` cycle with
no base case compiles, and its request then dies mid-answer); refused before any engine reads
it, the request gets a 400 that names the reason. Found, and nothing else (what it cannot
judge it lets through): ``false``; an empty ``enum``, or one without a value of the declared
type; a ``const`` of another type; contradictory bounds (``minimum`` above ``maximum``,
exclusive bounds that meet, no integer between the bounds of an ``integer``, ``minLength``
above ``maxLength``, ``minItems`` above ``maxItems``, ``minProperties`` above
``maxProperties`` or below the ``required`` count); a required property whose schema admits
nothing, or which ``additionalProperties: false`` forbids; items an array must have that
admit nothing; a ``$ref`` to a schema that admits nothing; ``anyOf``/``oneOf`` whose every
branch admits nothing, ``allOf`` with one such branch.

Which schema objects admit a finite value is a least fixed point over the schema graph: all
start unknown (no), each becomes yes when its own keywords allow a value given what its
subschemas admit, and a node is looked at again only when a subschema it reads turned yes
(a worklist: linear in the schema). A ``$ref`` cycle whose every path requires going round
again never turns yes. The shortest value's length is the same fixed point over numbers
(a lower bound: the required properties, ``minItems`` items, ``minLength`` characters, the
shortest ``enum`` value, the shortest ``anyOf`` branch, written without whitespace), which
finds what no answer could fit in: ``$ref``s that double at each level, bounds that multiply
through nesting. Iterative throughout: depth costs no stack.
"""
from __future__ import annotations

import json
import math

from neuron_constrain.structured.schema import rewrite as rewrite
from neuron_constrain.structured.constraints import ConstraintError
from neuron_constrain.structured.schema.limits import LimitError

TYPES = ("null", "boolean", "object", "array", "number", "string", "integer")


class UnsatisfiableError(ConstraintError):
    """A JSON schema no value satisfies; ``where`` is the JSON pointer of the reason."""

    def __init__(self, why: str, where: str):
        self.where = where
        super().__init__(f"the schema admits no value: {why}; fix the schema (no answer could ever be valid)")


def check(schema, answer_chars: int | None = None) -> None:
    """Raise :class:`UnsatisfiableError` if ``schema`` (a JSON schema dict) admits no value, and
    ``LimitError("answer_chars")`` if its shortest value is longer than ``answer_chars``."""
    if schema is False:
        raise UnsatisfiableError("it is `false`", "#")
    if not isinstance(schema, dict):
        return
    state, nodes = _solved(schema)
    if not state.ok[id(schema)]:
        raise UnsatisfiableError(*state.explain(schema))
    if answer_chars is not None:
        least = _Shortest(state).solve(nodes)
        if least > answer_chars:
            raise LimitError("answer_chars", f"{least:,} characters", answer_chars)


def shortest(schema) -> float:
    """A lower bound on the length of ``schema``'s values written as compact JSON; ``math.inf`` when
    it admits none (as :func:`check` finds it)."""
    if schema is False:
        return math.inf
    if not isinstance(schema, dict):
        return 1
    state, nodes = _solved(schema)
    return _Shortest(state).solve(nodes) if state.ok[id(schema)] else math.inf


def _solved(schema: dict):
    paths, nodes = {}, []
    for path, node in rewrite.walk(schema):
        if id(node) not in paths:
            paths[id(node)] = path
            nodes.append(node)
    state = _Solver(schema, paths)
    state.solve(nodes)
    return state, nodes


class _Solver:
    def __init__(self, root: dict, paths: dict):
        self.root, self.paths = root, paths
        self.ok = {key: False for key in paths}
        self.readers: dict[int, list[dict]] = {}  # node id -> the nodes whose verdict reads it

    def solve(self, nodes: list[dict]) -> None:
        for node in nodes:
            for child in self._reads(node):
                if isinstance(child, dict):
                    self.readers.setdefault(id(child), []).append(node)
        work = list(nodes)  # popped from the end: the deepest schemas first
        while work:
            node = work.pop()
            if self.ok[id(node)] or self.why(node) is not None:
                continue
            self.ok[id(node)] = True
            work.extend(reader for reader in self.readers.get(id(node), ()) if not self.ok[id(reader)])

    def _reads(self, node: dict):
        for _, container, key in rewrite.children(node):
            yield container[key]
        target = self._target(node)
        if target is not None:
            yield target

    def _target(self, node: dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            return rewrite._node_at(self.root, ref)
        return None

    def admits(self, schema) -> bool:
        if schema is False:
            return False
        return not isinstance(schema, dict) or self.ok.get(id(schema), True)

    # ------------------------------------------------------------------ one node
    def why(self, node: dict) -> tuple[str, object] | None:
        """None if ``node`` admits a value given what its subschemas admit; else (why, the subschema
        to blame or None)."""
        target = self._target(node)
        if target is not None and not self.admits(target):
            return f"its `$ref` {node['$ref']!r} admits no value", target
        every = node.get("allOf")
        for branch in every if isinstance(every, list) else ():
            if not self.admits(branch):
                return "a branch of its `allOf` admits no value", branch
        for key in ("anyOf", "oneOf"):
            branches = node.get(key)
            if isinstance(branches, list) and branches and not any(self.admits(b) for b in branches):
                return f"no branch of its `{key}` admits a value", branches[0]
        types = self._types(node)
        if not types:
            if node.get("enum") == []:
                return "its `enum` is empty", None
            if node.get("type") == []:
                return "its `type` list is empty", None
            return "no value of its `enum`/`const` has the declared `type`", None
        reasons = []
        for kind in types:
            reason = self._kind(kind, node)
            if reason is None:
                return None
            reasons.append(reason)
        return reasons[0]

    def _types(self, node: dict) -> list[str]:
        declared = rewrite.declared_types(node)
        kinds = [t for t in TYPES if declared is None or t in declared or (t == "integer" and "number" in declared)]
        if "const" in node:
            values = [node["const"]]
        elif isinstance(node.get("enum"), list):
            values = node["enum"]
        else:
            return kinds
        return [t for t in kinds if any(_is(t, value) for value in values)]

    def _kind(self, kind: str, node: dict) -> tuple[str, object] | None:
        if kind in ("number", "integer"):
            return _numbers(node, integer=kind == "integer")
        if kind == "string":
            return _ordered(node, "minLength", "maxLength")
        if kind == "array":
            return _ordered(node, "minItems", "maxItems") or self._array(node)
        if kind == "object":
            return _ordered(node, "minProperties", "maxProperties") or self._object(node)
        return None

    def _array(self, node: dict):
        least = node.get("minItems") if isinstance(node.get("minItems"), int) else 0
        prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
        for index, item in enumerate(prefix[:least]):
            if not self.admits(item):
                return f"item {index} of the {least} its `minItems` requires admits no value", item
        rest = node.get("items")
        if least > len(prefix) and rest is not None and not isinstance(rest, list) and not self.admits(rest):
            return f"its `minItems` {least} needs items, and `items` admits none", rest
        contains = node.get("contains")
        if contains is not None and node.get("minContains", 1) != 0 and not self.admits(contains):
            return "its `contains` admits no value", contains
        return None

    def _object(self, node: dict):
        required = [n for n in node.get("required") or () if isinstance(n, str)] \
            if isinstance(node.get("required"), list) else []
        most = node.get("maxProperties")
        if isinstance(most, int) and len(set(required)) > most:
            return f"it requires {len(set(required))} properties but `maxProperties` is {most}", None
        properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        extra = node.get("additionalProperties")
        for name in required:
            if name in properties:
                if not self.admits(properties[name]):
                    return f"its required property {name!r} admits no value", properties[name]
            elif node.get("patternProperties"):
                continue  # a pattern may name it: not judged here
            elif extra is False:
                return f"it requires {name!r}, which `additionalProperties: false` forbids (not in `properties`)", None
            elif isinstance(extra, dict) and not self.admits(extra):
                return f"it requires {name!r}, and `additionalProperties` admits no value", extra
        return None

    # ------------------------------------------------------------------ the reason, for the message
    def explain(self, root: dict) -> tuple[str, str]:
        """(why, where) for the root: the chain of blamed subschemas, followed to a node that fails
        by its own keywords, or round a cycle."""
        seen, chain, node, first = set(), [], root, None
        while True:
            path = self.paths.get(id(node), "#")
            if id(node) in seen:
                start = chain.index(path)
                loop = " -> ".join(chain[start:] + [path])
                return f"a `$ref` cycle with no base case ({loop}): every value would nest forever", path
            seen.add(id(node))
            chain.append(path)
            why, blame = self.why(node)
            first = first or f"{why} (at {path})"
            if not isinstance(blame, dict):
                if blame is False:
                    why += " (it is `false`)"
                return (f"{why} at {path}" if len(chain) == 1 else f"{first}: {why} at {path}"), path
            node = blame


def _length(value) -> int:
    """Its shortest compact JSON text (an integral float matches the integer, as JSON Schema says)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False))


def _is(kind: str, value) -> bool:
    if kind == "null":
        return value is None
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and value.is_integer()
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, {"string": str, "array": list, "object": dict}[kind])


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not (
        isinstance(value, float) and not math.isfinite(value))


def _ordered(node: dict, low: str, high: str):
    least, most = node.get(low), node.get(high)
    if _number(least) and _number(most) and least > most:
        return f"`{low}` {least} is above `{high}` {most}", None
    return None


def _numbers(node: dict, *, integer: bool):
    """Whether the number bounds leave a value (an integer one for ``integer``)."""
    lows = [(node[k], k == "exclusiveMinimum") for k in ("minimum", "exclusiveMinimum") if _number(node.get(k))]
    highs = [(node[k], k == "exclusiveMaximum") for k in ("maximum", "exclusiveMaximum") if _number(node.get(k))]
    if not lows or not highs:
        return None
    low, low_open = max(lows, key=lambda b: (b[0], b[1]))
    high, high_open = min(highs, key=lambda b: (b[0], not b[1]))
    if low > high or (low == high and (low_open or high_open)):
        return f"its lower bound {low} is not below its upper bound {high}", None
    if integer:
        first = math.floor(low) + 1 if low_open or low != math.floor(low) else int(low)
        last = math.ceil(high) - 1 if high_open or high != math.ceil(high) else int(high)
        if first > last:
            return f"no integer lies between its bounds {low} and {high}", None
    return None


class _Shortest:
    """The length of each schema's shortest value (a lower bound), as a fixed point from infinity down."""

    def __init__(self, solver: _Solver):
        self.solver = solver
        self.least = {key: math.inf for key in solver.paths}

    def solve(self, nodes: list[dict]) -> float:
        work, budget = list(nodes), 64 * len(nodes) + 64  # the values only fall; the budget is a backstop
        while work and budget:
            budget -= 1
            node = work.pop()
            value = self.of(node)
            if value < self.least[id(node)]:
                self.least[id(node)] = value
                work.extend(self.solver.readers.get(id(node), ()))
        return self.least[id(self.solver.root)] if not work else 0  # not settled: no verdict

    def size(self, schema) -> float:
        if schema is False:
            return math.inf
        return 1 if not isinstance(schema, dict) else self.least.get(id(schema), 1)

    def of(self, node: dict) -> float:
        bounds = [0]
        target = self.solver._target(node)
        if target is not None:
            bounds.append(self.size(target))
        every = node.get("allOf")
        bounds += [self.size(b) for b in every] if isinstance(every, list) else []
        for key in ("anyOf", "oneOf"):
            branches = node.get(key)
            if isinstance(branches, list) and branches:
                bounds.append(min(self.size(b) for b in branches))
        kinds = self.solver._types(node)
        if "const" in node or isinstance(node.get("enum"), list):
            values = [node["const"]] if "const" in node else node["enum"]
            bounds.append(min((_length(v) for v in values if any(_is(t, v) for t in kinds)), default=math.inf))
        else:
            bounds.append(min((self._kind(kind, node) for kind in kinds), default=math.inf))
        return max(bounds)

    def _kind(self, kind: str, node: dict) -> float:
        if kind == "string":
            least = node.get("minLength")
            return 2 + (least if isinstance(least, int) else 0)
        if kind == "array":
            count = node.get("minItems") if isinstance(node.get("minItems"), int) else 0
            prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
            rest = node.get("items") if isinstance(node.get("items"), (dict, bool)) else True
            items = [self.size(prefix[i]) if i < len(prefix) else self.size(rest) for i in range(min(count, 4096))]
            return 2 + sum(items) + max(count - 1, 0)
        if kind == "object":
            required = node.get("required") if isinstance(node.get("required"), list) else []
            names = {name for name in required if isinstance(name, str)}
            properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
            extra = node.get("additionalProperties", True)
            patterns = bool(node.get("patternProperties"))  # a pattern may name it: its value, 1 character or more

            def value(name):
                return self.size(properties[name]) if name in properties else 1 if patterns else self.size(extra)
            total = sum(_length(n) + 1 + value(n) for n in names)
            return 2 + total + max(len(names) - 1, 0)
        return 1 if kind in ("number", "integer") else 4  # a digit; null, true
