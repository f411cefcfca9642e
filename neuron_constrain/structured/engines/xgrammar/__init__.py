"""xgrammar behind the engine contract: the engine, its grammars, its worker processes, its fill threads, its
compiled grammars on disk."""
__all__ = ["disk_cache", "engine", "fill_threads", "grammars", "worker"]
