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
    """The names of a program's user inputs (not parameters, buffers or constants).

    Args:
        program: an exported program.

    Returns:
        The names, in the signature's order.
    """
    return [s.arg.name for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]


def user_outputs(graph: torch.fx.Graph, signature: ExportGraphSignature) -> list:
    """The output values of a graph that are user outputs (not buffer mutations).

    Args:
        graph: the program's graph (or a copy of it).
        signature: the program's graph signature, which says which outputs are user outputs.

    Returns:
        The output values, in order (nodes, or constants a program returns).
    """
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    return [o for o, s in zip(output.args[0], signature.output_specs) if s.kind == OutputKind.USER_OUTPUT]


def wheres_fed_by(source: torch.fx.Node) -> list[torch.fx.Node]:
    """The ``where`` nodes a value reaches through non-``where`` nodes (a tap's enable flag: its own
    select), found without walking the whole graph.

    Args:
        source: the node to start from.

    Returns:
        The ``aten.where.self`` nodes reached, in the order found.
    """
    found, seen, stack = [], set(), [source]
    while stack:
        for user in stack.pop().users:
            if user in seen:
                continue
            seen.add(user)
            (found if user.target is torch.ops.aten.where.self else stack).append(user)
    return found


def refuse_if_present(program: ExportedProgram, names, *, pass_name: str) -> None:
    """Refuse a program a pass was applied to already (it has one of the inputs the pass adds).

    Args:
        program: the program the pass got.
        names: the user inputs the pass adds.
        pass_name: the pass, for the message.

    Raises:
        TransformError: the program has one of ``names``.
    """
    present = sorted(set(names) & set(user_input_names(program)))
    if present:
        raise TransformError(
            f"the program already has the input(s) {present}: the {pass_name} pass was applied already; "
            "transform the original model or program, not its rewrite"
        )


class ProgramEditor:
    """A mutable copy of an ``ExportedProgram``'s graph; ``build()`` makes the new program.

    Args:
        program: the program to edit; it is left untouched.

    Raises:
        ValueError: its placeholders carry no fake tensors (``meta["val"]``).
    """

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
        """The graph's output node."""
        return next(n for n in reversed(self.graph.nodes) if n.op == "output")

    def user_output_nodes(self) -> list[torch.fx.Node | None]:
        """The graph's user outputs (not buffer mutations).

        Returns:
            The output values, in output order (those added by this editor not among them).
        """
        return user_outputs(self.graph, self.program.graph_signature)

    # ------------------------------------------------------------------ edits
    def add_input(self, name: str, val: torch.Tensor, example: torch.Tensor) -> torch.fx.Node:
        """A new user input, placed after the last placeholder, fed as keyword ``name``.

        Args:
            name: the input's name (the keyword callers pass it as).
            val: a fake tensor made in :attr:`fake_mode` (reuse the program's symbolic sizes to keep them
                dynamic).
            example: a real tensor for the program's ``example_inputs``.

        Returns:
            The new placeholder node.

        Raises:
            ValueError: a node or input of the program has that name already, or FX would rename it.
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
        """:meth:`add_input` for a tensor of a shape; its example is filled with ``fill`` at the sizes the
        program was exported with.

        Args:
            name: the input's name.
            shape: ints and the program's SymInts.
            dtype: the input's dtype.
            fill: the example's value.
            device: the fake tensor's device (default: the fake mode's).

        Returns:
            The new placeholder node.

        Raises:
            ValueError: a node or input of the program has that name already.
        """
        val = self.fake(lambda: torch.empty(tuple(shape), dtype=dtype, device=device))
        hints = tuple(int(d.node.hint) if isinstance(d, torch.SymInt) else int(d) for d in shape)
        return self.add_input(name, val, torch.full(hints, fill, dtype=dtype))

    def find_output(self, name: str) -> torch.fx.Node | None:
        """The output a pass added under a name (this editor's, or an earlier pass's).

        Args:
            name: the name it was added as (``logit_mask_empty``).

        Returns:
            Its node, or None.
        """
        for node in [*self.user_output_nodes(), *self._new_outputs]:
            if isinstance(node, torch.fx.Node) and node.meta.get("custom", {}).get(OUTPUT_TAG) == name:
                return node
        return None

    def add_output(self, node: torch.fx.Node, name: str) -> None:
        """Append a node as a new user output (after the original outputs), tagged with its name.

        Args:
            node: the value to return.
            name: what :meth:`find_output` finds it by (kept in the saved program).
        """
        self._tag(node, name)
        self._new_outputs.append(node)

    def replace_output(self, old: torch.fx.Node, new: torch.fx.Node) -> None:
        """Return one value where the program returned another (an added output keeps its tag).

        Args:
            old: an output of the program, or one this editor added.
            new: the value to return instead.

        Raises:
            ValueError: ``old`` is not an output.
        """
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

    def replace_uses(self, value: torch.fx.Node, new: torch.fx.Node, *, users: Sequence[torch.fx.Node] | None = None,
                     keep_output: bool = False) -> None:
        """Make readers of a value read another.

        Args:
            value: the value read now.
            new: what they read instead (nothing changes when it is ``value``).
            users: exactly these readers; default every reader except the code this editor inserted
                (which includes ``new``'s own computation).
            keep_output: the graph's output keeps returning ``value`` (e.g. raw logits for logprobs).
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
        """Run a function inside the program's fake mode (to build a new input's ``val``).

        Args:
            fn: makes the tensor.

        Returns:
            What ``fn`` returned: a fake tensor sharing the program's symbolic sizes.
        """
        with self.fake_mode:
            return fn()

    def splice(self, fn: Callable, args: Sequence[torch.fx.Node], *, near: torch.fx.Node, prefix: str):
        """Trace a torch function to aten on the program's fake tensors and insert it right after the last
        of its arguments.

        Args:
            fn: a plain torch function of tensors; it must not branch on the program's dynamic sizes.
            args: the nodes whose values it takes.
            near: the node whose module stack and stack trace the inserted nodes carry.
            prefix: the inserted nodes are named ``{prefix}_{op}``.

        Returns:
            The node (or tuple of nodes) ``fn`` returned.

        Raises:
            RuntimeError: tracing ``fn`` specialised a dynamic size of the program (a bug of the kernel).
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
        """The edited program: the added inputs and outputs in its signature, call specs and example inputs.

        Returns:
            A new ``ExportedProgram`` sharing the original's weights and constants.
        """
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
    def subprogram(program: ExportedProgram, graph: torch.fx.Graph, *, state: Sequence[str], user_inputs: Sequence[str],
                   outputs: Sequence, in_spec, out_spec, arg_names: list[str] | None, example_inputs,
                   mutations: Sequence[OutputSpec] = (), keep_module_calls: bool = False) -> ExportedProgram:
        """A new program running a graph made of another program's nodes (a part of it: the split).

        Args:
            program: the program the graph's nodes come from.
            graph: the part's graph.
            state: its first placeholders: parameters, buffers and constants of ``program``, whose values it holds.
            user_inputs: its user inputs' placeholders, after ``state``.
            outputs: its user outputs: node names, or a constant output's argument.
            in_spec: the pytree spec of its call's inputs.
            out_spec: the pytree spec of its outputs.
            arg_names: its forward's argument names.
            example_inputs: its ``example_inputs``.
            mutations: buffer mutation outputs, before ``outputs``.
            keep_module_calls: keep ``program``'s module call entries whose values ``graph`` still has.

        Returns:
            The program.
        """
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
