"""exec capability: a command run to completion (engine: run.py; handler: handlers.py)."""
