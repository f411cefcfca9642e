"""xgrammar behind the engine contract: the engine, its grammars, its worker processes, its fill threads."""
__all__ = ["engine", "fill_threads", "grammars", "worker"]
