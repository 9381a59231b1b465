"""guestd/memtune.py: glibc's malloc settings and trim are found and applied (on glibc, as in the
guest; a misspelt symbol would make them quietly do nothing)."""

from __future__ import annotations

import platform

import pytest

from guestd.memtune import release_free_heap, tune_malloc

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")


def test_the_malloc_settings_apply() -> None:
    assert tune_malloc() is True


def test_free_heap_goes_back_to_the_kernel() -> None:
    tune_malloc()  # as guestd does first: freed heap then stays until it is trimmed
    kept = [bytearray(64 * 1024) for _ in range(256)]  # 16 MiB in blocks below the mmap threshold
    del kept
    assert release_free_heap() is True  # malloc_trim says it released memory
