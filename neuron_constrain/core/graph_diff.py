"""Structural diff of two canonical graph texts: added / removed / changed, by module.

    result = diff_graphs(parse_canonical(a), parse_canonical(b), "a", "b")
    print(result.render("a", "b"))          # what `neuron-constrain diff` prints

Nodes are matched by op, module and type (refs compared by op only, so renumbering
after an insertion does not read as a change), then the matched nodes' arguments are
compared through that matching.
"""
from __future__ import annotations

import dataclasses
import difflib
import re

from neuron_constrain.core.canonical import HEADER, CanonicalGraph, Record

__all__ = ["GraphDiff", "diff_graphs"]


_REF = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*?)_(\d+)\b")


@dataclasses.dataclass
class GraphDiff:
    """What changed from one graph to another (:func:`diff_graphs`); ``b``'s nodes renamed to ``a``'s.

    Attributes:
        inputs_added: inputs only ``b`` has (by name).
        inputs_removed: inputs only ``a`` has.
        inputs_changed: ``(a's, b's)`` inputs of one name whose lines differ.
        outputs_added: outputs past the end of ``a``'s (outputs are positional).
        outputs_removed: outputs past the end of ``b``'s.
        outputs_changed: ``(a's, b's)`` outputs at one position whose lines differ.
        nodes_added: nodes of ``b`` matched to none of ``a``.
        nodes_removed: nodes of ``a`` matched to none of ``b``.
        nodes_changed: ``(a's, b's)`` matched nodes whose line or module differs.
        symbols_changed: the symbol lines differ.
        unified: a unified diff of the two texts (after the renaming), line by line.
    """

    inputs_added: list[Record] = dataclasses.field(default_factory=list)
    inputs_removed: list[Record] = dataclasses.field(default_factory=list)
    inputs_changed: list[tuple[Record, Record]] = dataclasses.field(default_factory=list)
    outputs_added: list[Record] = dataclasses.field(default_factory=list)
    outputs_removed: list[Record] = dataclasses.field(default_factory=list)
    outputs_changed: list[tuple[Record, Record]] = dataclasses.field(default_factory=list)
    nodes_added: list[Record] = dataclasses.field(default_factory=list)
    nodes_removed: list[Record] = dataclasses.field(default_factory=list)
    nodes_changed: list[tuple[Record, Record]] = dataclasses.field(default_factory=list)
    symbols_changed: bool = False
    unified: list[str] = dataclasses.field(default_factory=list)

    @property
    def equal(self) -> bool:
        """Whether nothing but node numbering differs (the unified diff is not consulted)."""
        return not (
            self.inputs_added or self.inputs_removed or self.inputs_changed
            or self.outputs_added or self.outputs_removed or self.outputs_changed
            or self.nodes_added or self.nodes_removed or self.nodes_changed or self.symbols_changed
        )

    def render(self, name_a: str, name_b: str) -> str:
        """The diff as text (what ``neuron-constrain diff`` prints).

        Args:
            name_a: what to call the first graph.
            name_b: what to call the second.

        Returns:
            ``"A and B: same graph"``, or the inputs', outputs' and nodes' changes (nodes grouped by module),
            then the unified diff.
        """
        if self.equal:
            return f"{name_a} and {name_b}: same graph\n"
        out = [f"--- {name_a}", f"+++ {name_b}"]
        for section, added, removed, changed in (
            ("inputs", self.inputs_added, self.inputs_removed, self.inputs_changed),
            ("outputs", self.outputs_added, self.outputs_removed, self.outputs_changed),
        ):
            out.append(f"{section}: {len(added)} added, {len(removed)} removed, {len(changed)} changed")
            out += [f"  + {r.line()}" for r in added] + [f"  - {r.line()}" for r in removed]
            for a, b in changed:
                out += [f"  ~ {a.line()}", f"    -> {b.line()}"]
        out.append(
            f"nodes: {len(self.nodes_added)} added, {len(self.nodes_removed)} removed, {len(self.nodes_changed)} changed"
        )
        groups: dict[str, list[str]] = {}
        for r in self.nodes_added:
            groups.setdefault(r.module, []).append(f"    + {r.line()}")
        for r in self.nodes_removed:
            groups.setdefault(r.module, []).append(f"    - {r.line()}")
        for a, b in self.nodes_changed:
            lines = [f"    ~ {a.line()}", f"      -> {b.line()}"]
            if a.module != b.module:
                lines.append(f"      moved from module {a.module}")
            groups.setdefault(b.module, []).extend(lines)
        for module, lines in groups.items():
            out.append(f"  @ {module}")
            out += lines
        if self.symbols_changed:
            out.append("symbols changed")
        out.append("")
        out += self.unified
        return "\n".join(out).rstrip("\n") + "\n"


def _shape_key(record: Record) -> str:
    """A node's line with the numbers of its references dropped: stable under renumbering."""
    return f"{record.module}|{record.type}|" + _REF.sub(lambda m: m.group(1) + "_#", record.body)


def _keyed(records: list[Record]) -> dict[str, Record]:
    return {r.name: r for r in records}


