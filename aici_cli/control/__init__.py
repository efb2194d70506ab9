"""The host side of controllers: the per-step contract and the built-in grammars."""
