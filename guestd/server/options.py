"""guestd's command line: its options declared once, read without argparse when they are plain.

Importing argparse (and gettext with it) and building the parser was ~2-3 ms of guestd's start
to first reply and ~0.3 MiB of its idle RSS, for an argv that is always a few whole
``--name value`` pairs. :func:`parse_command_line` reads such an argv from the table below; help,
``--version``, an abbreviated name, a value argparse might read differently (one starting with
``-``) or one that does not convert go to the argparse parser built from the same table, so what
guestd accepts, its errors and its help are argparse's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Final

from guestd import __version__
from guestd.config import DEFAULT_VSOCK_PORT
from guestd.wire.record import Record

if TYPE_CHECKING:
    import argparse


class Option(Record):  # a Record, not a NamedTuple: declared on the start path
    __slots__ = ("convert", "default", "flag", "help", "metavar", "repeat", "switch")

    def __init__(
        self,
        flag: str,
        help: str | None = None,
        convert: Callable[[str], Any] = str,
        default: Any = None,
        switch: bool = False,
        repeat: bool = False,
        metavar: str | None = None,
    ) -> None:
        self.flag: Final = flag
        self.help: Final = help
        self.convert: Final = convert  # what argparse calls type=
        self.default: Final = default
        self.switch: Final = switch  # takes no value (store_true)
        self.repeat: Final = repeat  # each use appends (action="append")
        self.metavar: Final = metavar

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")


OPTIONS: tuple[Option, ...] = (
    Option("--config", "TOML config file; flags override it", metavar="FILE"),
    Option(
        "--listen",
        f"unix:PATH, vsock:PORT (default port {DEFAULT_VSOCK_PORT}) or serial:DEVICE; repeatable",
        repeat=True,
        metavar="ADDR",
    ),
    Option(
        "--allow-cid",
        "vsock peer CID allowed to connect (repeatable; default: 2, the host)",
        int,
        repeat=True,
        metavar="CID",
    ),
    Option("--max-frame", "max frame payload bytes", int),
    Option("--max-inflight", "max requests in flight per connection", int),
    Option("--max-connections", None, int),
    Option("--token-file", "file holding an access token clients must present"),
    Option("--runtime-dir", "private state directory (default /run/guestd as root)", default=""),
    Option("--code-pool", "pre-started kernels kept ready (default 1; 0 disables)", int),
    Option("--code-prewarm", "fill the kernel pool at start-up, not on first use", switch=True),
    Option("--max-contexts", None, int),
    Option("--max-processes", "live background processes", int),
    Option("--max-kept-processes", "kept background processes, finished included", int),
    Option("--process-retention", "seconds a finished process stays attachable", float),
    Option("--max-shells", None, int),
    Option("--no-uvloop", "use the default asyncio loop", switch=True),
    Option(
        "--simulate-privileged",
        "record CRNG/clock/hostname/machine-id changes instead of making them, even in a guest",
        switch=True,
    ),
    Option(
        "--in-guest",
        "this machine is a guest VM (config: in_guest = true): restore and prepare may set its clock, "
        "hostname, machine-id and random seed; without it they are simulated",
        switch=True,
    ),
    Option("--ready-fd", "write 'ready' to this fd once listening", int),
    Option("--workspace", "working directory (created if missing)"),
    Option("--log-level"),
)
_BY_FLAG = {option.flag: option for option in OPTIONS}


def parse_command_line(argv: Sequence[str]) -> Any:
    """The options in ``argv`` as attributes (argparse's Namespace when argparse read them)."""
    plain = parse_plain(argv)
    if plain is not None:
        return SimpleNamespace(**plain)
    return build_parser().parse_args(argv)  # exits with argparse's message on an error, or after help


def parse_plain(argv: Sequence[str]) -> dict[str, Any] | None:
    """``argv`` made only of whole option names from the table, as ``--name value``,
    ``--name=value`` or a bare switch: each option's value, as argparse would read it.
    None for anything else, left to argparse."""
    values: dict[str, Any] = {o.dest: ([] if o.repeat else (False if o.switch else o.default)) for o in OPTIONS}
    i = 0
    while i < len(argv):
        name, equals, value = argv[i].partition("=")
        i += 1
        option = _BY_FLAG.get(name)
        if option is None:  # help, --version, an abbreviation, a positional, a typo
            return None
        if option.switch:
            if equals:
                return None
            values[option.dest] = True
            continue
        if not equals:
            # argparse reads a following "-..." as an option or a negative number: it decides.
            if i == len(argv) or argv[i].startswith("-"):
                return None
            value = argv[i]
            i += 1
        try:
            converted = option.convert(value)
        except ValueError:
            return None  # argparse says what is wrong with it
        if option.repeat:
            values[option.dest].append(converted)
        else:
            values[option.dest] = converted
    return values


def build_parser() -> argparse.ArgumentParser:
    import argparse

    class FixedWidthHelp(argparse.HelpFormatter):
        """Help at a fixed width: the default formatter asks shutil for the terminal's width,
        and importing shutil (zlib, bz2 and lzma with it) is start-up time nobody needs."""

        def __init__(self, prog: str) -> None:
            super().__init__(prog, width=100)

    p = argparse.ArgumentParser(
        prog="guestd", description="guestd: the in-guest sandbox agent", formatter_class=FixedWidthHelp
    )
    for o in OPTIONS:
        if o.switch:
            p.add_argument(o.flag, action="store_true", help=o.help)
        else:
            action = "append" if o.repeat else "store"
            default = [] if o.repeat else o.default
            p.add_argument(o.flag, action=action, type=o.convert, default=default, metavar=o.metavar, help=o.help)
    p.add_argument("--version", action="version", version=f"guestd {__version__}")
    return p
