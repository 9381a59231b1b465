"""code capability: persistent code contexts (engine: contexts.py over kernel_process.py, kernelspec.py and
messages.py; the kernel's entry: kernel.py)."""
