"""glibc malloc tuning for bulk transfers.

Frames of up to a few MiB are allocated and freed per chunk. With glibc's
defaults each such buffer is a fresh mmap, so every copy into it page-faults
256 times per MiB; measured here, that halved file throughput. Raising the mmap
threshold above the largest frame and letting up to ``trim`` bytes of freed heap
stay mapped makes those buffers reuse warm memory. Cost: up to ``trim`` bytes of
RSS kept after a burst (32 MiB by default, inside the "idle + 32 MiB" budget).
"""

from __future__ import annotations

from guestd.libc import mallopt

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


def tune_malloc(mmap_threshold: int = 8 * 1024 * 1024, trim_threshold: int = 32 * 1024 * 1024) -> bool:
    """Apply the settings to this process; False where mallopt is unavailable (non-glibc)."""
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(M_TRIM_THRESHOLD, trim_threshold))
