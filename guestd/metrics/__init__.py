"""metrics capability: guest-wide and workload-cgroup figures, once or as a stream (sampler.py, handlers.py)."""
