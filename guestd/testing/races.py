"""Workload processes that race guestd's file ops, as scripts for a Python the
workload user can run: on the host (tests/test_fs_boundary.py) and in the guest
(tests/qemu/test_systemd.py). Each takes ``name out seconds``."""

# Every script's head: its arguments, then a loop until ``seconds`` have passed (the body
# that follows is indented as the loop's).
_RACE_FOR_SECONDS = r"""
import os, sys, time
name, out, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
end = time.time() + seconds
while time.time() < end:"""

# A workload process that keeps swapping a name between a directory and a symlink out.
SWAPPER = (
    _RACE_FOR_SECONDS
    + r"""
    try:
        os.rmdir(name)
    except OSError:
        try:
            os.unlink(name)
        except OSError:
            pass
    try:
        os.symlink(out, name)
    except OSError:
        pass
    try:
        os.unlink(name)
        os.mkdir(name)
    except OSError:
        pass
"""
)


# A workload process that turns every fresh directory at ``name`` into a symlink to ``out``.
SNATCHER = (
    _RACE_FOR_SECONDS
    + r"""
    try:
        os.rmdir(name)
        os.symlink(out, name)
    except OSError:
        pass
    if os.path.islink(name):
        try:
            os.unlink(name)
        except OSError:
            pass
"""
)
