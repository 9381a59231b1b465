"""guestd's command line (guestd/server/options.py): a plain argv is read without argparse, and
read exactly as argparse reads it; anything else is argparse's to read, reject or explain."""

from __future__ import annotations

import subprocess
import sys

import pytest

from guestd.server.options import OPTIONS, build_parser, parse_command_line, parse_plain

SAMPLE = {int: "7", float: "2.5", str: "unix:/run/a=b.sock"}  # "=" inside a value: split at the first


def _every_option(joined: bool) -> list[str]:
    argv: list[str] = []
    for o in OPTIONS:
        if o.switch:
            argv.append(o.flag)
            continue
        for _ in range(2 if o.repeat else 1):
            value = SAMPLE[o.convert] if o.convert in SAMPLE else SAMPLE[str]
            argv += [f"{o.flag}={value}"] if joined else [o.flag, value]
    return argv


@pytest.mark.parametrize(
    "argv",
    [
        [],
        _every_option(joined=False),
        _every_option(joined=True),
        ["--listen", "unix:/tmp/g.sock", "--log-level", "WARNING", "--runtime-dir", "/tmp/rt"],  # the bench's
        ["--max-frame", "1", "--max-frame", "2"],  # the last one wins
        ["--listen="],  # an empty value
    ],
)
def test_a_plain_argv_reads_as_argparse_reads_it(argv: list[str]) -> None:
    plain = parse_plain(argv)
    assert plain is not None
    assert plain == vars(build_parser().parse_args(argv))


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["--version"],
        ["--lis", "unix:/x.sock"],  # an abbreviation argparse accepts
        ["--max-frame", "lots"],  # a value that does not convert
        ["--ready-fd", "-1"],  # a value that looks like an option
        ["--listen"],  # no value
        ["--code-prewarm=yes"],  # a switch given a value
        ["positional"],
        ["--no-such-option", "1"],
    ],
)
def test_anything_else_is_left_to_argparse(argv: list[str]) -> None:
    assert parse_plain(argv) is None


def test_argparse_reads_what_the_plain_reader_leaves() -> None:
    assert parse_command_line(["--ready-fd", "-1"]).ready_fd == -1
    assert parse_command_line(["--lis", "unix:/x.sock"]).listen == ["unix:/x.sock"]
    done = subprocess.run(
        [sys.executable, "-m", "guestd", "--max-frame", "lots"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "argument --max-frame: invalid int value: 'lots'" in done.stderr


def test_a_plain_argv_does_not_import_argparse() -> None:
    probe = (
        "import sys; from guestd.server.options import parse_command_line; "
        "parse_command_line(['--listen', 'unix:/x.sock', '--code-prewarm', '--max-frame=65536']); "
        "print('argparse' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60)
    assert done.stdout.strip() == "False"
