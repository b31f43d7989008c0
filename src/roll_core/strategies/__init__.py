"""Built-in strategies (``hf``) and the token-level helpers every torch strategy shares."""
