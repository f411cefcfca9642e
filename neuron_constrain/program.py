"""Program surgery: the one place that adds inputs, outputs and traced code to an
``ExportedProgram``.

torch has no public helper for adding a user input (``_transform_do_not_use``
refuses changed inputs and ``_update`` leaves ``module_call_graph`` stale), so every
pass goes through :class:`ProgramEditor`::

    editor = ProgramEditor(program)              # deep copy; the original is untouched
    mask = editor.add_input("logit_mask", fake)  # placeholder after the last one, meta["val"] set
    out = editor.splice(fn, [logits, mask], near=site)   # fn traced to aten, copied in
    editor.add_output("logit_mask_empty", flag)
    new_program = editor.build()                 # new signature, call specs, verifier run

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

__all__ = ["ProgramEditor", "user_input_names", "user_output_names"]


def user_input_names(program: ExportedProgram) -> list[str]:
    return [s.arg.name for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]


def user_output_names(program: ExportedProgram) -> list[str]:
    return [
        getattr(s.arg, "name", None)
        for s in program.graph_signature.output_specs
        if s.kind == OutputKind.USER_OUTPUT
    ]


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
        outs = self.output_node.args[0]
        specs = self.program.graph_signature.output_specs
        return [o for o, s in zip(outs, specs) if s.kind == OutputKind.USER_OUTPUT]

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

    def add_output(self, node: torch.fx.Node) -> None:
        """Append ``node`` as a new user output (returned after the original outputs)."""
        self._new_outputs.append(node)

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
