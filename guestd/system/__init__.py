"""system capability: ping and info (handlers.py)."""
