"""Tool calling: one declarative description per model family (``families``), from which the constraint
(``grammar``), the whole-answer parser (``parse``) and the streaming parser (``stream``) are derived;
``arguments`` types each family's argument spelling by the tool's schema."""
__all__ = ["arguments", "families", "grammar", "parse", "stream"]