def diff_graphs(a: CanonicalGraph, b: CanonicalGraph, name_a: str = "a", name_b: str = "b") -> GraphDiff:
    """Structural diff of two canonical graphs: inputs by name, outputs by position, nodes aligned by op,
    module and type (a renumbering is no change).

    Args:
        a: the first graph (:func:`~neuron_constrain.core.canonical.parse_canonical`).
        b: the second.
        name_a: the first's name in the unified diff.
        name_b: the second's.

    Returns:
        What was added, removed and changed.
    """
    result = GraphDiff()
    result.symbols_changed = a.symbols != b.symbols

    ins_a, ins_b = _keyed(a.inputs), _keyed(b.inputs)
    result.inputs_added = [r for n, r in ins_b.items() if n not in ins_a]
    result.inputs_removed = [r for n, r in ins_a.items() if n not in ins_b]
    result.inputs_changed = [(ins_a[n], r) for n, r in ins_b.items() if n in ins_a and ins_a[n].line() != r.line()]

    # Align nodes on name-free keys; a "replace" block pairs nodes of the same key.
    keys_a, keys_b = [_shape_key(r) for r in a.nodes], [_shape_key(r) for r in b.nodes]
    matcher = difflib.SequenceMatcher(None, keys_a, keys_b, autojunk=False)
    rename: dict[str, str] = {}   # b name -> a name
    pairs: list[tuple[Record, Record]] = []
    matched_a, matched_b = set(), set()
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            for i, j in zip(range(i1, i2), range(j1, j2)):
                pairs.append((a.nodes[i], b.nodes[j]))
        elif tag == "replace":
            # Same op and module in the replaced block: the node changed in place.
            free_a = list(range(i1, i2))
            for j in range(j1, j2):
                for i in free_a:
                    if a.nodes[i].op == b.nodes[j].op and a.nodes[i].module == b.nodes[j].module:
                        pairs.append((a.nodes[i], b.nodes[j]))
                        free_a.remove(i)
                        break
    # Leftovers that differ only in module path (or argument numbering): moved, not new.
    paired_a = {id(ra) for ra, _ in pairs}
    paired_b = {id(rb) for _, rb in pairs}
    loose_a: dict[str, list[Record]] = {}
    for r in a.nodes:
        if id(r) not in paired_a:
            loose_a.setdefault(_shape_key(Record(r.name, r.type, r.body)), []).append(r)
    for r in b.nodes:
        candidates = loose_a.get(_shape_key(Record(r.name, r.type, r.body)))
        if id(r) not in paired_b and candidates:
            pairs.append((candidates.pop(0), r))
    for ra, rb in pairs:
        rename[rb.name] = ra.name
        matched_a.add(ra.name)
        matched_b.add(rb.name)
    for name in set(ins_a) & set(ins_b):
        rename[name] = name

    # New nodes in b keep their number unless it collides with a name in a.
    taken = {r.name for r in a.nodes} | set(ins_a)
    for r in b.nodes:
        if r.name not in matched_b:
            new = r.name
            while new in taken:
                new = new + "'"
            rename[r.name] = new
            taken.add(new)

    def mapped(record: Record) -> Record:
        body = re.sub(r"\b[A-Za-z_][A-Za-z0-9_]*\b'*", lambda m: rename.get(m.group(0), m.group(0)), record.body)
        return Record(rename.get(record.name, record.name), record.type, body, record.module)

    b_nodes = [mapped(r) for r in b.nodes]
    b_outputs = [mapped(r) for r in b.outputs]
    for ra, rb in pairs:
        mb = mapped(rb)
        if mb.line() != ra.line() or ra.module != rb.module:
            result.nodes_changed.append((ra, mb))
    result.nodes_added = [m for r, m in zip(b.nodes, b_nodes) if r.name not in matched_b]
    result.nodes_removed = [r for r in a.nodes if r.name not in matched_a]

    # Outputs are positional; compare the renamed lines position by position.
    for i in range(max(len(a.outputs), len(b_outputs))):
        if i >= len(a.outputs):
            result.outputs_added.append(b_outputs[i])
        elif i >= len(b_outputs):
            result.outputs_removed.append(a.outputs[i])
        elif a.outputs[i].line() != b_outputs[i].line():
            result.outputs_changed.append((a.outputs[i], b_outputs[i]))

    b_text = _render_records(b.symbols, [mapped(r) for r in b.inputs], b_outputs, b_nodes)
    a_text = _render_records(a.symbols, a.inputs, a.outputs, a.nodes)
    result.unified = [
        line.rstrip("\n")
        for line in difflib.unified_diff(a_text, b_text, fromfile=name_a, tofile=name_b, n=2)
    ]
    return result


def _render_records(symbols, inputs, outputs, nodes) -> list[str]:
    lines = [HEADER, "symbols", *[f"  {s}" for s in symbols], "inputs", *[f"  {r.line()}" for r in inputs]]
    lines += ["outputs", *[f"  {r.line()}" for r in outputs], "nodes"]
    current = None
    for r in nodes:
        if r.module != current:
            lines.append(f"  @ {r.module}")
            current = r.module
        lines.append(f"  {r.line()}")
    return [line + "\n" for line in lines]
