"""``$dynamicRef`` resolved statically: each reference becomes a plain ``$ref`` to a copy of its target
specialized to the dynamic scope it is reached in (the document fixes every scope).

    schema = resolve(schema)     # no `$dynamicRef` left; every `$ref` a pointer to `#` or `#/$defs/__dynN`

The scope is tracked as the referee (``jsonschema``/``referencing``) tracks it: following a reference
pushes the base URI it leaves (a base it already starts from is not pushed again); a ``$dynamicRef``
whose initial target is a ``$dynamicAnchor`` resolves to the outermost resource in that scope
declaring the same dynamic anchor, else it acts as ``$ref``. The document is written out again from
the root: each (target, scope) pair reached once becomes one ``$defs`` entry (the scope keeps only
the resources that declare a dynamic anchor, so most targets need one copy; recursion ends on a
pair already written). ``$id``/``$anchor``/``$dynamicAnchor`` are dropped with the references
resolved; a reference to another document is left for the policy to refuse. Capped by
``CAPS["specializations"]``.
"""
from __future__ import annotations

import copy
import urllib.parse

from neuron_constrain.structured.schema import rewrite as rewrite
from neuron_constrain.structured.schema.algebra.caps import over, site

_DROPPED = ("$id", "$anchor", "$dynamicAnchor", "$defs", "definitions")


def resolve(schema):
    """``schema`` without ``$dynamicRef`` (the same object if it has none)."""
    if not isinstance(schema, dict) or not any("$dynamicRef" in n for _, n in rewrite.walk(schema)):
        return schema
    return _Writer(schema).write()


class _Writer:
    def __init__(self, schema: dict):
        self.schema = schema
        self.targets, self.bases = rewrite._resources(schema)
        self.dynamic = {uri for uri, pointer in self.targets.items() if "#" in uri and
                        _anchor_of(rewrite._node_at(schema, pointer)) == uri.rsplit("#", 1)[1]}
        self.scoped = {uri.rsplit("#", 1)[0] for uri in self.dynamic}  # resources declaring a dynamic anchor
        self.written: dict[tuple, str] = {("#", ()): "#"}
        self.defs: dict[str, object] = {}

    def write(self) -> dict:
        root = self.copy_at("#", ())
        root["$defs"] = self.defs
        if "$schema" in self.schema:
            root["$schema"] = self.schema["$schema"]
        return root

    def copy_at(self, pointer: str, scope: tuple):
        node = rewrite._node_at(self.schema, pointer)
        if not isinstance(node, dict):
            return copy.deepcopy(node)
        out = copy.deepcopy({k: v for k, v in node.items() if k not in _DROPPED})
        for path, sub in list(rewrite.walk(out, pointer)):
            for key in _DROPPED:
                sub.pop(key, None)
            base = self.bases.get(path, "")
            dynamic = sub.pop("$dynamicRef", None)
            if isinstance(sub.get("$ref"), str):
                sub["$ref"] = self.reference(sub["$ref"], base, scope, path, dynamic=False)
            if isinstance(dynamic, str):
                ref = self.reference(dynamic, base, scope, path, dynamic=True)
                if "$ref" in sub:
                    sub.setdefault("allOf", []).append({"$ref": ref})
                else:
                    sub["$ref"] = ref
        return out

    def reference(self, ref: str, base: str, scope: tuple, path: str, *, dynamic: bool) -> str:
        uri, fragment = urllib.parse.urldefrag(urllib.parse.urljoin(base, ref) if base else ref)
        if uri not in self.targets:
            return ref  # another document: the policy refuses it by name
        if fragment.startswith("/") or not fragment:
            target = self.targets[uri] + fragment
        else:
            target = self.targets.get(uri + "#" + fragment)
        if target is None or rewrite._node_at(self.schema, target) is None:
            return ref
        if base and (not scope or uri != base):
            scope = (base, *scope)  # what referencing's Resolver._evolve pushes
        if dynamic and uri + "#" + fragment in self.dynamic:
            for outer in scope:  # innermost first: the last match is the outermost
                found = self.targets.get(outer + "#" + fragment)
                if outer + "#" + fragment in self.dynamic and found is not None:
                    target = found
        return self.copy_ref(target, scope, path, "$dynamicRef" if dynamic else "$ref")

    def copy_ref(self, target: str, scope: tuple, path: str, keyword: str) -> str:
        kept: list = []
        for uri in reversed(scope):  # outermost first, each resource once (where it is outermost)
            if uri in self.scoped and uri not in kept:
                kept.append(uri)
        key = (target, tuple(reversed(kept)))
        if key not in self.written:
            with site(keyword, path):
                over("specializations", len(self.written))
            name = f"__dyn{len(self.defs)}"
            self.written[key] = f"#/$defs/{name}"
            self.defs[name] = None
            self.defs[name] = self.copy_at(target, scope)
        return self.written[key]


def _anchor_of(node) -> str | None:
    return node.get("$dynamicAnchor") if isinstance(node, dict) else None
