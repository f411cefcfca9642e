"""Tap-modules pass (``tap_modules``): let a reference tensor replace a named module's output at run time.

Before (GPT-OSS ``model.layers.0.mlp.router``)   After (taps=["model.layers.*.mlp.router"])
    logits = linear(h, w, b)                         tap_..._router: f32[T, E]        # new inputs
    top, idx = topk(logits, 2)                       tap_..._router_enabled: bool[T]
    scores = softmax(top)                            logits = linear(h, w, b)
    (experts read scores, idx)                       tapped = where(unsqueeze(enabled, -1), tap_..._router, logits)
                                                     top, idx = topk(tapped, 2)   # every user reads the tap
                                                     scores = softmax(top)

A tap names a module by a glob over dotted module paths (``*`` is one path
component, ``**`` any number; a pattern may match the end of a longer path, so
``model.layers.*.mlp.router`` finds ``m.model.layers.0.mlp.router``). It taps the
module's output value — output 0 when the module returns a tuple — or output ``N``
with the selector ``pattern:N``. Which node is a module's output comes from the
program's ``module_call_graph`` (``transform(model, taps=...)`` exports with
``preserve_module_call_signature`` for the tapped modules, so a value the parent
discards, such as GPT-OSS's router logits, is still found); a program exported
without it falls back to the module's single value used outside the module.

The enable flag covers the value's leading dims: rows not enabled keep the
model's own value, so switching a tap, or which rows it replaces, never recompiles.

Options (per tap, through :class:`Tap`)
    post      a function traced into the graph that turns the replacement into the
              tapped value's form (e.g. router logits -> top-k expert affinities);
              the replacement input is then ``[*leading, features]`` of ``dtype``.
    capture   also return the computed (unreplaced) value as an extra output
              ``capture_<tap>``, so references can be captured from the same graph.
Option (per pass)
    sequence_parallel  N > 1 when each rank holds 1/N of the tokens (the first dim)
              of tapped values: the replacement stays full ``[N * T_local, ...]`` and
              is sliced inline at a ``tap_rank`` input (an int64 scalar tensor).

Reports one site per tap (tap name, value node, module), the inputs and outputs
added and the number of nodes inserted. A pattern that matches nothing raises with
the nearest module paths of the program. :func:`report_from_program` reads that
report back from a tapped program (a saved ``.pt2`` keeps no report).
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind, TensorArgument

from neuron_constrain.core.contract import PassContract, PassResult, declares
from neuron_constrain.core.errors import TransformError
from neuron_constrain.core.program import ProgramEditor, user_input_names, wheres_fed_by
from neuron_constrain.core.report import AddedInput, PassReport, symbolic_shape
from neuron_constrain.core.sites import normalize_module_path
from neuron_constrain.core.tap_interface import (
    CAPTURE_PREFIX,
    ENABLED_SUFFIX,
    RANK_INPUT,
    Tap,
    as_taps,
    is_tap_input,
    match_modules,
    tap_input_name,
)

CONTRACT = PassContract(name="tap_modules", switch="taps", options=("taps", "sequence_parallel"),
                        requires=("untapped",), ensures=("taps_reach_readers",))

# ----------------------------------------------------------------------------- module outputs

def _program_module_paths(program: ExportedProgram) -> list[str]:
    paths = [e.fqn for e in program.module_call_graph if e.fqn]
    for node in program.graph.nodes:
        for path, _ in (node.meta.get("nn_module_stack") or {}).values():
            paths.append(normalize_module_path(path))
    return list(dict.fromkeys(paths))


def _inside(node: torch.fx.Node, path: str) -> bool:
    stack = node.meta.get("nn_module_stack") or {}
    return any(normalize_module_path(p) == path for p, _ in stack.values())


def _module_outputs(editor: ProgramEditor, path: str) -> list[torch.fx.Node | None]:
    nodes = {n.name: n for n in editor.graph.nodes}
    entry = next((e for e in editor.program.module_call_graph if e.fqn == path and e.signature is not None), None)
    if entry is not None:
        return [nodes.get(a.name) if isinstance(a, TensorArgument) else None for a in entry.signature.outputs]
    inside = [n for n in editor.graph.nodes if n.op == "call_function" and _inside(n, path)]
    escaping = [n for n in inside if any(u.op == "output" or not _inside(u, path) for u in n.users)]
    if len(escaping) == 1:
        return escaping
    raise TransformError(
        f"module {path!r} has {len(escaping)} values used outside it and the program does not record its "
        f"outputs; export with preserve_module_call_signature=({path!r},) or call transform(model, taps=...)"
    )


# ----------------------------------------------------------------------------- the pass

@declares(CONTRACT)
def tap_modules_pass(
    program: ExportedProgram, taps: Sequence[str | Tap], *, sequence_parallel: int = 1
) -> PassResult:
    """Give each tapped module's output a replacement input and a per-row enable flag.

    Every reader of the tapped value, inside the module too, reads
    ``where(enabled, replacement, computed)``; see the module docstring for the graph.

    Args:
        program: the exported program (its tapped modules' call signatures preserved).
        taps: module path patterns or :class:`~neuron_constrain.Tap` objects.
        sequence_parallel: ranks the tapped values' token dim is split over (adds ``tap_rank``).

    Returns:
        The tapped program and its report (the inputs and outputs added).

    Raises:
        TransformError: no taps, a pattern that matches no module, a bad ``sequence_parallel``,
            or a program already tapped.
    """
    taps = as_taps(taps)
    if not taps:
        raise TransformError("taps is empty: name at least one module pattern, e.g. 'model.layers.*.mlp.router'")
    if not isinstance(sequence_parallel, int) or sequence_parallel < 1:
        raise TransformError(f"sequence_parallel={sequence_parallel!r}: use the number of ranks (an int >= 1)")
    if any(is_tap_input(name) for name in user_input_names(program)):
        raise TransformError("the program already has tap inputs: tap the original model or program, not its rewrite")

    editor = ProgramEditor(program)
    report = PassReport(name=CONTRACT.name)
    paths = _program_module_paths(program)
    rank = None
    if sequence_parallel > 1:
        rank = editor.add_tensor_input(RANK_INPUT, (), torch.int64, 0)
        report.inputs_added.append(
            AddedInput(RANK_INPUT, torch.int64, (), None, bounds=(0, sequence_parallel),
                       doc=f"this rank's index in [0, {sequence_parallel})")
        )

    seen: dict[str, str] = {}
    for tap in taps:
        for path in match_modules(tap.module_pattern, paths):
            name = path if tap.selector is None else f"{path}:{tap.selector}"
            if name in seen:
                raise TransformError(f"tap {name!r} is named by both {seen[name]!r} and {tap.pattern!r}")
            seen[name] = tap.pattern
            outputs = _module_outputs(editor, path)
            index = tap.selector or 0
            if index >= len(outputs) or outputs[index] is None:
                raise TransformError(
                    f"tap {tap.pattern!r}: module {path!r} has no tensor output {index} "
                    f"(it returns {len(outputs)} value(s))"
                )
            value = outputs[index]
            if len(outputs) > 1 and tap.selector is None:
                report.notes.append(f"{name}: module returns {len(outputs)} values, tapped output 0 (use ':N' for others)")
            _insert_tap(editor, report, tap, name, value, rank, sequence_parallel)
    report.nodes_inserted = len(editor.inserted)
    return PassResult(editor.build(), report)


def _insert_tap(editor, report, tap: Tap, name: str, value, rank, world: int) -> None:
    val = value.meta["val"]
    if not isinstance(val, torch.Tensor) or val.dim() == 0:
        raise TransformError(f"tap {name!r}: the value {value.name!r} is not a tensor with a feature dim")
    leading = tuple(val.shape[:-1])
    features = tap.features if tap.post is not None else val.shape[-1]
    dtype = tap.dtype if tap.post is not None else val.dtype
    full_leading = ((world * leading[0], *leading[1:]) if leading else ()) if world > 1 else leading
    if world > 1 and not leading:
        raise TransformError(f"tap {name!r}: sequence_parallel needs a token dim, but {value.name!r} has shape {tuple(val.shape)}")
    input_name = tap_input_name(name)
    users = list(value.users)
    replacement = editor.add_tensor_input(input_name, (*full_leading, features), dtype, 0, device=val.device)
    enabled = editor.add_tensor_input(input_name + ENABLED_SUFFIX, full_leading, torch.bool, False, device=val.device)
    report.inputs_added += _added_inputs(name, input_name, (*full_leading, features), dtype, full_leading)

    def tapped(computed, replacement, enabled, *rank_arg):
        if rank_arg:
            rows = computed.shape[0]
            index = rank_arg[0] * rows + torch.arange(rows, device=computed.device)
            replacement, enabled = replacement.index_select(0, index), enabled.index_select(0, index)
        if tap.post is not None:
            replacement = tap.post(replacement)
        if replacement.shape != computed.shape:
            raise TransformError(
                f"tap {name!r}: post returned shape {tuple(replacement.shape)} but the tapped value has "
                f"{tuple(computed.shape)}"
            )
        return torch.where(enabled.unsqueeze(-1), replacement.to(computed.dtype), computed)

    args = [value, replacement, enabled] + ([rank] if rank is not None else [])
    new = editor.splice(tapped, args, near=value, prefix=input_name)
    editor.replace_uses(value, new, users=users)
    if tap.capture:
        editor.add_output(value, CAPTURE_PREFIX + name)
        report.outputs_added.append(CAPTURE_PREFIX + name)
    report.sites.append(_site(name, value.name))


def _added_inputs(name: str, input_name: str, shape, dtype: torch.dtype, rows) -> list[AddedInput]:
    """The report's entries for tap ``name``'s replacement ``[*rows, features]`` and its row flags ``[*rows]``."""
    return [
        AddedInput(input_name, dtype, symbolic_shape(shape), 0, doc=f"replacement for {name}", tap=(name, "values")),
        AddedInput(input_name + ENABLED_SUFFIX, torch.bool, symbolic_shape(rows), False,
                   doc=f"rows of {name} to replace", tap=(name, "enabled")),
    ]


def _site(name: str, value: str) -> dict:
    return {"node": value, "kind": "tap", "module": name.split(":")[0], "tap": name}


# ----------------------------------------------------------------------------- the report of a saved program

def report_from_program(program: ExportedProgram, names: Sequence[str] = ()) -> PassReport | None:
    """The report this pass wrote for ``program``, read back from the graph (a saved
    ``.pt2`` keeps no report), or None when the program has no tap inputs.

    Each ``tap_<name>`` / ``tap_<name>_enabled`` pair is traced to the
    ``where(enabled, replacement, computed)`` it feeds: ``computed`` is the site.
    An input name has lost its tap name's dots, so ``names`` (tap names, e.g. those
    of a reference's captures) name the taps back; a tap no name matches is named
    by its input. The outputs after the program's first are its capture outputs. A
    ``tap_rank`` input (``sequence_parallel``) is reported without its bounds, which
    the program does not record.
    """
    tap_inputs = [n for n in user_input_names(program) if is_tap_input(n)]
    if not tap_inputs:
        return None
    by_input = {tap_input_name(n): n for n in names}
    nodes = {n.name: n for n in program.graph.nodes}
    report = PassReport(name=CONTRACT.name)
    if RANK_INPUT in tap_inputs:
        report.inputs_added.append(AddedInput(RANK_INPUT, torch.int64, (), None, doc="this rank's index"))
    values = [n for n in tap_inputs if n + ENABLED_SUFFIX in tap_inputs]
    unpaired = sorted(set(tap_inputs) - set(values) - {n + ENABLED_SUFFIX for n in values} - {RANK_INPUT})
    if unpaired:
        raise TransformError(f"the program has tap inputs {unpaired} without their {ENABLED_SUFFIX!r} flags (or "
                             "flags without their values): not a program the tap-modules pass wrote")
    computed = {}  # the tapped value's node name -> tap name
    for input_name in values:
        name = by_input.get(input_name, input_name)
        where = wheres_fed_by(nodes[input_name + ENABLED_SUFFIX])
        if len(where) != 1:
            raise TransformError(f"tap input {input_name!r} does not feed one where(enabled, replacement, computed): "
                                 "not a program the tap-modules pass wrote")
        computed[where[0].args[2].name] = name
        report.sites.append(_site(name, where[0].args[2].name))
        val, rows = nodes[input_name].meta["val"], nodes[input_name + ENABLED_SUFFIX].meta["val"]
        report.inputs_added += _added_inputs(name, input_name, val.shape, val.dtype, rows.shape)
    user_outputs = [s.arg.name for s in program.graph_signature.output_specs if s.kind == OutputKind.USER_OUTPUT]
    report.outputs_added = [CAPTURE_PREFIX + computed.get(o, o) for o in user_outputs[1:]]
    return report
