"""The client's typed surface: the blocking Client mirrors AsyncClient signature for signature,
no parameter has an ambiguous name, and schema ops = served ops = ops the client sends."""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from guestd.client import AsyncClient, Client
from guestd.client import aio as client_aio
from guestd.client import ports as client_ports
from guestd.client import workspace as client_workspace
from guestd.testing import Guestd
from guestd.wire.schema import OPS, OPS_BY_NAME

# Async only: they return stream objects to iterate (Client.process_output collects an attach).
STREAMING = {"exec_stream", "code_run_stream", "attach", "watch_ports", "watch", "watch_metrics"}
# Async only, and coroutines: asyncio streams have no blocking twin.
ASYNC_ONLY = {"open_port"}
# Twins of their own shape: the blocking client returns a context manager run on its loop thread.
OWN_SHAPE = {"port_forward", "reverse_forward"}
# Twins that return the blocking variant of an async handle (guestd/client/handles*.py).
HANDLES = {
    "AsyncShell": "Shell",
    "AsyncCodeContext": "CodeContext",
    "AsyncProcess": "Process",
    "AsyncKeptRun": "KeptRun",
}
# Not coroutines, with a blocking twin: they return a handle at once.
HANDLE_FACTORIES = {"kept_run"}
# Constructors: Client.__init__ takes their connection parameters (checked below).
CONSTRUCTORS = {"connect", "from_socket"}
# Names the typed surface retired: each said less than what it bounds (see guestd/client/aio.py).
BANNED_NAMES = {"timeout", "pid_id", "client_timeout", "idle_timeout", "kill_grace", "interrupt_grace"}


def public_methods(cls: type) -> dict[str, Callable[..., Any]]:
    """Public methods (classmethods bound to ``cls``), without properties."""
    out = {}
    for name in dir(cls):
        if name.startswith("_") or isinstance(inspect.getattr_static(cls, name), property):
            continue
        member = getattr(cls, name)
        if callable(member):
            out[name] = member
    return out


def async_methods() -> dict[str, Callable[..., Any]]:
    return {
        name: fn
        for name, fn in public_methods(AsyncClient).items()
        if (inspect.iscoroutinefunction(fn) or name in HANDLE_FACTORIES) and name not in CONSTRUCTORS | ASYNC_ONLY
    }


def test_every_async_method_has_a_blocking_twin_with_the_same_signature() -> None:
    sync = public_methods(Client)
    checked = []
    for name, afn in async_methods().items():
        assert name in sync, f"Client has no {name}"
        asig, ssig = inspect.signature(afn), inspect.signature(sync[name])
        # String annotations (from __future__ import annotations): the same text on both sides.
        assert list(ssig.parameters.values()) == list(asig.parameters.values()), name
        if name not in OWN_SHAPE:
            assert ssig.return_annotation == HANDLES.get(asig.return_annotation, asig.return_annotation), name
        assert not inspect.iscoroutinefunction(sync[name]), name
        checked.append(name)
    assert set(checked) >= HANDLE_FACTORIES
    assert {"exec", "shell_run", "code_run", "process_wait", "process_output", "download"} <= set(checked)


def test_streaming_methods_are_async_only() -> None:
    sync = public_methods(Client)
    for name in STREAMING:
        fn = getattr(AsyncClient, name)
        assert not inspect.iscoroutinefunction(fn)
        assert name not in sync
    # Nothing else: one surface (Client.aio is a property, the plumbing is private).
    assert set(sync) == set(async_methods())


def test_client_connects_with_the_async_constructors_parameters() -> None:
    init = inspect.signature(Client.__init__).parameters
    for ctor in CONSTRUCTORS:
        for name, param in inspect.signature(getattr(AsyncClient, ctor)).parameters.items():
            if param.kind is inspect.Parameter.KEYWORD_ONLY:
                assert init[name] == param, (ctor, name)


def all_parameters() -> list[tuple[str, inspect.Parameter]]:
    out = []
    for cls in (AsyncClient, Client):
        methods: dict[str, Callable[..., Any]] = {**public_methods(cls), "__init__": cls.__init__}
        for name, fn in methods.items():
            for param in inspect.signature(fn).parameters.values():
                out.append((f"{cls.__name__}.{name}", param))
    return out


def test_no_parameter_is_named_ambiguously_or_takes_arbitrary_keywords() -> None:
    params = all_parameters()
    assert len(params) > 150
    for where, param in params:
        assert param.name not in BANNED_NAMES, f"{where}({param.name})"
        assert param.kind is not inspect.Parameter.VAR_KEYWORD, f"{where}(**{param.name})"
        assert param.kind is not inspect.Parameter.VAR_POSITIONAL, f"{where}(*{param.name})"


def test_op_arguments_default_to_omitted() -> None:
    """A parameter named like an argument of the op its method sends defaults to None (the guest
    applies the schema default), so the client holds no copy of a default."""
    sent = ops_sent_by_methods()
    for name, fn in public_methods(AsyncClient).items():
        for op in sent.get(name, ()):
            fields = OPS_BY_NAME[op].fields_by_name
            for param in inspect.signature(fn).parameters.values():
                f = fields.get(param.name)
                if f is None or param.default is inspect.Parameter.empty:
                    continue
                assert param.default is None, f"AsyncClient.{name}({param.name}={param.default!r}) copies {op}"


def ops_sent_by_methods() -> dict[str, set[str]]:
    """Function name -> the op names it passes as the first argument of ``.request(`` /
    ``.start(`` / ``open_relay(``: AsyncClient's methods, and every function of the ports
    module (its methods and the forwards they start)."""
    aio_tree = ast.parse(Path(client_aio.__file__ or "").read_text())
    functions: list[ast.AST] = list(
        next(n for n in aio_tree.body if isinstance(n, ast.ClassDef) and n.name == "AsyncClient").body
    )
    functions += ast.walk(ast.parse(Path(client_ports.__file__ or "").read_text()))
    functions += ast.walk(ast.parse(Path(client_workspace.__file__ or "").read_text()))
    sent: dict[str, set[str]] = {}
    for fn in functions:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if (
                isinstance(node, ast.Call)
                and (
                    (isinstance(node.func, ast.Attribute) and node.func.attr in ("request", "start"))
                    or (isinstance(node.func, ast.Name) and node.func.id == "open_relay")
                )
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                sent.setdefault(fn.name, set()).add(node.args[0].value)
    return sent


def test_schema_ops_are_the_served_ops_and_the_client_sends_each(guestd: Guestd) -> None:
    schema_ops = {op.name for op in OPS}
    with guestd.client() as c:
        served = set(c.aio.server_hello["ops"])
    client_ops = set().union(*ops_sent_by_methods().values())
    assert served == schema_ops
    assert client_ops == schema_ops, (
        f"not sent by any AsyncClient method: {sorted(schema_ops - client_ops)}; "
        f"not in the schema: {sorted(client_ops - schema_ops)}"
    )


@pytest.mark.parametrize("op", ["exec", "code.run", "snapshot.prepare"])
def test_defaults_the_client_derives_from_come_from_the_schema(op: str) -> None:
    """The grace periods and waits a client deadline is derived from exist in the schema with
    a default (AsyncClient reads them from there)."""
    names = {
        "exec": ("kill_grace_s", "linger_s"),
        "code.run": ("interrupt_grace_s",),
        "snapshot.prepare": ("timeout_s",),
    }
    for name in names[op]:
        assert isinstance(client_aio.schema_default(op, name), float)
