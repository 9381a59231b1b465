"""tree.upload's files get the archive's mode whichever way they are made: created with it where
guestd's umask keeps every bit (no fchmod), or created 0600 and changed once written (a bit the
umask would drop, the sticky bit); setuid and setgid never."""

from __future__ import annotations

import io
import os
import tarfile

from guestd.client import Client
from guestd.testing import Guestd

MODES = [0o000, 0o400, 0o444, 0o600, 0o640, 0o644, 0o660, 0o666, 0o700, 0o755, 0o777, 0o1644, 0o1777, 0o4755, 0o6777]


def test_every_file_has_the_archives_mode_but_setuid_and_setgid(
    workspace_client: Client, workspace_env: tuple[Guestd, str]
) -> None:
    ws = workspace_env[1]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for mode in MODES:
            data = b"mode %o\n" % mode
            info = tarfile.TarInfo(f"f{mode:o}")
            info.mode, info.size = mode, len(data)
            tar.addfile(info, io.BytesIO(data))
    dst = f"{ws}/modes"
    workspace_client.upload_tree(buf.getvalue(), dst)
    for mode in MODES:
        path = f"{dst}/f{mode:o}"
        assert os.stat(path).st_mode & 0o7777 == mode & 0o1777, (oct(mode), oct(os.stat(path).st_mode))
        if os.geteuid() == 0 or mode & 0o400:
            with open(path, "rb") as f:
                assert f.read() == b"mode %o\n" % mode  # written whatever the mode it was made with
