"""Run output: a child's pipes read under a streaming client's credit (pump.py), and the narrow
shape of the request that credit belongs to (stream.py)."""
