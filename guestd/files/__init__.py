"""files capability: read, write, upload, download, stat, list, mkdir, remove, rename (handlers.py)."""
