"""Run output, below the capabilities and services: a child's pipes read under a streaming
client's credit (pump.py, over the narrow request shape of stream.py), bounded capture with
exact accounting (capture.py), spill files holding every byte (spill.py), and shaping for
models (shaping.py)."""
