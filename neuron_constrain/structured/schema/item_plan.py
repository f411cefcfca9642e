"""Which array keywords the host enforces (``uniqueItems``, ``contains``/``minContains``/``maxContains``):
the places of a schema where an array must meet them.

    plan = Plan.of(schema)                    # None: none of them here
    plan.untracked                            # None, or why the tracker cannot take them (refused then)
    plan.engine_schema()                      # what the engine compiles: the schema without them

No grammar engine enforces ``uniqueItems`` (equality of items is not context-free) or a ``contains``
over an unbounded array; the algebra enumerates finite item domains and spells bounded ``contains``
as positions, and the rest is the tracker's (``item_tracker.py``). The tracker follows each value's
path through the schema: a *shape* is what a value at one place must satisfy, as a formula over
schema nodes (``$ref`` and ``allOf`` all apply, ``anyOf``/``oneOf`` branches are alternatives; a
name's ``properties`` entry or else ``additionalProperties``, beside every ``patternProperties``
schema; a position's ``prefixItems`` entry or ``items``). An array is tracked where its shape says
what it must meet; a schema where that depends on a branch the engine chooses (an ``anyOf`` whose
branches disagree at one place, a ``then`` without an ``else``, an open object whose patterns
disagree) is refused, since the tracker cannot see which branch the output follows. Only nodes some
place reaches are taken (a ``uniqueItems`` under ``not`` stays, and is refused). Shapes are found once
per schema, breadth first, at most :data:`SHAPES_CAP`.

Its sibling for objects counts property names: ``minProperties`` above 1 on an open object (neither
engine counts names an additional key may repeat) is the tracker's where every node of the object's
shape takes new names without end (no ``additionalProperties: false``, no ``propertyNames``), so that
refusing the closing brace leaves the output a way on; the least count is then known per shape
(:meth:`Plan.min_properties`), and a brace before that many distinct names is refused. A ``not`` over
the member keywords alone (``properties``, ``patternProperties``, ``additionalProperties``) asks for one
member that breaks them: an existential the tracker checks member by member (``jsonschema`` judges
``{name: value}``; the name's last value counts), refusing the brace until one is found
(:meth:`Plan.exists`); the engine compiles the node as ``type: object`` in its place. A ``oneOf`` the
algebra left (branches that overlap where no complement is written) on a node only objects satisfy is
judged whole as the object closes (``jsonschema`` on its text: exactly one branch), the engine
compiling it as ``anyOf``. So is an ``anyOf`` on such a node whose branches hold what the tracker
takes (``minProperties``, a ``not`` over members, such a ``oneOf``): a branch the engine picks cannot
be followed, so the engine compiles those branches without it and the whole ``anyOf`` is judged.
"""
from __future__ import annotations

import collections
import json

from neuron_constrain.structured.schema import keywords, rewrite as rewrite

SHAPES_CAP = 1024
ANY = ("any",)  # the shape that asserts nothing (a name or position nothing declares)
OTHER = ("other",)  # any name no node of the shape declares


# --------------------------------------------------------------------------- shapes
MIXED, NONE = "mixed", "none"  # what an array must meet depends on a branch; no array fits here
KEYWORDS = ("uniqueItems", "contains", "minContains", "maxContains")  # what the tracker takes
COUNTED = ("minProperties",)  # what the name counter takes, per node (``Plan.counted``)
MEMBER_KEYWORDS = frozenset({"properties", "patternProperties", "additionalProperties"})


def judged_whole(node: dict, keyword: str = "oneOf") -> bool:
    """Whether ``node``'s ``oneOf`` (``keyword``) may be judged on the whole object as it closes: only objects
    satisfy the node (its type, or every branch's), and no ``anyOf`` beside a ``oneOf`` takes its place."""
    branches = node.get(keyword)
    if not isinstance(branches, list) or not branches or ("anyOf" if keyword == "oneOf" else "oneOf") in node:
        return False
    objects = frozenset({"object"})
    return rewrite.declared_types(node) == objects or all(
        isinstance(b, dict) and rewrite.declared_types(b) == objects for b in branches)


