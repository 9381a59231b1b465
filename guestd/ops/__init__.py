"""Capabilities: one module per capability, each registering its ops with the dispatcher."""
