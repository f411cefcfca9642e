"""The graph core: what every pass and room builds on.

``transform`` (the front door and :class:`~neuron_constrain.core.transform.Transformed`),
``pass_manager`` (runs passes under their contracts), ``program`` (``ProgramEditor``, the only
place passes edit a program), ``sites`` (where the logits are and where they are sampled),
``checks`` (invariants of a rewritten program), ``contract``, ``report``, ``canonical`` and
``graph_diff`` (graphs as text and their differences), ``errors`` (the error family's base),
and the three ``*_interface`` modules plus ``tap_context``: the inputs a pass adds, named once.
"""
