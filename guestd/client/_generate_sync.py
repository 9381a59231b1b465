"""Generate the blocking client from the async one: ``python -m guestd.client._generate_sync``.

The blocking :class:`~guestd.client.Client` is a facade over the asyncio client, run on a
private loop thread (:mod:`guestd.client._blocking`, hand-written). Everything that only
mirrors the async sources is written here from them, read with :mod:`ast`:

- a **facade** class (``Client``, ``SyncPortsAPI``, ``SyncWorkspaceAPI``, ``Git``,
  ``SyncExpect``) has, for each public coroutine of its async class, a method with the same
  signature, overloads, defaults, return annotation and docstring that runs the coroutine
  through the facade's runner. Parameters typed as output or event callbacks are handed to the
  caller's thread (:class:`~guestd.client._blocking.CallerThread`); a coroutine that returns an
  async handle or a forward returns its blocking twin (``WRAPS``). Plain methods and properties
  that return an async twin (``kept_run``, ``git``) are copied with the names mapped; a class
  method that makes the async class from the ``AsyncClient`` (``Expect.start``) makes it on the
  blocking client's loop and returns the facade around it.
- a **twin** class (the handles) is the async class's own source with ``async``/``await``
  dropped and the names mapped (as unasync does): a handle's methods call the flat client
  methods, which have the same signatures on both sides. Its bases are twins too (the
  handles' shared ``AsyncHandle``: ``_blocking.ClosedOnExit``).
- **functions** (``runs_sync``): each coroutine function of a module that takes the client
  first, run through that client.
- **protocols** (``_surface``, ``_surface_sync``): what holds the client (a handle, ``AsyncGit``,
  their blocking twins, a hand-written base) annotates it with a protocol of exactly the members
  it uses, found in its source; the protocol copies the client's signatures. The holders then
  never import the client that makes them, so ``guestd.client`` has no import cycle.

Not mirrored: private names, other class and static methods (constructors), async generators and
plain methods returning streams (``exec_stream``, ``attach``, ``watch``, ...: async only),
``ASYNC_ONLY``, and whatever the hand-written base class in ``_blocking.py`` defines (so a
special case is written there and wins). Adding an op to the async client and running this
adds its blocking twin; ``tests/test_client_generated.py`` fails while a generated file is stale.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import copy
import io
import re
import subprocess
import sys
import tempfile
import textwrap
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

COMMAND = "python -m guestd.client._generate_sync"
CLIENT_DIR = Path(__file__).resolve().parent
REPO = CLIENT_DIR.parent.parent
PACKAGE = "guestd.client"
HAND_WRITTEN = "_blocking"  # the module of the hand-written bases (guestd/client/_blocking.py)
LINE_LENGTH = 120  # the repository's (pyproject.toml): ruff format leaves comments and docstrings as they are


@dataclass(frozen=True)
class Facade:
    """A blocking class whose methods run the async class's coroutines through ``runner``."""

    source: str  # "module.Class" under guestd/client
    name: str
    base: str  # its hand-written base class in _blocking.py
    runner: str  # runs a coroutine and waits for it: ``runner(coro)`` or ``runner(coro, pump)``
    target: str  # the async object whose coroutines it runs
    loop: str | None  # the loop callbacks are handed over from (None: no callbacks here)
    doc: str


@dataclass(frozen=True)
class Twin:
    """A blocking class rewritten from the async class's source (async/await dropped)."""

    source: str  # "module.Class"
    name: str
    base: str | None = None  # a hand-written base in _blocking.py


@dataclass(frozen=True)
class Functions:
    """Blocking twins of a module's coroutine functions whose first parameter is the client."""

    module: str  # under guestd/client


@dataclass(frozen=True)
class Protocols:
    """The client as the objects that hold it use it: a ``typing.Protocol`` for each name the
    ``holders`` annotate the client with (a class of this output's module), listing exactly the
    members they use (read from their source), with the client's own signatures. The blocking
    variant serves the twins of the async holders (their protocols renamed, less what a
    hand-written base replaces) and the hand-written bases; its signatures are the generated
    ``Client``'s."""

    client: str  # "module.Class": the async client
    holders: tuple[str, ...]  # modules (under guestd/client) whose classes and functions hold it
    blocking: bool = False


@dataclass(frozen=True)
class Output:
    path: str  # under guestd/client
    doc: str
    parts: tuple[Facade | Twin | Functions | Protocols, ...]
    reexports: tuple[tuple[str, str], ...] = ()  # (module, name) kept importable from here


