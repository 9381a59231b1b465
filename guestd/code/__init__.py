"""code capability: persistent code contexts (engine: table.py and contexts.py over kernel_process.py, kernelspec.py and
messages.py; the kernel's entry: kernel.py)."""
