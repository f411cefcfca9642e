"""xgrammar behind the engine contract: the engine, its grammars (integers spelled every way JSON Schema
counts as one), its worker processes, its fill threads, its compiled grammars on disk."""
__all__ = ["disk_cache", "engine", "fill_threads", "grammars", "integers", "worker"]