RUNNER = "self._run"  # ClientBase's: the loop thread
OUTPUTS = (
    Output(
        "sync.py",
        """Blocking client: the asyncio client driven on a private event-loop thread.

:class:`Client` has every value-returning method of :class:`~guestd.client.aio.AsyncClient`
with the same name, parameters, defaults and return type (generated from it;
``tests/test_client_surface.py`` holds them equal); see :mod:`guestd.client.aio` for how
timeouts and deadlines are named and for defaults (None: the guest applies the schema's
default). The streaming calls (``exec_stream``, ``code_run_stream``, ``attach``) are async
only: use :attr:`Client.aio` from async code, :meth:`Process.attach
<guestd.client.handles_sync.Process.attach>` to follow output with callbacks, or
:meth:`Client.process_output` to collect what an attach delivers. The loop thread, the
callbacks moved to the calling thread and closing are in :mod:`guestd.client._blocking`.
""",
        (
            Facade(
                "aio.AsyncClient",
                "Client",
                "ClientBase",
                RUNNER,
                "self._aio",
                "self._loop",
                '``with Client("unix:/run/guestd.sock") as c: c.exec(["ls"])``',
            ),
        ),
        (
            (HAND_WRITTEN, "CALLBACK_BACKLOG"),
            (HAND_WRITTEN, "CANCEL_SEND_S"),
            (HAND_WRITTEN, "ITEM_COST"),
            (HAND_WRITTEN, "CallerThread"),
            (HAND_WRITTEN, "held_size"),
        ),
    ),
    Output(
        "ports_sync.py",
        """The blocking client's port methods: forwards as context managers, run on the client's loop.""",
        (
            Facade(
                "ports.PortsAPI",
                "SyncPortsAPI",
                "ClientBase",
                RUNNER,
                "self._aio",
                "self._loop",
                ":class:`~guestd.client.Client`'s port methods.",
            ),
        ),
        ((HAND_WRITTEN, "PortForwarder"), (HAND_WRITTEN, "ReverseForwarder")),
    ),
    Output(
        "workspace_sync.py",
        """The blocking client's workspace methods (see :mod:`guestd.client.workspace`), run on the client's loop.""",
        (
            Facade(
                "workspace.WorkspaceAPI",
                "SyncWorkspaceAPI",
                "ClientBase",
                RUNNER,
                "self._aio",
                "self._loop",
                ":class:`~guestd.client.Client`'s workspace methods.",
            ),
        ),
    ),
    Output(
        "git_sync.py",
        """Blocking twin of :mod:`guestd.client.git` (``Client.git``): the same methods, run on the
client's loop thread.""",
        (
            Facade(
                "git.AsyncGit",
                "Git",
                "GitBase",
                "self.client._run",
                "self.aio",
                None,
                "git in the guest for a :class:`~guestd.client.Client`; see :class:`AsyncGit`.",
            ),
        ),
    ),
    Output(
        "expect_sync.py",
        """The blocking client's expect helper: :class:`guestd.client.expect.Expect`, each call run on
the :class:`~guestd.client.sync.Client`'s loop (the reader task lives there too)::

    with SyncExpect.start(client, sid, "python3 -q") as e:
        e.expect(rb">>> ", timeout=10)
        e.sendline("6 * 7")
        e.expect(rb"42", timeout=10)
        e.sendline("exit()")
        r = e.wait(timeout=10)
""",
        (
            Facade(
                "expect.Expect",
                "SyncExpect",
                "SyncExpectBase",
                "self._client._run",
                "self.aio",
                None,
                "Drive an interactive command in a shell session (see :class:`~guestd.client.expect.Expect`).",
            ),
        ),
        (("expect", "ExpectEOF"),),
    ),
    Output(
        "handles_sync.py",
        """The blocking client's handles (see :mod:`guestd.client.handles`): a shell session, a code
context, a background process, a kept run, each a context manager that releases it on exit::

    with client.shell_create() as sh:
        print(sh.run("ls").text)

A handle's methods call the flat :class:`~guestd.client.Client` methods with the same parameters.
""",
        (
            Twin("handles.AsyncShell", "Shell"),
            Twin("handles.AsyncCodeContext", "CodeContext"),
            Twin("handles.AsyncProcess", "Process", base="ProcessAttach"),
            Twin("handles.AsyncKeptRun", "KeptRun"),
        ),
    ),
    Output(
        "runs_sync.py",
        """Kept runs from the blocking client: the functions of :mod:`guestd.client.runs` on the
:class:`~guestd.client.sync.Client`'s loop; ``Client.run_get`` / ``run_wait`` / ``run_list``
fetch the result, :func:`~guestd.client.runs.result_of` types it::

    rid = start_kept(client, "code.run", {"code": "import time; time.sleep(3); 42"})
    ...  # disconnect, reconnect
    print(result_of(client2.run_wait(rid, timeout_s=30)).text)  # '42'
""",
        (Functions("runs"),),
        (("runs", "result_of"),),
    ),
    Output(
        "_surface.py",
        """The asyncio client as the objects that hold it use it: for each, a protocol of exactly the
:class:`~guestd.client.AsyncClient` members it uses, with their signatures (defaults as ``...``).

A handle (``AsyncShell``, ...) and ``AsyncGit`` keep the client that made them as one of these,
so :mod:`guestd.client.handles` and :mod:`guestd.client.git`, which the client imports, do not
import it back (``tests/test_import_cycles.py``); mypy holds the client to each protocol where it
makes the handle. A member is listed because a holder uses it: adding a call to a handle and
running the generator adds it here.
""",
        (Protocols("aio.AsyncClient", ("handles", "git")),),
    ),
    Output(
        "_surface_sync.py",
        """The blocking client as the objects that hold it use it: for each, a protocol of exactly the
:class:`~guestd.client.Client` members it uses, with the generated ``Client``'s signatures
(defaults as ``...``).

The blocking handles (:mod:`guestd.client.handles_sync`) and the hand-written bases
(:mod:`guestd.client._blocking`) keep the client as one of these, so nothing below
:mod:`guestd.client.sync` imports it (``tests/test_import_cycles.py``); mypy holds ``Client``
to each protocol where it makes the handle.
""",
        (Protocols("aio.AsyncClient", (HAND_WRITTEN,), blocking=True),),
    ),
)

# Async names and their blocking twins, in code and in docstrings (besides the classes above).
TWIN_NAMES = {
    "AsyncHandle": "ClosedOnExit",  # the blocking client's own (_blocking.py): close() on exit
    "PortForward": "PortForwarder",
    "ReverseForward": "ReverseForwarder",
    "__aenter__": "__enter__",
    "__aexit__": "__exit__",
}
# A coroutine that returns one of these returns its blocking twin, made from the client and
# this expression of the async result (a handle keeps the create call's reply), and says so.
WRAPS = {
    "AsyncShell": ("{}.info", None),
    "AsyncCodeContext": ("{}.info", None),
    "AsyncProcess": ("{}.info", None),
    "PortForward": ("{}", "Use it as a context manager: leaving ``with`` stops the forward."),
    "ReverseForward": ("{}", "Use it as a context manager: leaving ``with`` stops the forward."),
}
MADE = "made"  # the generated code's local for what a wrapped coroutine returned
PUMP = "pump"  # and for the CallerThread its callbacks go through
MAKE = "make"  # a mirrored constructor's coroutine that makes the async object on the loop
ASYNC_CLIENT = "AsyncClient"  # what a mirrored constructor takes first (the blocking Client there)
# Parameters of these types are callbacks: the blocking twin runs them in the calling thread.
CALLBACK_TYPES = {"OutputCallback", "EventCallback"}
CALLBACK_NOTE = "The callbacks run in this (the calling) thread."
# Coroutines with no blocking twin, and why.
ASYNC_ONLY = {"open_port": "an asyncio (reader, writer) pair has no blocking twin"}
BLOCKING_PROTOCOL = "Sync{}"  # the name of a protocol of the blocking client, from the async one's


class GenerationError(Exception):
    pass


_LOADED: dict[tuple[str, int, int], Source] = {}  # parsed sources, by name and version


