"""shell capability: persistent bash sessions (engine: session.py; handlers: handlers.py)."""
