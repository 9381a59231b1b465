"""snapshot capability: prepare, resume, restore (engine: state.py; handlers: handlers.py)."""
