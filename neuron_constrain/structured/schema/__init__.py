"""The schema compiler: engine-neutral, runs once per constraint.

    prepared = prepare.prepare(constraint, limits)   # limits, satisfiability, the algebra
    view = prepared.view("xgrammar")                 # one engine's rewrites, item plan, unenforced keywords

It imports neither ``engines`` nor ``runtime`` (ARCHITECTURE.md). The modules below are what the other
rooms may import.
"""
__all__ = ["algebra", "code_points", "formats", "item_plan", "keywords", "limits", "pattern_members", "pattern_text",
           "patterns", "prepare", "rewrite", "satisfiable", "values"]