def _relaxed(schema) -> dict:
    """id() of each ``anyOf`` node judged whole -> its branches the engine compiles without what the
    tracker takes."""
    judged = {}
    for _, node in rewrite.walk(schema):
        taken = [b for b in node.get("anyOf") or () if isinstance(b, dict) and (
            counts_names(b) or existential(b) or judged_whole(b))] if isinstance(node.get("anyOf"), list) else []
        if taken and judged_whole(node, "anyOf"):
            judged[id(node)] = taken
    return judged


def _extendable(node: dict) -> bool:
    """Whether an object under ``node`` may take names without end (declared names alone run out)."""
    return (node.get("additionalProperties") is not False or bool(node.get("patternProperties"))) \
        and "maxProperties" not in node and "propertyNames" not in node


def existential(node: dict) -> bool:
    """Whether ``node``'s ``not`` is over member keywords alone (some member must break them; beside them a
    ``type: object``, which only lets non-objects through as well), on a node that may be an object."""
    negated, kinds = node.get("not"), rewrite.declared_types(node)
    if not isinstance(negated, dict) or negated.get("type", "object") not in ("object", ["object"]):
        return False
    members = set(negated) - {"type"}
    return bool(members) and members <= MEMBER_KEYWORDS and (kinds is None or "object" in kinds)


def counts_names(node: dict) -> bool:
    """Whether ``node``'s ``minProperties`` is one the engines leave (above 1 where an additional key may be
    written twice, ``keywords.distinct_keys``), which the name counter takes where its objects stay open."""
    value = node.get("minProperties")
    return (isinstance(value, int) and not isinstance(value, bool) and value > 1
            and (node.get("additionalProperties") is not False or "patternProperties" in node))


def _open(node: dict) -> bool:
    """Whether an object under ``node`` may always take one more new name (refusing its brace is no dead end)."""
    return node.get("additionalProperties") is not False and not {"propertyNames", "unevaluatedProperties"} & set(node)