# -- reading the async sources -----------------------------------------------------------------
@dataclass
class Source:
    module: str  # dotted
    text: str
    tree: ast.Module

    def __post_init__(self) -> None:
        self.source_lines = re.split(r"(?<=\n)", self.text)  # as the parser counts them (not \f)

    @classmethod
    def load(cls, name: str) -> Source:
        path = CLIENT_DIR / f"{name}.py"
        stat = path.stat()
        key = (name, stat.st_mtime_ns, stat.st_size)
        if key not in _LOADED:
            text = path.read_text()
            _LOADED[key] = cls(f"{PACKAGE}.{name}", text, ast.parse(text))
        return _LOADED[key]

    def cls(self, name: str) -> ast.ClassDef:
        for node in self.tree.body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return node
        raise GenerationError(f"{self.module} has no class {name}")

    def lines(self, node: ast.stmt) -> str:
        """The statement's source lines, decorators included, as written (comments kept)."""
        first = min([d.lineno for d in getattr(node, "decorator_list", [])] + [node.lineno])
        assert node.end_lineno is not None
        return "".join(self.source_lines[first - 1 : node.end_lineno])

    def segment(self, node: ast.expr | ast.stmt) -> str:
        """The node's source text (ast.get_source_segment, without its cost per call)."""
        assert node.end_lineno is not None and node.end_col_offset is not None
        lines = [line.encode() for line in self.source_lines[node.lineno - 1 : node.end_lineno]]
        lines[-1] = lines[-1][: node.end_col_offset]  # offsets count UTF-8 bytes
        lines[0] = lines[0][node.col_offset :]
        return b"".join(lines).decode()

    def comments_before(self, node: ast.stmt, after: int) -> list[str]:
        """Comment lines between line ``after`` and the statement (its decorators included)."""
        first = min([d.lineno for d in getattr(node, "decorator_list", [])] + [node.lineno])
        lines = self.source_lines[after : first - 1]
        return [line.rstrip("\n") for line in lines if line.strip().startswith("#")]

    def scope(self) -> dict[str, tuple[str, str | None]]:
        """Module-level names -> (module, name) to import them from (name None: ``import module``)."""
        out: dict[str, tuple[str, str | None]] = {}
        for node in _module_statements(self.tree):
            if isinstance(node, ast.ImportFrom) and node.module is not None:
                for alias in node.names:
                    out[alias.asname or alias.name] = (node.module, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname is None and "." not in alias.name:
                        out[alias.name] = (alias.name, None)
            elif isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                out[node.name] = (self.module, node.name)
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name):
                        out[target.id] = (self.module, target.id)
        return out


def _module_statements(tree: ast.Module) -> Iterator[ast.stmt]:
    """Top-level statements, and those of ``if TYPE_CHECKING:`` blocks."""
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            yield from node.body
        else:
            yield node


