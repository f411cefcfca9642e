"""llguidance behind the engine contract: the engine, its tokenizer, EBNF to Lark."""
__all__ = ["ebnf_to_lark", "engine", "tokenizer"]
