"""port capability: TCP relay into the guest, listener discovery, wait-for-port, reverse forwards
(engines: relay.py, listeners.py, reverse.py; handlers: handlers.py)."""
