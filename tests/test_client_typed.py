"""One typed style (issue 30): every public client method returns a typed result (a dataclass,
a handle, a plain value), never a dict, Any or a bare tuple; the handles' methods take the
flat methods' parameters; the generated reply dataclasses are current; the handles work."""

from __future__ import annotations

import builtins
import inspect
import re
import typing
from collections.abc import Callable
from typing import Any

import pytest

from guestd.client import AsyncClient, Client, git, git_sync, handles, handles_sync, replies, results
from guestd.client.replies import ProcessWaitResult, RunInfo, ShellInfo
from guestd.client.results import ProcessOutput

# ``call``: the escape hatch, any op by name, its reply as the wire sent it. ``open_port``: an
# asyncio (reader, writer) pair, as asyncio.open_connection returns.
UNTYPED_ON_PURPOSE = {"call", "open_port"}
# Shapes a return annotation must not have: a wire map, Any, a bare tuple, the wire TypedDicts.
UNTYPED = re.compile(r"\bdict\[|\bAny\b|\btuple\[|\b\w+(Reply|Record|Event)\b")


def public_methods(cls: type) -> dict[str, Callable[..., Any]]:
    out = {}
    for name in dir(cls):
        if name.startswith("_") or isinstance(inspect.getattr_static(cls, name), property):
            continue
        member = getattr(cls, name)
        if callable(member):
            out[name] = member
    return out


HANDLE_CLASSES = [
    handles.AsyncShell,
    handles.AsyncCodeContext,
    handles.AsyncProcess,
    handles.AsyncKeptRun,
    handles_sync.Shell,
    handles_sync.CodeContext,
    handles_sync.Process,
    handles_sync.KeptRun,
    git.AsyncGit,
    git_sync.Git,
]


def top_level_union(text: str) -> list[str]:
    """The members of a union at the top of an annotation's text, None left out
    (``bytes | int`` -> both; ``list[A | B]`` and ``X | None`` -> one)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "|" and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return [p for p in parts if p != "None"]


# Where the result types live: a union member is resolved here by its name.
RESULT_TYPES: dict[str, object] = {**vars(builtins), **vars(results), **vars(replies)}


def related(members: list[str]) -> bool:
    """One type, or classes that share a base of their own (ShellResult | CodeResult: a kept run's
    op is known only when it is read, both are RunFigures); bytes | int is not."""
    if len(members) <= 1:
        return True
    classes = [RESULT_TYPES.get(m) for m in members]
    if not all(isinstance(c, type) for c in classes):
        return False
    shared = set.intersection(*(set(c.__mro__) for c in classes if isinstance(c, type)))
    return bool(shared - {object})


def annotation_text(annotation: object) -> str:
    return annotation if isinstance(annotation, str) else getattr(annotation, "__name__", repr(annotation))


@pytest.mark.parametrize("cls", [AsyncClient, Client, *HANDLE_CLASSES], ids=lambda c: c.__name__)
def test_every_public_method_returns_a_typed_result(cls: type) -> None:
    """Typed, and one type: a return that is one of two unrelated types (``bytes | int``) says
    which by overloads on the arguments (each overload is checked instead)."""
    checked = 0
    for name, fn in public_methods(cls).items():
        if name in UNTYPED_ON_PURPOSE:
            continue
        annotation = inspect.signature(fn).return_annotation
        assert annotation is not inspect.Signature.empty, f"{cls.__name__}.{name} has no return annotation"
        overloads = typing.get_overloads(inspect.unwrap(fn))
        for variant in overloads or [fn]:
            text = annotation_text(inspect.signature(variant).return_annotation)
            assert not UNTYPED.search(text), f"{cls.__name__}.{name} -> {text}"
            assert related(top_level_union(text)), f"{cls.__name__}.{name} -> {text}: overload it"
        checked += 1
    assert checked >= (40 if cls in (AsyncClient, Client) else 2)


def test_the_union_check_sees_unions() -> None:
    assert top_level_union("bytes | int") == ["bytes", "int"]
    assert top_level_union("FileStat | None") == ["FileStat"]
    assert top_level_union("AsyncIterator[MetricsSample | OomKills]") == ["AsyncIterator[MetricsSample | OomKills]"]
    assert not related(["bytes", "int"]) and related(["ShellResult", "CodeResult"])


@pytest.mark.parametrize(
    ("handle", "method", "flat", "bound"),
    [
        (handles.AsyncShell, "run", "shell_run", "session"),
        (handles.AsyncCodeContext, "run", "code_run", "context"),
        (handles.AsyncProcess, "output", "process_output", "process_id"),
        (handles.AsyncProcess, "attach", "attach", "process_id"),
        (handles.AsyncProcess, "write", "process_write", "process_id"),
        (handles.AsyncProcess, "wait", "process_wait", "process_id"),
        (handles_sync.Shell, "run", "shell_run", "session"),
        (handles_sync.CodeContext, "run", "code_run", "context"),
        (handles_sync.Process, "output", "process_output", "process_id"),
        (handles_sync.Process, "write", "process_write", "process_id"),
        (handles_sync.Process, "wait", "process_wait", "process_id"),
    ],
)
def test_a_handles_method_takes_the_flat_methods_parameters(handle: type, method: str, flat: str, bound: str) -> None:
    client = AsyncClient if handle.__module__.endswith("handles") else Client
    flat_params = [p for p in inspect.signature(getattr(client, flat)).parameters.values() if p.name != bound]
    mine = list(inspect.signature(getattr(handle, method)).parameters.values())
    # The same names, kinds and defaults (the annotations are the same text, unresolved).
    assert [(p.name, p.kind, repr(p.default)) for p in mine] == [(p.name, p.kind, repr(p.default)) for p in flat_params]


def test_generated_reply_dataclasses_are_current() -> None:
    from guestd.wire.codegen_client import render_client, replies_path

    with open(replies_path()) as f:
        assert f.read() == render_client(), "run: python -m guestd.wire.codegen"


def test_handles_and_typed_replies_against_a_real_guestd(client: Client) -> None:
    assert isinstance(client.ping(), float) and 0 < client.ping() < 60
    with client.shell_create() as sh:
        assert sh.run("cd /tmp && echo here").text == "here\n"
        assert sh.run("pwd").stdout_text == "/tmp\n"  # the session's state persists
        listed = {s.id: s for s in client.shell_list()}
        assert isinstance(listed[sh.id], ShellInfo) and listed[sh.id].pid == sh.pid
    assert sh.id not in {s.id for s in client.shell_list()}  # closed on exit
    with client.process_start(["sh", "-c", "cat; echo done >&2"], stdin=True) as p:
        assert p.write(iter([b"a", "\u00e9".encode()])) == 3
        p.close_stdin()
        w = p.wait(timeout_s=30)
        assert isinstance(w, ProcessWaitResult) and w.state == "exited" and w.exit_code == 0
        out = p.output()
        assert isinstance(out, ProcessOutput) and out.text == "aé" and out.stderr_text == "done\n"
        assert out.status.state == "exited" and out.status.stdout_offset == 3
    assert p.id not in {x.id for x in client.process_list()}  # forgotten on exit
    r = client.exec(["sh", "-c", "printf 'x\\377y'"])
    assert r.stdout == b"x\xffy" and r.text == "x\ufffdy"


def test_kept_run_handle(client: Client) -> None:
    with client.shell_create() as sh:
        r = sh.run("echo kept", keep=True)
        assert r.run_id is not None
        with client.kept_run(r.run_id) as run:
            info = run.get()
            assert isinstance(info, RunInfo) and info.state == "done" and info.op == "shell.run"
            assert run.result().stdout == b"kept\n"
