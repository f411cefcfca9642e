"""Program surgery: the one place that adds inputs, outputs and traced code to an
``ExportedProgram``.

torch has no public helper for adding a user input (``_transform_do_not_use``
refuses changed inputs and ``_update`` leaves ``module_call_graph`` stale), so every
pass goes through :class:`ProgramEditor`::

    editor = ProgramEditor(program)              # a copy of the graph; the original is untouched
    mask = editor.add_tensor_input("logit_mask", (batch, 32), torch.int32, fill=-1)
    masked = editor.splice(fn, [logits, mask], near=site, prefix="logit_mask")  # fn traced to aten
    editor.replace_uses(logits, masked, keep_output=True)   # every reader but the output and fn itself
    flag = editor.splice(empty_fn, [mask], near=site, prefix="logit_mask_empty")
    editor.add_output(flag, "logit_mask_empty")  # a later pass finds it: editor.find_output(name)
    new_program = editor.build()                 # new signature, call specs, verifier run

A pass that cuts a program in parts (the split) builds each part's graph from the
program's nodes and makes it a program with ``ProgramEditor.subprogram(program, graph, ...)``.
A pass that must run once checks ``refuse_if_present(program, names, ...)`` first.

``splice`` traces a plain torch function with ``make_fx`` on the program's own fake
tensors, so the inserted nodes are plain aten ops (a saved ``.pt2`` loads without
this library), their ``val`` shares the program's symbolic sizes (a dynamic batch
stays dynamic), and each gets the site's ``nn_module_stack`` and ``stack_trace``.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Sequence

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch.export import ExportedProgram
from torch.export.exported_program import ModuleCallEntry, ModuleCallSignature
from torch.export.graph_signature import (
    ExportGraphSignature,
    InputKind,
    InputSpec,
    OutputKind,
    OutputSpec,
    TensorArgument,
)
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from neuron_constrain.core.errors import TransformError

__all__ = ["ProgramEditor", "refuse_if_present", "user_input_names", "user_outputs", "wheres_fed_by"]

OUTPUT_TAG = "neuron_constrain_output"  # node.meta["custom"][OUTPUT_TAG]: the added output's name (saved in .pt2)


def user_input_names(program: ExportedProgram) -> list[str]:
    return [s.arg.name for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]


def user_outputs(graph: torch.fx.Graph, signature: ExportGraphSignature) -> list:
    """The output values of ``graph`` that are user outputs (not buffer mutations), in order."""
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    return [o for o, s in zip(output.args[0], signature.output_specs) if s.kind == OutputKind.USER_OUTPUT]


def wheres_fed_by(source: torch.fx.Node) -> list[torch.fx.Node]:
    """The ``where`` nodes ``source`` reaches through non-``where`` nodes (a tap's enable
    flag: its own select), found without walking the whole graph."""
    found, seen, stack = [], set(), [source]
    while stack:
        for user in stack.pop().users:
            if user in seen:
                continue
            seen.add(user)
            (found if user.target is torch.ops.aten.where.self else stack).append(user)
    return found


def refuse_if_present(program: ExportedProgram, names, *, pass_name: str) -> None:
    """Raise when ``program`` already has one of the user inputs ``names`` (the pass ran already)."""
    present = sorted(set(names) & set(user_input_names(program)))
    if present:
        raise TransformError(
            f"the program already has the input(s) {present}: the {pass_name} pass was applied already; "
            "transform the original model or program, not its rewrite"
        )


class ProgramEditor:
    """A mutable copy of an ``ExportedProgram``'s graph; ``build()`` makes the new program."""

    def __init__(self, program: ExportedProgram):
        self.program = program
        # Copy the graph, not the module: Graph's deepcopy shares node meta (the
        # fake tensors keep the program's symbolic sizes, which a GraphModule
        # deepcopy loses) and the parameters are not copied at all.
        self.graph: torch.fx.Graph = copy.deepcopy(program.graph)
        self.module = torch.fx.GraphModule(program.graph_module, self.graph)
        self.module.meta.update(program.graph_module.meta)
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        self.fake_mode = detect_fake_mode([n.meta.get("val") for n in placeholders])
        if self.fake_mode is None:
            raise ValueError("the program's placeholders carry no fake tensors (meta['val']); re-export it")
        self.inserted: list[torch.fx.Node] = []
        self._new_inputs: list[tuple[torch.fx.Node, Any]] = []
        self._new_outputs: list[torch.fx.Node] = []

    # ------------------------------------------------------------------ queries
    @property
    def output_node(self) -> torch.fx.Node:
        return next(n for n in reversed(self.graph.nodes) if n.op == "output")

    def user_output_nodes(self) -> list[torch.fx.Node | None]:
        """The graph's user outputs (not buffer mutations), in output order."""
        return user_outputs(self.graph, self.program.graph_signature)

    # ------------------------------------------------------------------ edits
    def add_input(self, name: str, val: torch.Tensor, example: torch.Tensor) -> torch.fx.Node:
        """A new user input, placed after the last placeholder, fed as keyword ``name``.

        ``val`` is a fake tensor made in :attr:`fake_mode` (reuse the program's
        symbolic sizes to keep them dynamic); ``example`` a real tensor for
        ``example_inputs``.
        """
        taken = {n.name for n in self.graph.nodes} | set(user_input_names(self.program))
        if name in taken:
            raise ValueError(f"the program already has a node or input named {name!r}")
        last = [n for n in self.graph.nodes if n.op == "placeholder"][-1]
        with self.graph.inserting_after(last):
            node = self.graph.placeholder(name)
        if node.name != name:  # FX renamed it: the input spec and the kwarg must agree
            raise ValueError(f"could not name the new input {name!r} (got {node.name!r})")
        node.meta["val"] = val
        self._new_inputs.append((node, example))
        return node

    def add_tensor_input(self, name: str, shape: Sequence, dtype: torch.dtype, fill, device=None) -> torch.fx.Node:
        """:meth:`add_input` for a tensor of ``shape`` (ints and the program's SymInts);
        its example is filled with ``fill`` at the sizes the program was exported with."""
        val = self.fake(lambda: torch.empty(tuple(shape), dtype=dtype, device=device))
        hints = tuple(int(d.node.hint) if isinstance(d, torch.SymInt) else int(d) for d in shape)
        return self.add_input(name, val, torch.full(hints, fill, dtype=dtype))

    def find_output(self, name: str) -> torch.fx.Node | None:
        """The output a pass added as ``name`` (this editor's, or an earlier pass's), or None."""
        for node in [*self.user_output_nodes(), *self._new_outputs]:
            if isinstance(node, torch.fx.Node) and node.meta.get("custom", {}).get(OUTPUT_TAG) == name:
                return node
        return None

    def add_output(self, node: torch.fx.Node, name: str) -> None:
        """Append ``node`` as a new user output (after the original outputs), tagged ``name``."""
        self._tag(node, name)
        self._new_outputs.append(node)

    def replace_output(self, old: torch.fx.Node, new: torch.fx.Node) -> None:
        """Return ``new`` where the program returned ``old`` (an added output keeps its tag)."""
        name = old.meta.get("custom", {}).get(OUTPUT_TAG)
        if name is not None:
            self._tag(new, name)
        if old in self._new_outputs:
            self._new_outputs[self._new_outputs.index(old)] = new
            return
        output = self.output_node
        if old not in output.args[0]:
            raise ValueError(f"{old.name} is not an output of the program")
        output.args = (tuple(new if o is old else o for o in output.args[0]),)

    def replace_uses(
        self,
        value: torch.fx.Node,
        new: torch.fx.Node,
        *,
        users: Sequence[torch.fx.Node] | None = None,
        keep_output: bool = False,
    ) -> None:
        """Make readers of ``value`` read ``new``.

        ``users``: exactly these readers; default every reader except the code this
        editor inserted (which includes ``new``'s own computation). ``keep_output``:
        the graph's output keeps returning ``value`` (e.g. raw logits for logprobs).
        """
        if new is value:
            return
        inserted = set(self.inserted)
        chosen = set(users) if users is not None else None
        output = self.output_node

        def rewire(user: torch.fx.Node) -> bool:
            if chosen is not None:
                return user in chosen
            return user not in inserted and not (keep_output and user is output)

        value.replace_all_uses_with(new, delete_user_cb=rewire, propagate_meta=False)

    @staticmethod
    def _tag(node: torch.fx.Node, name: str) -> None:
        node.meta["custom"] = {**node.meta.get("custom", {}), OUTPUT_TAG: name}

    def fake(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Run ``fn`` inside the program's fake mode (to build a new input's ``val``)."""
        with self.fake_mode:
            return fn()

    def splice(self, fn: Callable, args: Sequence[torch.fx.Node], *, near: torch.fx.Node, prefix: str):
        """Trace ``fn(*tensors)`` to aten and insert it right after the last of ``args``.

        Inserted nodes are named ``{prefix}_{op}`` and carry ``near``'s module
        stack and stack trace. Returns the node (or tuple of nodes) ``fn`` returned.
        """
        vals = [a.meta["val"] for a in args]
        shape_env = self.fake_mode.shape_env
        before_replacements = dict(shape_env.replacements) if shape_env is not None else {}
        with self.fake_mode:
            traced = make_fx(fn, tracing_mode="real")(*vals)
        if shape_env is not None and shape_env.replacements != before_replacements:
            pinned = {k: v for k, v in shape_env.replacements.items() if before_replacements.get(k) != v}
            raise RuntimeError(
                f"inserting {prefix} code specialised the program's dynamic sizes {pinned}; "
                "this is a bug in the inserted kernel (it must not branch on batch sizes)"
            )
        order = {n: i for i, n in enumerate(self.graph.nodes)}
        anchor = max(args, key=order.__getitem__)
        placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
        val_map: dict[torch.fx.Node, Any] = dict(zip(placeholders, args))
        before = anchor.next
        while before.op == "placeholder":  # never interleave code with the placeholders
            before = before.next
        with self.graph.inserting_before(before):
            result = self.graph.graph_copy(traced.graph, val_map)
        stack = near.meta.get("nn_module_stack")
        trace = near.meta.get("stack_trace")
        for sub_node, node in val_map.items():
            if sub_node.op == "placeholder":
                continue
            node._rename(f"{prefix}_{sub_node.name}")
            if stack is not None:
                node.meta["nn_module_stack"] = copy.copy(stack)
            if trace is not None:
                node.meta["stack_trace"] = trace
            node.meta.pop("source_fn_stack", None)
            self.inserted.append(node)
        return result

    # ------------------------------------------------------------------ build
    def build(self) -> ExportedProgram:
        old = self.program
        output = self.output_node
        if self._new_outputs:
            output.args = (tuple(output.args[0]) + tuple(self._new_outputs),)
        self.graph.lint()
        self.module.recompile()

        sig = old.graph_signature
        # A pass may have replaced an output value (bare logits -> masked logits).
        renames = {
            spec.arg.name: node.name
            for spec, node in zip(sig.output_specs, output.args[0])
            if isinstance(spec.arg, TensorArgument) and isinstance(node, torch.fx.Node) and spec.arg.name != node.name
        }
        input_specs = list(sig.input_specs) + [
            InputSpec(kind=InputKind.USER_INPUT, arg=TensorArgument(name=n.name), target=None)
            for n, _ in self._new_inputs
        ]
        output_specs = [
            OutputSpec(kind=s.kind, arg=TensorArgument(name=renames[s.arg.name]), target=s.target)
            if isinstance(s.arg, TensorArgument) and s.arg.name in renames
            else s
            for s in sig.output_specs
        ] + [
            OutputSpec(kind=OutputKind.USER_OUTPUT, arg=TensorArgument(name=n.name), target=None)
            for n in self._new_outputs
        ]
        call_graph = copy.deepcopy(old.module_call_graph)
        root = call_graph[0].signature
        if root is not None:
            for arg in root.outputs:
                if isinstance(arg, TensorArgument) and arg.name in renames:
                    arg.name = renames[arg.name]
            self._extend_root_signature(root)
        example_inputs = old.example_inputs
        if example_inputs is not None and self._new_inputs:
            args, kwargs = example_inputs
            kwargs = dict(kwargs)
            kwargs.update({n.name: example for n, example in self._new_inputs})
            example_inputs = (args, kwargs)
        return ExportedProgram(
            root=self.module,
            graph=self.graph,
            graph_signature=ExportGraphSignature(input_specs=input_specs, output_specs=output_specs),
            state_dict=dict(old.state_dict),  # a shallow copy: move_to_device_pass edits it in place
            range_constraints=old.range_constraints,
            module_call_graph=call_graph,
            example_inputs=example_inputs,
            constants=dict(old.constants),
            verifiers=[old.verifier],
        )

    def _extend_root_signature(self, root) -> None:
        if self._new_inputs:
            args, kwargs = pytree.tree_unflatten(list(range(root.in_spec.num_leaves)), root.in_spec)
            kwargs = dict(kwargs)
            for node, _ in self._new_inputs:
                kwargs[node.name] = -1
                root.inputs.append(TensorArgument(name=node.name))
                if root.forward_arg_names is not None:
                    root.forward_arg_names.append(node.name)
            root.in_spec = pytree.tree_flatten((args, kwargs))[1]
        if self._new_outputs:
            original = pytree.tree_unflatten(list(range(root.out_spec.num_leaves)), root.out_spec)
            extended = (original, *[-1 for _ in self._new_outputs])
            root.out_spec = pytree.tree_flatten(extended)[1]
            root.outputs.extend(TensorArgument(name=n.name) for n in self._new_outputs)

    # ------------------------------------------------------------------ a part of a program
    @staticmethod
    def subprogram(
        program: ExportedProgram,
        graph: torch.fx.Graph,
        *,
        state: Sequence[str],
        user_inputs: Sequence[str],
        outputs: Sequence,
        in_spec,
        out_spec,
        arg_names: list[str] | None,
        example_inputs,
        mutations: Sequence[OutputSpec] = (),
        keep_module_calls: bool = False,
    ) -> ExportedProgram:
        """A new program running ``graph`` (made of ``program``'s nodes): its inputs are the
        placeholders ``state`` (parameters, buffers and constants of ``program``, whose
        values it holds) then ``user_inputs``; its outputs the buffer ``mutations`` then
        ``outputs`` (node names, or a constant output's argument). ``in_spec`` / ``out_spec``
        / ``arg_names`` make its call signature; ``keep_module_calls`` keeps ``program``'s
        module call entries whose values ``graph`` still has."""
        spec_of = {s.arg.name: s for s in program.graph_signature.input_specs if isinstance(s.arg, TensorArgument)}
        arguments = [TensorArgument(name=o) if isinstance(o, str) else o for o in outputs]
        input_specs = [spec_of[name] for name in state] + [
            InputSpec(kind=InputKind.USER_INPUT, arg=TensorArgument(name=name), target=None) for name in user_inputs
        ]
        output_specs = list(mutations) + [OutputSpec(kind=OutputKind.USER_OUTPUT, arg=a, target=None) for a in arguments]
        root = ModuleCallSignature(inputs=[TensorArgument(name=n) for n in user_inputs], outputs=arguments,
                                   in_spec=in_spec, out_spec=out_spec, forward_arg_names=arg_names)
        entries = [ModuleCallEntry(fqn="", signature=root)]
        if keep_module_calls:
            names = {n.name for n in graph.nodes} | {None}
            entries += [e for e in program.module_call_graph[1:] if e.signature is None or all(
                getattr(a, "name", None) in names for a in [*e.signature.inputs, *e.signature.outputs])]
        targets = [spec_of[name].target for name in state]
        return ExportedProgram(
            root=torch.fx.GraphModule(program.graph_module, graph),
            graph=graph,
            graph_signature=ExportGraphSignature(input_specs=input_specs, output_specs=output_specs),
            state_dict={t: program.state_dict[t] for t in targets if t in program.state_dict},
            range_constraints=dict(program.range_constraints),
            module_call_graph=entries,
            example_inputs=example_inputs,
            constants={t: program.constants[t] for t in targets if t in program.constants},
            verifiers=[program.verifier],
        )