def _decorators(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    return {d.id for d in fn.decorator_list if isinstance(d, ast.Name)}


def _is_async_generator(fn: ast.AsyncFunctionDef) -> bool:
    """Whether ``fn`` yields (not counting functions defined inside it)."""
    todo: list[ast.AST] = list(fn.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Yield | ast.YieldFrom):
            return True
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            todo.extend(ast.iter_child_nodes(node))
    return False


def _names(node: ast.AST | None) -> set[str]:
    return set() if node is None else {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _docstring(fn: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> ast.Expr | None:
    first = fn.body[0] if fn.body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first
    return None


# -- names: async -> blocking ------------------------------------------------------------------
def blocking_names() -> dict[str, str]:
    """Every async class with a blocking twin -> the twin's name (a protocol of the async client
    ``XClient`` -> ``SyncXClient``, of the blocking one)."""
    out = dict(TWIN_NAMES)
    for output in OUTPUTS:
        for part in output.parts:
            if isinstance(part, Facade | Twin):
                out[part.source.split(".")[1]] = part.name
    out.update({name: BLOCKING_PROTOCOL.format(name) for name in async_protocol_names()})
    return out


class _Rename(ast.NodeTransformer):
    def __init__(self, names: dict[str, str]) -> None:
        self.names = names

    def visit_Name(self, node: ast.Name) -> ast.Name:
        return ast.Name(self.names.get(node.id, node.id), node.ctx)


def rename_in_text(text: str, names: dict[str, str]) -> str:
    """Docstrings and other strings: the async classes' names and ``async with`` mapped."""
    text = text.replace("``async with``", "``with``")
    doc_names = {a: b for a, b in names.items() if a.startswith("Async")}
    if not doc_names:
        return text
    return re.sub(r"\b(" + "|".join(map(re.escape, doc_names)) + r")\b", lambda m: doc_names[m.group(1)], text)


def unasync(text: str, names: dict[str, str]) -> str:
    """Statements of async source rewritten as blocking ones: ``async`` and ``await`` dropped,
    the async names mapped in code and in strings; everything else (comments, layout) kept."""
    starts = [0]
    for line in re.split(r"(?<=\n)", text):
        starts.append(starts[-1] + len(line))
    string_parts = {tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    out: list[str] = []
    last = 0
    drop_space = False
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        begin = starts[tok.start[0] - 1] + tok.start[1]
        gap = text[last:begin]
        out.append(gap.lstrip(" ") if drop_space else gap)
        drop_space = False
        if tok.type == tokenize.NAME and tok.string in ("async", "await"):
            drop_space = True
        elif tok.type == tokenize.NAME:
            out.append(names.get(tok.string, tok.string))
        elif tok.type in string_parts:
            out.append(rename_in_text(tok.string, names))
        else:
            out.append(tok.string)
        last = starts[tok.end[0] - 1] + tok.end[1]
    out.append(text[last:])
    return "".join(out)


# -- writing -----------------------------------------------------------------------------------
@dataclass
class Module:
    """What one output file is built from: its code, and the names it must import."""

    path: str
    lines: list[str]
    runtime: set[str]  # names used at run time or in annotations
    defined: set[str]  # names this file defines

    def add(self, text: str) -> None:
        self.lines.append(text)


def hand_written_bases() -> dict[str, set[str]]:
    """The classes of _blocking.py -> the names each defines, its bases' (there) included."""
    tree = Source.load(HAND_WRITTEN).tree
    own: dict[str, set[str]] = {}
    bases: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            own[node.name] = {n.name for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)} | {
                n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
            }
            bases[node.name] = [b.id for b in node.bases if isinstance(b, ast.Name)]

    def defined(name: str) -> set[str]:
        return own[name].union(*(defined(b) for b in bases[name] if b in own))

    return {name: defined(name) for name in own}


def _hand_written_names() -> set[str]:
    tree = Source.load(HAND_WRITTEN).tree
    out = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef):
            out.add(node.name)
        elif isinstance(node, ast.Assign):
            out |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return out


def _call_arguments(fn: ast.FunctionDef | ast.AsyncFunctionDef, skip: int, callbacks: set[str]) -> str:
    """The parameters of ``fn`` passed on as they came (the first ``skip`` left out)."""

    def value(name: str) -> str:
        return f"{PUMP}.wrap({name})" if name in callbacks else name

    a = fn.args
    parts = [value(p.arg) for p in (a.posonlyargs + a.args)[skip:]]
    if a.vararg is not None:
        parts.append(f"*{a.vararg.arg}")
    parts += [f"{p.arg}={value(p.arg)}" for p in a.kwonlyargs]
    if a.kwarg is not None:
        parts.append(f"**{a.kwarg.arg}")
    return ", ".join(parts)


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.arg]:
    a = fn.args
    return [*a.posonlyargs, *a.args, *([a.vararg] if a.vararg else []), *a.kwonlyargs, *([a.kwarg] if a.kwarg else [])]


def _callbacks(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    return {p.arg for p in _params(fn) if _names(p.annotation) & CALLBACK_TYPES}


def _signature(fn: ast.FunctionDef | ast.AsyncFunctionDef, names: dict[str, str]) -> tuple[str, set[str]]:
    """``def name(params) -> returns:`` with the async names mapped; and the names it uses."""
    params = _Rename(names).visit(copy.deepcopy(fn.args))
    returns = None if fn.returns is None else _Rename(names).visit(copy.deepcopy(fn.returns))
    text = f"def {fn.name}({ast.unparse(params)})"
    if returns is not None:
        text += f" -> {ast.unparse(returns)}"
    used = _names(params) | _names(returns) | {n for d in fn.decorator_list for n in _names(d)}
    return text + ":", used


class FacadeWriter:
    """One facade class: a blocking method for each public coroutine of the async class."""

    def __init__(self, spec: Facade, module: Module, names: dict[str, str], bases: dict[str, set[str]]) -> None:
        self.spec = spec
        self.module = module
        self.names = names
        src_module, cls_name = spec.source.split(".")
        self.source = Source.load(src_module)
        self.cls = self.source.cls(cls_name)
        if spec.base not in bases:
            raise GenerationError(f"{spec.name}: no class {spec.base} in {HAND_WRITTEN}.py")
        self.hand_written = bases[spec.base]
        self.overloaded: set[str] = set()

    def write(self) -> None:
        twins = [self.names.get(b.id, "") if isinstance(b, ast.Name) else "" for b in self.cls.bases]
        if not all(twins):
            raise GenerationError(f"{self.spec.source}: a base without a blocking twin (give it a Facade)")
        self.module.runtime |= {*twins, self.spec.base}
        self.module.defined.add(self.spec.name)
        m = self.module
        m.add(f"class {self.spec.name}({', '.join([*twins, self.spec.base])}):")
        m.add(f'    """{self.spec.doc}"""')
        m.add("")
        pending: list[str] = []
        after = self.cls.lineno
        for node in self.cls.body:
            pending += self.source.comments_before(node, after)
            after = node.end_lineno or after
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                pending = []  # a class attribute's comments, or none
                continue
            text = self.member(node)
            if text is None:
                continue
            m.lines += pending
            pending = []
            m.add(text)
        m.add("")

    def member(self, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
        """The blocking twin of one member, or None for a member that has none."""
        decorators = _decorators(fn)
        if fn.name.startswith("_") or fn.name in self.hand_written:
            return None
        if decorators & {"classmethod", "staticmethod"}:
            return self.constructor(fn) if self._is_constructor(fn) else None
        if isinstance(fn, ast.FunctionDef):
            # A plain method or property that makes an async twin (``kept_run``, ``git``): copied.
            if not _names(fn.returns) & set(self.names):
                return None  # a stream (async only) or a plain value of the async client
            text = unasync(self.source.lines(fn), self.names)
            self.use(_free_names(text))
            return text
        if _is_async_generator(fn) or fn.name in ASYNC_ONLY:
            return None
        if decorators - {"overload"}:
            raise GenerationError(f"{self.spec.source}.{fn.name}: decorators {decorators} are not mirrored")
        return self.coroutine(fn)

    def _is_constructor(self, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
        """A class method that makes the async class from the async client (``Expect.start``)."""
        params = fn.args.posonlyargs + fn.args.args
        return (
            isinstance(fn, ast.FunctionDef)
            and _decorators(fn) == {"classmethod"}
            and len(params) > 1
            and isinstance(params[1].annotation, ast.Name)
            and params[1].annotation.id == ASYNC_CLIENT
            and isinstance(fn.returns, ast.Name)
            and fn.returns.id == self.cls.name
        )

    def constructor(self, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
        """``cls(client, <the async class made on the client's loop>)``: made there, since what it
        starts (``Expect``'s reader task) runs on that loop."""
        where = f"{self.spec.source}.{fn.name}"
        if _callbacks(fn):
            raise GenerationError(f"{where}: a constructor with callbacks is not mirrored")
        taken = {p.arg for p in _params(fn)} & {MAKE}
        if taken:
            raise GenerationError(f"{where}: a parameter is named {MAKE}, a generated local")
        facade = copy.copy(fn)
        facade.returns = ast.Name(self.spec.name, ast.Load())  # the async class made -> the facade around it
        signature, used = _signature(facade, self.names)
        client = (fn.args.posonlyargs + fn.args.args)[1].arg
        self.use(used | {self.cls.name})
        lines = ["    @classmethod", f"    {signature}"]
        lines += _docstring_lines(self.source, fn, self.names, [], "        ")
        call = f"{self.cls.name}.{fn.name}({client}.aio, {_call_arguments(fn, 2, set())})"
        lines += [
            "",
            f"        async def {MAKE}() -> {self.cls.name}:",
            f"            return {call}",
            "",
            f"        return cls({client}, {client}._run({MAKE}()))",
        ]
        return "\n".join([*lines, ""])

    def coroutine(self, fn: ast.AsyncFunctionDef) -> str:
        where = f"{self.spec.source}.{fn.name}"
        signature, used = _signature(fn, self.names)
        self.use(used)
        lines = [f"    @{d}" for d in sorted(_decorators(fn))] + [f"    {signature}"]
        if "overload" in _decorators(fn):
            self.overloaded.add(fn.name)
            return "\n".join([*lines, "        ...", ""])
        callbacks = _callbacks(fn)
        returns = _names(fn.returns)
        wrap = next((WRAPS[n] for n in returns if n in WRAPS), None)
        if returns & set(self.names) and (wrap is None or not isinstance(fn.returns, ast.Name)):
            raise GenerationError(f"{where}: returns an async twin; say how to wrap it in WRAPS")
        notes = [n for n in (CALLBACK_NOTE if callbacks else None, wrap[1] if wrap else None) if n]
        lines += _docstring_lines(self.source, fn, self.names, notes, "        ")
        _check_locals(fn, where)
        if callbacks:
            if self.spec.loop is None:
                raise GenerationError(f"{where}: callbacks, but {self.spec.name} has no loop to hand them over from")
            self.use({"CallerThread"})
            lines.append(f"        {PUMP} = CallerThread({self.spec.loop})")
        delegate = _overload_delegate(fn) if fn.name in self.overloaded else fn.name
        call = f"{self.spec.target}.{delegate}({_call_arguments(fn, 1, callbacks)})"
        if delegate == fn.name and fn.name in self.overloaded:
            # The overloads' results, one coroutine per overload matched: as one coroutine of
            # the implementation's result, which the runner then returns.
            assert fn.returns is not None
            self.use({"Coroutine", "Any"})
            lines.append(f"        {MADE}: Coroutine[Any, Any, {ast.unparse(fn.returns)}] = {call}")
            call = MADE
        run = f"{self.spec.runner}({call}{', ' + PUMP if callbacks else ''})"
        if isinstance(fn.returns, ast.Constant) and fn.returns.value is None:
            lines.append(f"        {run}")
        elif wrap is not None:
            assert isinstance(fn.returns, ast.Name)
            twin = self.names[fn.returns.id]
            self.use({twin})
            lines.append(f"        {MADE} = {run}")
            lines.append(f"        return {twin}(self, {wrap[0].format(MADE)})")
        else:
            lines.append(f"        return {run}")
        return "\n".join([*lines, ""])

    def use(self, names: set[str]) -> None:
        self.module.runtime |= names


def _docstring_lines(
    source: Source, fn: ast.FunctionDef | ast.AsyncFunctionDef, names: dict[str, str], notes: list[str], indent: str
) -> list[str]:
    """The async docstring for the blocking twin (names mapped), ``notes`` added at its end."""
    doc = _docstring(fn)
    if doc is None:
        return [f'{indent}"""{" ".join(notes)}"""'] if notes else []
    text = rename_in_text(source.segment(doc), names)
    for note in notes:
        text = f'{text[:-3].rstrip()}\n\n{indent}{note}\n{indent}"""'
    return [indent + text]


def _check_locals(fn: ast.FunctionDef | ast.AsyncFunctionDef, where: str) -> None:
    """The generated body's own locals must not hide a parameter."""
    taken = {p.arg for p in _params(fn)} & {MADE, PUMP}
    if taken:
        raise GenerationError(f"{where}: a parameter is named {', '.join(sorted(taken))}, a generated local")


def _overload_delegate(fn: ast.AsyncFunctionDef) -> str:
    """The coroutine the blocking twin of an overloaded ``fn`` runs, passing on its
    implementation's arguments: ``fn`` itself, which the type checker matches to the overloads
    one union at a time (``dst: str | None`` -> the ``None`` and the ``str`` overloads); or,
    where no overload takes some mix of the arguments (``download``'s ``dst`` and ``sink``), the
    private implementation ``fn``'s body hands over to (``return await self._download(...)``),
    which takes them as they are."""
    body = fn.body[1:] if _docstring(fn) is not None else fn.body
    if len(body) == 1 and isinstance(body[0], ast.Return) and isinstance(body[0].value, ast.Await):
        call = body[0].value.value
        if (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute)
            and isinstance(call.func.value, ast.Name)
            and call.func.value.id == "self"
            and call.func.attr.startswith("_")
        ):
            return call.func.attr
    return fn.name


def _free_names(text: str) -> set[str]:
    """Names ``text`` (whole statements) reads that it does not bind itself."""
    tree = ast.parse(textwrap.dedent(text))
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - bound


def write_twin(spec: Twin, module: Module, names: dict[str, str], bases: dict[str, set[str]]) -> None:
    src_module, cls_name = spec.source.split(".")
    source = Source.load(src_module)
    cls = source.cls(cls_name)
    twin_bases = [names.get(b.id, "") if isinstance(b, ast.Name) else "" for b in cls.bases]
    if not all(twin_bases):
        raise GenerationError(f"{spec.source}: a twin's bases must have twins (a Twin before it, or TWIN_NAMES)")
    skip = bases[spec.base] if spec.base is not None else set()
    all_bases = [*twin_bases, *([spec.base] if spec.base else [])]
    out = [f"class {spec.name}({', '.join(all_bases)}):" if all_bases else f"class {spec.name}:"]
    doc = _docstring(cls)
    after = (doc.end_lineno or 0) if doc is not None else cls.lineno
    if doc is not None:
        out.append("    " + rename_in_text(source.segment(doc), names))
        out.append("")
    for node in cls.body[1 if doc is not None else 0 :]:
        comments = source.comments_before(node, after)
        after = node.end_lineno or after
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name in skip:
            continue
        out += comments
        out.append(unasync(source.lines(node), names))
    text = "\n".join(out) + "\n"
    module.lines.append(text)
    module.defined.add(spec.name)
    module.runtime |= _free_names(text) | set(all_bases)


def write_functions(spec: Functions, module: Module, names: dict[str, str]) -> None:
    source = Source.load(spec.module)
    module.runtime.add(spec.module)
    for node in source.tree.body:
        if not isinstance(node, ast.AsyncFunctionDef) or node.name.startswith("_") or _is_async_generator(node):
            continue
        params = node.args.posonlyargs + node.args.args
        first = params[0] if params else None
        if first is None or _names(first.annotation) != {"AsyncClient"}:
            continue
        client = first.arg
        where = f"{source.module}.{node.name}"
        signature, used = _signature(node, names)
        module.runtime |= used
        callbacks = _callbacks(node)
        lines = [signature, *_docstring_lines(source, node, names, [CALLBACK_NOTE] if callbacks else [], "    ")]
        _check_locals(node, where)
        if callbacks:
            module.runtime.add("CallerThread")
            lines.append(f"    {PUMP} = CallerThread({client}._loop)")
        rest = _call_arguments(node, 1, callbacks)
        call = f"{spec.module}.{node.name}({client}.aio{', ' + rest if rest else ''})"
        run = f"{client}._run({call}{', ' + PUMP if callbacks else ''})"
        none = isinstance(node.returns, ast.Constant) and node.returns.value is None
        if _names(node.returns) & set(names):
            raise GenerationError(f"{where}: returns an async twin")
        lines.append(f"    {run}" if none else f"    return {run}")
        module.defined.add(node.name)
        module.add("\n".join(lines) + "\n\n")


# -- protocols: the client as its holders use it ---------------------------------------------
def _protocols_part(blocking: bool) -> tuple[Output, Protocols]:
    for output in OUTPUTS:
        for part in output.parts:
            if isinstance(part, Protocols) and part.blocking == blocking:
                return output, part
    raise GenerationError(f"no {'blocking' if blocking else 'async'} Protocols in OUTPUTS")


def _protocols_module(blocking: bool) -> str:
    return f"{PACKAGE}.{_protocols_part(blocking)[0].path.removesuffix('.py')}"


def async_protocol_names() -> set[str]:
    """The protocols the async holders name (what they import from the async protocols' module)."""
    module = _protocols_module(blocking=False)
    holders = _protocols_part(blocking=False)[1].holders
    return {name for h in holders for name, (where, _) in Source.load(h).scope().items() if where == module}


def blocking_protocol_names() -> set[str]:
    return {BLOCKING_PROTOCOL.format(name) for name in async_protocol_names()}


def _twins() -> list[tuple[Twin, str]]:
    """Every twin, with the module (under guestd/client) it is written to."""
    return [
        (part, output.path.removesuffix(".py")) for output in OUTPUTS for part in output.parts if isinstance(part, Twin)
    ]


def _is_self_attribute(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"


def holder_uses(
    node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef, protocols: set[str], skip: set[str]
) -> dict[str, set[str]]:
    """What ``node`` (a class, or a function) uses of the client it holds as one of ``protocols``:
    protocol -> the names of the members used (an empty set: held, nothing used). The client is a
    parameter annotated with the protocol, or an attribute of ``self`` that ``__init__`` stores such
    a parameter in or the class body annotates with it; a use is an attribute of it
    (``self.client.shell_run``). The methods in ``skip`` are left out."""

    def held_params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> dict[str, str]:
        return {
            p.arg: p.annotation.id
            for p in _params(fn)
            if isinstance(p.annotation, ast.Name) and p.annotation.id in protocols
        }

    if isinstance(node, ast.ClassDef):
        functions = [
            n for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name not in skip
        ]
        held = {
            n.target.id: n.annotation.id
            for n in node.body
            if isinstance(n, ast.AnnAssign)
            and isinstance(n.target, ast.Name)
            and isinstance(n.annotation, ast.Name)
            and n.annotation.id in protocols
        }
        for fn in functions:
            params = held_params(fn) if fn.name == "__init__" else {}
            for n in ast.walk(fn):
                if isinstance(n, ast.Assign) and isinstance(n.value, ast.Name) and n.value.id in params:
                    stored = [t.attr for t in n.targets if isinstance(t, ast.Attribute) and _is_self_attribute(t)]
                    held.update(dict.fromkeys(stored, params[n.value.id]))
    else:
        functions, held = [node], {}
    found: dict[str, set[str]] = {protocol: set() for protocol in held.values()}
    for fn in functions:
        params = held_params(fn)
        for protocol in params.values():
            found.setdefault(protocol, set())
        for n in ast.walk(fn):
            if not isinstance(n, ast.Attribute):
                continue
            if isinstance(n.value, ast.Name) and n.value.id in params:
                found[params[n.value.id]].add(n.attr)
            elif isinstance(n.value, ast.Attribute) and _is_self_attribute(n.value) and n.value.attr in held:
                found[held[n.value.attr]].add(n.attr)
    return found


@dataclass
class ProtocolUses:
    """One protocol to write: the members its holders use, and the holders (for its docstring)."""

    members: set[str]
    holders: list[str]  # Sphinx references to them


def _add_uses(
    out: dict[str, ProtocolUses], found: dict[str, set[str]], reference: str, rename: dict[str, str] | None = None
) -> None:
    for protocol, members in found.items():
        uses = out.setdefault(rename[protocol] if rename else protocol, ProtocolUses(set(), []))
        uses.members |= members
        uses.holders.append(reference)


def _holders_in(module: str, protocols: set[str], out: dict[str, ProtocolUses]) -> None:
    """The uses of every class and function of ``module`` (under guestd/client) holding the client."""
    source = Source.load(module)
    for node in source.tree.body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            role = "class" if isinstance(node, ast.ClassDef) else "func"
            _add_uses(out, holder_uses(node, protocols, set()), f":{role}:`~{source.module}.{node.name}`")


def protocol_uses(part: Protocols) -> dict[str, ProtocolUses]:
    """Each protocol of ``part`` -> what its holders use of the client."""
    out: dict[str, ProtocolUses] = {}
    if not part.blocking:
        for module in part.holders:
            _holders_in(module, async_protocol_names(), out)
        return out
    # The blocking twins: the async holder's uses, renamed, less what the hand-written base replaces.
    names = blocking_names()
    bases = hand_written_bases()
    for twin, stem in _twins():
        src_module, cls_name = twin.source.split(".")
        skip = bases[twin.base] if twin.base is not None else set()
        found = holder_uses(Source.load(src_module).cls(cls_name), async_protocol_names(), skip)
        _add_uses(out, found, f":class:`~{PACKAGE}.{stem}.{twin.name}`", names)
    for module in part.holders:
        _holders_in(module, blocking_protocol_names(), out)
    return out


@dataclass
class ClientClass:
    """A class whose members a protocol may copy: its definition, where its names come from."""

    cls: ast.ClassDef
    where: dict[str, tuple[str, str | None]]


def _async_client_classes(qualified: str) -> list[ClientClass]:
    """``module.Class`` and its bases that are classes of guestd.client, as members are looked up."""
    module, name = qualified.split(".")
    source = Source.load(module)
    cls = source.cls(name)
    out = [ClientClass(cls, source.scope())]
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id in out[0].where:
            where, attr = out[0].where[base.id]
            if where.startswith(f"{PACKAGE}.") and attr is not None:
                out += _async_client_classes(f"{where.removeprefix(PACKAGE + '.')}.{attr}")
    return out


def _blocking_client_classes(client: str) -> list[ClientClass]:
    """The generated blocking client of the async ``client`` (its class as the generator writes it)
    and its bases: the other facades, and the hand-written ones."""
    facades = {part.name: (part, output) for output in OUTPUTS for part in output.parts if isinstance(part, Facade)}
    hand_written = Source.load(HAND_WRITTEN)
    names, bases = blocking_names(), hand_written_bases()
    todo = [next(name for name, (part, _) in facades.items() if part.source == client)]
    seen = set()
    out = []
    while todo:
        name = todo.pop(0)
        if name in seen:
            continue
        seen.add(name)
        if name in facades:
            spec, output = facades[name]
            module = Module(output.path, [], set(), set())
            FacadeWriter(spec, module, names, bases).write()
            cls = ast.parse("\n".join(module.lines)).body[0]
            assert isinstance(cls, ast.ClassDef)
            out.append(ClientClass(cls, _where(output)))
        elif name in bases:
            cls = hand_written.cls(name)
            out.append(ClientClass(cls, hand_written.scope()))
        else:
            continue
        todo += [b.id for b in cls.bases if isinstance(b, ast.Name)]
    return out


def _stub(fns: list[ast.FunctionDef | ast.AsyncFunctionDef], where: str) -> tuple[list[str], set[str]]:
    """A protocol's member for a method (its overloads, if it has any): the signature, defaults as
    ``...``, no body; and the names it uses."""
    overloads = [fn for fn in fns if "overload" in _decorators(fn)]
    lines: list[str] = []
    used: set[str] = set()
    for fn in overloads or fns[:1]:  # the overloads, not their implementation; a property's getter
        decorators = _decorators(fn)
        if len(decorators) != len(fn.decorator_list) or decorators - {"property", "overload"}:
            raise GenerationError(f"{where}: a protocol copies plain methods, properties and overloads only")
        args = copy.deepcopy(fn.args)
        args.defaults = [ast.Constant(...) for _ in args.defaults]
        args.kw_defaults = [None if d is None else ast.Constant(...) for d in args.kw_defaults]
        keyword = "async def" if isinstance(fn, ast.AsyncFunctionDef) else "def"
        returns = "" if fn.returns is None else f" -> {ast.unparse(fn.returns)}"
        lines += [f"    @{d}" for d in sorted(decorators)]
        lines.append(f"    {keyword} {fn.name}({ast.unparse(args)}){returns}: ...")
        used |= _names(args) | _names(fn.returns) | decorators - {"property"}
    return lines, used


def _methods(cls: ast.ClassDef, name: str) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """The definitions of method ``name`` in ``cls`` (more than one: its overloads)."""
    return [n for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name]


def _protocol_imports(imports: dict[str, tuple[str, str | None]]) -> list[str]:
    """``Protocol`` (and ``overload``) at run time; the names the signatures use for the type
    checker only (they are annotations)."""
    runtime = sorted(n for n in imports if n in ("Protocol", "overload"))
    lines = [f"from typing import {', '.join(['TYPE_CHECKING', *runtime])}", ""]
    later: dict[str, set[str]] = {}
    for name, (module, attr) in imports.items():
        if name not in runtime:
            later.setdefault(module, set()).add("" if attr is None else name if attr == name else f"{attr} as {name}")
    if later:
        lines.append("if TYPE_CHECKING:")
    for module, taken in sorted(later.items()):
        if "" in taken:
            lines.append(f"    import {module}")
        if taken - {""}:
            lines.append(f"    from {module} import {', '.join(sorted(taken - {''}))}")
    return lines


def render_protocols(output: Output, part: Protocols) -> str:
    """The protocols file: a class for each protocol, its members in the order the client has them."""
    if part.blocking:
        classes, client = _blocking_client_classes(part.client), ":class:`~guestd.client.Client`"
    else:
        classes, client = _async_client_classes(part.client), ":class:`~guestd.client.AsyncClient`"
    # What the protocols may not import: a module that imports them would make a cycle.
    refused = {f"{PACKAGE}.{o.path.removesuffix('.py')}" for o in OUTPUTS} | {f"{PACKAGE}.{h}" for h in part.holders}
    if not part.blocking:
        refused.add(f"{PACKAGE}.{part.client.split('.')[0]}")
    imports: dict[str, tuple[str, str | None]] = {"Protocol": ("typing", "Protocol")}
    body = []
    for protocol, uses in sorted(protocol_uses(part).items()):
        holders = " and ".join(uses.holders)
        found = []
        for member in uses.members:
            at = next(((rank, c) for rank, c in enumerate(classes) if _methods(c.cls, member)), None)
            if at is None:
                raise GenerationError(
                    f"{protocol}: {holders} use {member!r}, which {client} has as no method or property"
                    " (what a protocol copies)"
                )
            fns = _methods(at[1].cls, member)
            found.append((at[0], fns[0].lineno, member, fns, at[1]))
        verb = "uses" if len(uses.holders) == 1 else "use"
        doc = f'"""The {client} as {holders} {verb} it."""'
        body += [
            "",
            "",
            f"class {protocol}(Protocol):",
            *textwrap.wrap(doc, LINE_LENGTH, initial_indent="    ", subsequent_indent="    "),
        ]
        for _, _, member, fns, c in sorted(found, key=lambda f: f[:2]):
            where = f"{c.cls.name}.{member}"
            lines, used = _stub(fns, where)
            body += ["", *lines]
            for name in sorted(used):
                if name not in c.where:
                    if hasattr(builtins, name):
                        continue
                    raise GenerationError(f"{where}: no import known for {name!r}")
                origin = c.where[name]
                if origin[0] in refused:
                    raise GenerationError(
                        f"{where} names {name} from {origin[0]}, which needs {output.path} (an import cycle):"
                        " move it to a module below both (as guestd/client/params.py)"
                    )
                if imports.setdefault(name, origin) != origin:
                    raise GenerationError(f"{output.path}: {name} would come from {imports[name][0]} and {origin[0]}")
    return "\n".join([*_head(output), *_protocol_imports(imports), *body]).rstrip() + "\n"


# -- imports and formatting -------------------------------------------------------------------
def _source_module(part: Facade | Twin | Functions | Protocols) -> str:
    """The async module (under guestd/client) a part is written from."""
    if isinstance(part, Functions):
        return part.module
    if isinstance(part, Protocols):
        return part.client.split(".")[0]
    return part.source.split(".")[0]


def _sources_scope() -> dict[str, tuple[str, str | None]]:
    """Where each name the async sources use comes from (first definition wins)."""
    out: dict[str, tuple[str, str | None]] = {}
    seen = set()
    for output in OUTPUTS:
        for part in output.parts:
            name = _source_module(part)
            if name not in seen:
                seen.add(name)
                for key, value in Source.load(name).scope().items():
                    out.setdefault(key, value)
    return out


def _where(output: Output) -> dict[str, tuple[str, str | None]]:
    """Where each name the output's generated code uses is imported from."""
    where = _sources_scope()
    for part in output.parts:  # where two sources have a name, this file's own source says where from
        where.update(Source.load(_source_module(part)).scope())
    for out in OUTPUTS:
        stem = out.path.removesuffix(".py")
        for part in out.parts:
            if isinstance(part, Facade | Twin):
                where[part.name] = (f"{PACKAGE}.{stem}", part.name)
    where.update({name: (f"{PACKAGE}.{HAND_WRITTEN}", name) for name in _hand_written_names()})
    blocking_surface = _protocols_module(blocking=True)
    where.update({name: (blocking_surface, name) for name in blocking_protocol_names()})
    for part in output.parts:
        if isinstance(part, Functions):
            where[part.module] = (PACKAGE, part.module)
    for source, name in output.reexports:
        where[name] = (f"{PACKAGE}.{source}", name)
    return where


def _import_lines(module: Module, where: dict[str, tuple[str, str | None]], own: str) -> list[str]:
    runtime: dict[str, set[str]] = {}
    type_only: dict[str, set[str]] = {}
    plain: set[str] = set()
    for name in sorted(module.runtime - module.defined):
        if name in where:
            source, attr = where[name]
        elif hasattr(builtins, name):
            continue
        else:
            raise GenerationError(f"{module.path}: no import known for {name!r}")
        if attr is None:
            plain.add(source)
        elif source == f"{PACKAGE}.sync" and own != "sync":
            type_only.setdefault(source, set()).add(name if attr == name else f"{attr} as {name}")
        else:
            runtime.setdefault(source, set()).add(name if attr == name else f"{attr} as {name}")
    lines = [f"import {m}" for m in sorted(plain)]
    if type_only:
        runtime.setdefault("typing", set()).add("TYPE_CHECKING")
    lines += [f"from {m} import {', '.join(sorted(n))}" for m, n in sorted(runtime.items())]
    if type_only:
        lines += ["", "if TYPE_CHECKING:"]
        lines += [f"    from {m} import {', '.join(sorted(n))}" for m, n in sorted(type_only.items())]
    return lines


def _source_paths(output: Output) -> list[str]:
    stems = []
    for part in output.parts:
        stems.append(_source_module(part))
        if isinstance(part, Protocols):
            stems += part.holders
            if part.blocking:
                stems += [_source_module(twin) for twin, _ in _twins()]
    return [f"guestd/client/{stem}.py" for stem in dict.fromkeys(stems)]


def _all_order(name: str) -> tuple[int, str]:
    """ruff's order for ``__all__`` (RUF022): constants, classes, the rest."""
    return (0 if name.isupper() else 1 if name[0].isupper() else 2, name)


def _head(output: Output) -> list[str]:
    """The generated file's first lines: where it comes from, its docstring, future annotations."""
    doc = output.doc.rstrip()
    origin = f"Generated by `{COMMAND}` from {', '.join(_source_paths(output))}: do not edit."
    return [
        *textwrap.wrap(origin, LINE_LENGTH, initial_indent="# ", subsequent_indent="# ", break_on_hyphens=False),
        f'"""{doc}\n"""' if "\n" in doc else f'"""{doc}"""',
        "",
        "from __future__ import annotations",
        "",
    ]


def render_raw(output: Output) -> str:
    """One output file before ruff has sorted its imports and formatted it."""
    protocols = [part for part in output.parts if isinstance(part, Protocols)]
    if protocols:
        if len(output.parts) != 1:
            raise GenerationError(f"{output.path}: protocols are a file of their own")
        return render_protocols(output, protocols[0])
    names = blocking_names()
    bases = hand_written_bases()
    module = Module(output.path, [], set(), set())
    for part in output.parts:
        if isinstance(part, Facade):
            FacadeWriter(part, module, names, bases).write()
        elif isinstance(part, Twin):
            write_twin(part, module, names, bases)
        elif isinstance(part, Functions):
            write_functions(part, module, names)
    where = _where(output)
    module.runtime |= {name for _, name in output.reexports}
    stem = output.path.removesuffix(".py")
    head = [*_head(output), *_import_lines(module, where, stem), ""]
    if output.reexports:
        exported = sorted({n for _, n in output.reexports} | {n for n in module.defined if not n.startswith("_")})
        head += [f"__all__ = [{', '.join(repr(n) for n in sorted(exported, key=_all_order))}]", ""]
    return "\n".join([*head, "", *module.lines]).rstrip() + "\n"


def ruff(texts: dict[str, str]) -> dict[str, str]:
    """``texts`` (file name -> source) with imports sorted and formatted by ruff under the
    repository's configuration, as ``ruff check --fix`` and ``ruff format`` leave the files: two
    runs over a temporary directory, not two per file."""
    config = REPO / "pyproject.toml"
    if not config.is_file():
        raise GenerationError(f"{config}: not found (run {COMMAND} in a checkout of guestd)")
    with tempfile.TemporaryDirectory(prefix="guestd-generate-sync-") as tmp:
        for name, text in texts.items():
            (Path(tmp) / name).write_text(text)
        for args in (["check", "--select", "I", "--fix", "--exit-zero"], ["format"]):
            done = subprocess.run(
                [sys.executable, "-m", "ruff", *args, "--quiet", "--no-cache", "--config", str(config), tmp],
                capture_output=True,
                text=True,
                cwd=REPO,
                check=False,
            )
            if done.returncode != 0:
                raise GenerationError(f"ruff {args[0]}: {done.stderr or done.stdout}")
        return {name: (Path(tmp) / name).read_text() for name in texts}


def render_all() -> dict[Path, str]:
    """Every generated file as committed: its path -> its text."""
    texts = ruff({output.path: render_raw(output) for output in OUTPUTS})
    return {CLIENT_DIR / name: text for name, text in texts.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file is stale")
    args = parser.parse_args(argv)
    stale = []
    for path, text in render_all().items():
        if path.exists() and path.read_text() == text:
            continue
        stale.append(path)
        if not args.check:
            path.write_text(text)
    for path in stale:
        print(f"{'stale' if args.check else 'wrote'} {path.relative_to(REPO)}")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
