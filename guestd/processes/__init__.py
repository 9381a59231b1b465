"""process capability: background processes, attach/reattach by offset, PTYs (engine: table.py)."""
