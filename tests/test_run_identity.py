"""A run that drops to the workload user gets that user's HOME, USER and LOGNAME, as login(1)
sets them (issue 30): before, exec, shells and background processes inherited guestd's own
(HOME=/root under systemd), so ``pip install --user`` through exec did not reach the home the
workload's code kernels use, and tools wrote their config where the workload cannot."""

from __future__ import annotations

import os
import pwd

import pytest

from guestd.client import Client
from guestd.testing.local import workspace_guestd

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the workload as nobody")

NOBODY = pwd.getpwnam("nobody")
SHOW = 'echo "$HOME|$USER|$LOGNAME"'


def test_exec_shells_and_processes_run_with_the_workload_users_identity() -> None:
    expected = f"{NOBODY.pw_dir}|nobody|nobody\n"
    with workspace_guestd("guestd-identity-") as (g, _ws), Client(g.address) as c:
        assert c.exec(SHOW).text == expected
        assert c.exec(SHOW, env={"FOO": "1"}).text == expected  # a merge keeps it
        with c.shell_create() as sh:
            assert sh.run(SHOW).text == expected
        with c.process_start(SHOW) as p:
            p.wait()
            assert p.output(follow=False).stdout_text == expected
        with c.process_start(SHOW, pty=True) as p:
            p.wait()
            assert p.output(follow=False).stdout_text.replace("\r\n", "\n") == expected


def test_a_request_that_names_home_or_replaces_the_environment_gets_what_it_asked() -> None:
    with workspace_guestd("guestd-identity-") as (g, _ws), Client(g.address) as c:
        assert c.exec(SHOW, env={"HOME": "/tmp", "USER": "u"}).text == "/tmp|u|nobody\n"
        assert c.exec(SHOW, env={"PATH": "/usr/bin:/bin"}, replace_env=True).text == "||\n"