class Plan:
    """The shapes of one schema, and whether the tracker takes its ``uniqueItems``.

    A shape is what a value at one place must satisfy, as a formula over schema nodes: ``("and", ...)``
    of what all apply (a node, its ``$ref`` target, its ``allOf``), ``("or", ...)`` of alternatives
    (``anyOf``/``oneOf`` branches; ``then``/``else``/``dependentSchemas`` beside nothing), a node's own
    keywords ``("node", i)``, or :data:`ANY`."""

    def __init__(self, schema: dict):
        self.schema = schema
        self._nodes: list[dict] = []
        self._ids: dict[int, int] = {}
        self._shapes: dict = {}
        self._member: dict = {}
        self._item: dict = {}
        self._status: dict = {}
        self._referee, self._judged = None, {}
        self.reached: set[int] = set()  # id() of the nodes some place's shape holds: those the tracker takes
        self.counted: set[int] = set()  # id() of the nodes whose minProperties the name counter takes
        self.existing: set[int] = set()  # id() of the nodes whose existential `not` the tracker checks
        self.wholes: set[int] = set()  # id() of the nodes whose `oneOf` the tracker judges on the closed object
        self._exists: dict = {}
        self._least: dict = {}
        self.any_wholes = _relaxed(schema)
        self.relaxed = {id(b) for branches in self.any_wholes.values() for b in branches}
        self.root = self.shape(schema)
        self.untracked = self._check()
        for parent, branches in self.any_wholes.items():  # the engine compiles a branch without what is judged whole
            for node in branches if parent in self.wholes else ():
                for taken, kind in ((self.counted, counts_names), (self.existing, existential), (self.wholes, judged_whole)):
                    if kind(node) and id(node) not in self.any_wholes:
                        taken.add(id(node))
        self.contained = any("contains" in node and id(node) in self.reached for node in self._nodes)

    @classmethod
    def of(cls, schema) -> "Plan | None":
        if not isinstance(schema, dict) or not any(node.get("uniqueItems") is True or "contains" in node
                                                   or counts_names(node) or existential(node) or judged_whole(node)
                                                   for _, node in rewrite.walk(schema)):
            return None
        return cls(schema)

    def shape(self, node, depth: int = 0):
        if node is False:
            return ("or", ())
        if not isinstance(node, dict) or depth > 64:
            return ANY
        if id(node) in self._shapes:
            return self._shapes[id(node)]
        if id(node) not in self._ids:
            self._ids[id(node)] = len(self._nodes)
            self._nodes.append(node)
        self._shapes[id(node)] = ("node", self._ids[id(node)])  # a $ref cycle reads as the node alone
        parts = [("node", self._ids[id(node)])]
        if isinstance(node.get("$ref"), str):
            parts.append(self.shape(rewrite._node_at(self.schema, node["$ref"]), depth + 1))
        parts += [self.shape(b, depth + 1) for b in node.get("allOf") or () if isinstance(node.get("allOf"), list)]
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list):
                parts.append(_join("or", [self.shape(b, depth + 1) for b in node[key]]))
        conditional = [node[k] for k in ("then", "else") if k in node]
        if isinstance(node.get("dependentSchemas"), dict):
            conditional += list(node["dependentSchemas"].values())
        parts += [_join("or", [self.shape(c, depth + 1), ANY]) for c in conditional]
        self._shapes[id(node)] = _join("and", parts)
        return self._shapes[id(node)]

    def member(self, shape, name):
        """The shape of the value under ``name`` (``OTHER``: a name no node declares) in an object of ``shape``."""
        key = (shape, name)
        if key not in self._member:
            self._member[key] = self._map(shape, lambda node: self._member_of(node, name))
        return self._member[key]

    def names(self, shape) -> frozenset:
        """The property names some node of ``shape`` declares."""
        key = (shape, "names")
        if key not in self._member:
            self._member[key] = frozenset(n for i in self._leaves(shape) for n in (self._nodes[i].get("properties") or {}))
        return self._member[key]

    def _member_of(self, node: dict, name):
        declared = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        patterns = [self.shape(sub) for sub in (node.get("patternProperties") or {}).values()]
        if name is not OTHER and name in declared:
            return _join("and", [self.shape(declared[name]), *patterns])
        extra = node.get("additionalProperties", node.get("unevaluatedProperties", True))
        # which patterns a name nothing declares matches is not known here: any of them, or none
        return _join("or", [self.shape(extra), *patterns]) if patterns else self.shape(extra)

    def item(self, shape, index: int):
        """The shape of position ``index`` in an array of ``shape``."""
        key = (shape, min(index, self._prefix(shape)))
        if key not in self._item:
            self._item[key] = self._map(shape, lambda node: self._item_of(node, key[1]))
        return self._item[key]

    def _item_of(self, node: dict, index: int):
        prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
        return self.shape(prefix[index] if index < len(prefix) else node.get("items", node.get("unevaluatedItems", True)))

    def _map(self, shape, leaf):
        if shape == ANY:
            return ANY
        if shape[0] == "node":
            return leaf(self._nodes[shape[1]])
        return _join(shape[0], [self._map(part, leaf) for part in shape[1]])

    def _prefix(self, shape) -> int:
        if shape == ANY:
            return 0
        if shape[0] == "node":
            return len(self._nodes[shape[1]].get("prefixItems") or ())
        return max((self._prefix(part) for part in shape[1]), default=0)

    def status(self, shape):
        """What an array at ``shape`` must meet: a frozenset of ``"unique"`` and the node indices whose
        ``contains`` applies; MIXED where that depends on a branch, NONE where no array fits."""
        if shape not in self._status:
            self._status[shape] = self._status_of(shape)
        return self._status[shape]

    def _status_of(self, shape):
        if shape == ANY:
            return frozenset()
        if shape[0] == "node":
            node = self._nodes[shape[1]]
            kinds = rewrite.declared_types(node)
            if kinds is not None and "array" not in kinds:
                return NONE
            return frozenset(["unique"] * (node.get("uniqueItems") is True) + [shape[1]] * ("contains" in node))
        found = [self.status(part) for part in shape[1]]
        if NONE in found and shape[0] == "and":
            return NONE
        found = [f for f in found if f != NONE]
        if not found:
            return NONE
        if MIXED in found:
            return MIXED
        if shape[0] == "and":
            return frozenset().union(*found)
        return found[0] if all(f == found[0] for f in found) else MIXED

    def tracked(self, shape) -> frozenset:
        """What the tracker checks of an array at ``shape`` (empty: nothing)."""
        found = self.status(shape)
        return found if isinstance(found, frozenset) else frozenset()

    KEYWORDS = KEYWORDS + COUNTED + ("not", "oneOf")

    def takes(self, node: dict, keyword: str | None = None) -> bool:
        """Whether the tracker enforces ``node``'s :data:`KEYWORDS` (``keyword``: that one of them; the engine
        compiles the node without what the tracker takes)."""
        if keyword in (*COUNTED, "not", "oneOf"):
            taken = {"not": self.existing, "oneOf": self.wholes}.get(keyword, self.counted)
            return self.untracked is None and id(node) in taken
        return self.untracked is None and id(node) in self.reached

    def min_properties(self, shape):
        """The least number of distinct names an object at ``shape`` must have, where the name counter takes
        it (0: nothing to count); MIXED where branches disagree on it or an object there may stop taking names."""
        if shape == ANY:
            return 0
        if shape not in self._least:
            least = self._least_of(shape)
            self._least[shape] = self._open_or_mixed(shape, least) if shape[0] != "or" and least != MIXED else least
        return self._least[shape]

    def _least_of(self, shape):
        if shape[0] == "node":
            node = self._nodes[shape[1]]
            return node["minProperties"] if self._kind(counts_names, node) else 0
        found = [self.min_properties(part) for part in shape[1]] or [0]
        if MIXED in found:
            return MIXED
        if shape[0] == "or":
            return found[0] if all(f == found[0] for f in found) else MIXED  # ("or", ()): no value at all
        return max(found)

    def exists(self, shape):
        """What an object at ``shape`` is judged by: ``("exists", i)``, node ``i``'s existential ``not``;
        ``("whole", i)``, node ``i``'s ``oneOf`` on the closed object (MIXED: a branch decides, or the
        object's names may run out, so that a refused brace could leave no way on)."""
        if shape == ANY:
            return frozenset()
        if shape not in self._exists:
            if shape[0] == "node":
                node = self._nodes[shape[1]]
                found = frozenset([("exists", shape[1])] * self._kind(existential, node)
                                  + [("whole", shape[1])] * (self._kind(judged_whole, node) or id(node) in self.any_wholes))
            else:
                parts = [self.exists(part) for part in shape[1]] or [frozenset()]
                found = MIXED if MIXED in parts else frozenset().union(*parts) if shape[0] == "and" else (
                    parts[0] if all(p == parts[0] for p in parts) else MIXED)
            if found and found != MIXED and shape[0] != "or" and not all(
                    _extendable(self._nodes[i]) for i in self._leaves(shape, branches=False)):
                found = MIXED  # names run out (a closed object): a refused brace could leave no way on
            self._exists[shape] = found
        return self._exists[shape]

    def breaks(self, index: int, name: str, text: bytes) -> bool:
        """Whether the member ``name: text`` breaks what node ``index``'s ``not`` negates (meets the existential)."""
        key = ("not", index, name, text)
        if key not in self._judged:
            if self._referee is None:
                self._referee = keywords.validator(self.schema)
            if len(self._judged) > 4096:
                self._judged.clear()
            negated = self._referee.evolve(schema=self._nodes[index]["not"])
            self._judged[key] = not negated.is_valid({name: json.loads(text)})
        return self._judged[key]

    def _kind(self, predicate, node: dict) -> bool:
        """``predicate(node)`` where the tracker follows the node itself (not a branch a whole anyOf judges)."""
        return id(node) not in self.relaxed and predicate(node)

    def whole(self, index: int, text: bytes) -> bool:
        """Whether the object written ``text`` meets node ``index``'s ``oneOf`` (exactly one branch), or the
        ``anyOf`` judged whole there."""
        key = ("oneOf", index, text)
        if key not in self._judged:
            if self._referee is None:
                self._referee = keywords.validator(self.schema)
            if len(self._judged) > 4096:
                self._judged.clear()
            node = self._nodes[index]
            judged = self._referee.evolve(schema={k: node[k] for k in ("oneOf", "anyOf") if k in node})
            self._judged[key] = judged.is_valid(json.loads(text))
        return self._judged[key]

    def _open_or_mixed(self, shape, least):
        return least if not least or all(_open(self._nodes[i]) for i in self._leaves(shape)) else MIXED

    def contains(self, index: int) -> tuple:
        """``(contains, minContains, maxContains)`` of node ``index``."""
        node = self._nodes[index]
        return node["contains"], node.get("minContains", 1), node.get("maxContains")

    def judge(self, index: int, text: bytes) -> bool:
        """Whether the item written ``text`` is one node ``index``'s ``contains`` takes (``jsonschema``, the
        referee; remembered per text, as a mask tries the same items token after token)."""
        key = (index, text)
        if key not in self._judged:
            if self._referee is None:
                self._referee = keywords.validator(self.schema)
            if len(self._judged) > 4096:
                self._judged.clear()
            self._judged[key] = self._referee.evolve(schema=self._nodes[index]["contains"]).is_valid(json.loads(text))
        return self._judged[key]

    def max_items(self, shape) -> int | None:
        """The least ``maxItems`` a node of ``shape`` sets (where the array may be full; None: none)."""
        found = [self._nodes[i]["maxItems"] for i in self._leaves(shape) if isinstance(self._nodes[i].get("maxItems"), int)]
        return min(found, default=None)

    def _check(self) -> str | None:
        queue, seen, mixed = collections.deque([self.root]), {self.root}, set()
        while queue:
            shape = queue.popleft()
            if self.status(shape) == MIXED:
                return ("an array here may have to satisfy schemas that disagree on `uniqueItems`/`contains` (branches "
                        "of a combinator, or a name nothing declares): the tracker cannot tell which one the output follows")
            if shape == ANY:
                continue
            self.reached.update(id(self._nodes[i]) for i in self._leaves(shape))
            counting = {id(self._nodes[i]) for i in self._leaves(shape) if self._kind(counts_names, self._nodes[i])}
            (mixed if self.min_properties(shape) == MIXED else self.counted).update(counting)
            asking = {id(self._nodes[i]) for i in self._leaves(shape) if self._kind(existential, self._nodes[i])}
            judging = {id(self._nodes[i]) for i in self._leaves(shape)
                       if self._kind(judged_whole, self._nodes[i]) or id(self._nodes[i]) in self.any_wholes}
            decided = self.exists(shape) != MIXED
            (self.existing if decided else mixed).update(asking)
            (self.wholes if decided else mixed).update(judging)
            following = [self.member(shape, name) for name in (*self.names(shape), OTHER)]
            following += [self.item(shape, i) for i in range(self._prefix(shape) + 1)]
            for nxt in following:
                if nxt not in seen:
                    seen.add(nxt)
                    queue.append(nxt)
                    if len(seen) > SHAPES_CAP:
                        return f"more than {SHAPES_CAP} places to follow through the schema"
        self.counted -= mixed  # a node some place cannot count for stays the engine's (and is refused there)
        self.existing -= mixed
        self.wholes -= mixed
        return None

    def _leaves(self, shape, branches: bool = True):
        """The nodes of ``shape``; ``branches=False``: only those every value there meets (not one branch's)."""
        if shape == ANY or (not branches and shape[0] == "or"):
            return
        if shape[0] == "node":
            yield shape[1]
            return
        for part in shape[1]:
            yield from self._leaves(part, branches)

    def engine_schema(self) -> dict:
        """The schema without what the tracker enforces (what the engine compiles)."""
        def copy(value):
            if isinstance(value, dict):
                ident = id(value)
                drop = (KEYWORDS if ident in self.reached else ()) + (COUNTED if ident in self.counted else ())
                if ident in self.existing:  # `not` over members: only objects are valid; the tracker asks the rest
                    value = {**{k: v for k, v in value.items() if k != "not"}, "type": "object"}
                if ident in self.wholes:  # the engine keeps to one branch at least; the tracker judges the object
                    value = {("anyOf" if k == "oneOf" else k): v for k, v in value.items()}
                return {k: copy(v) for k, v in value.items() if k not in drop}
            return [copy(v) for v in value] if isinstance(value, list) else value
        return copy(self.schema)


def _join(kind: str, parts: list):
    """``("and" | "or", parts)`` flattened, duplicates dropped; one part stands alone."""
    flat: list = []
    for part in parts:
        for one in (part[1] if part != ANY and part[0] == kind else (part,)):
            if one not in flat:
                flat.append(one)
    if kind == "and":
        flat = [p for p in flat if p != ANY] or [ANY]
    elif ANY in flat:
        flat = [ANY] + [p for p in flat if p != ANY]
    return flat[0] if len(flat) == 1 else (kind, tuple(flat))
