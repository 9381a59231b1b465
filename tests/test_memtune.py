"""guestd/memtune.py: glibc's malloc settings are found and applied (on glibc, as in the guest;
a misspelt symbol would make them quietly do nothing)."""

from __future__ import annotations

import platform

import pytest

from guestd.memtune import tune_malloc


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_the_malloc_settings_apply() -> None:
    assert tune_malloc() is True
