"""code capability: persistent Python contexts (engine: contexts.py; kernel entry: kernel.py)."""
