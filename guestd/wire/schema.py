"""The protocol's machine-readable contract: message fields and every op.

This module is the single source of truth. ``protocol/schema/v1.json`` is a
snapshot of :func:`schema_document` (regenerate with ``python -m guestd.wire.schema``;
a test fails when the two differ). The session core validates every request's
``args`` (constraints and cross-field rules included) and INPUT body on the server,
and every RESPONSE and EVENT body on the client, against these specs, so
documentation and behaviour cannot drift and handlers receive checked arguments.

Field types: ``str``, ``int``, ``uint``, ``float`` (ints accepted), ``bool``,
``bin`` (msgpack bin), ``path`` (a file-system path or name: str when it is valid UTF-8,
bin holding the raw bytes when it is not; see :mod:`guestd.wire.paths`), ``map<str,str>``,
``list<str>``, ``list<path>``, ``list<uint>``, ``map`` (any map), ``enum(a|b)``, ``any``, and the
named records of :data:`RECORDS` (``NAME`` is one such map, ``list<NAME>`` a list of them).
A trailing ``?`` means nil is also allowed. Constraints: ``gt``/``ge``/``le`` (numbers),
``min_len`` (str, bin, list), ``le_limit`` (at most the named limit of the server's hello);
per op, ``one_of`` (exactly one of a group given) and ``exclusive`` (at most one).
Unknown fields are ignored by receivers (forward compatibility). Nil for a field whose type has
no ``?`` is refused like any other wrong type, whether the field is required or not.

Per op, two facts about its frames: ``final`` says what may end it (``response_or_error``, or
``error_only`` for an op that runs until cancelled and never sends a RESPONSE) and
``events_when`` names the bool args of which one must be true for the op to send any EVENT
(empty: events whenever the op has them).

Field groups (:class:`Group`): a named set of fields several messages share (``run_figures``,
``captured_output``...), spliced into each with ``*GROUP``. The wire does not see them (the
JSON snapshot and PROTOCOL.md list every message's fields flat); :mod:`guestd.wire.codegen`
makes each one a TypedDict base of the messages that have it, so a reply composes from the
parts the code produces.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final

from guestd.wire.errors import ErrorCode, GuestdError, limit_error

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = (1,)

_ENUM = re.compile(r"^enum\(([a-z0-9_|]+)\)$")

# OpSpec.final: what may end a request of the op.
RESPONSE_OR_ERROR = "response_or_error"
ERROR_ONLY = "error_only"


class F:
    """One field of a message, with the constraints every receiver enforces.

    ``gt``/``ge``/``le`` bound numbers (exclusive / inclusive), ``min_len`` bounds the
    length of a str, bin or list, and ``le_limit`` names a configured limit (an attribute
    of guestd's ``Limits``, reported in the hello) that the value may not exceed.

    A plain class with slots rather than a dataclass: hundreds of them live in guestd and are
    made at import, on the start path, where a dataclass's generated methods and frozen
    ``__init__`` cost several ms. Immutable by contract (``Final``, checked by mypy) but for
    ``check``, validate's cache of what ``type`` and the constraints say; equality, hash and
    repr are a frozen dataclass's (``group`` and ``check`` take no part in them).
    """

    __slots__ = (
        "check",
        "default",
        "doc",
        "ge",
        "group",
        "gt",
        "le",
        "le_limit",
        "min_len",
        "name",
        "required",
        "type",
    )

    def __init__(
        self,
        name: str,
        type: str,
        doc: str,
        required: bool = False,
        default: Any = None,
        gt: float | None = None,
        ge: float | None = None,
        le: float | None = None,
        min_len: int | None = None,
        le_limit: str | None = None,
        group: str | None = None,
    ) -> None:
        self.name: Final = name
        self.type: Final = type
        self.doc: Final = doc
        self.required: Final = required
        self.default: Final = default
        self.gt: Final = gt
        self.ge: Final = ge
        self.le: Final = le
        self.min_len: Final = min_len
        self.le_limit: Final = le_limit
        # The Group this field belongs to (set by Group; not on the wire).
        self.group: Final = group
        # How validate checks a value of this field, made on first use (a cache of what
        # ``type`` and the constraints say: not on the wire, no part of equality).
        self.check: FieldCheck | None = None

    def _key(self) -> tuple[Any, ...]:
        return (
            self.name,
            self.type,
            self.doc,
            self.required,
            self.default,
            self.gt,
            self.ge,
            self.le,
            self.min_len,
            self.le_limit,
        )

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        assert isinstance(other, F)
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return _repr(self, F._REPR)

    _REPR = ("name", "type", "doc", "required", "default", "gt", "ge", "le", "min_len", "le_limit")

    def with_group(self, group: str | None) -> F:
        """This field, as a member of ``group`` (None: of none)."""
        return F(
            self.name,
            self.type,
            self.doc,
            self.required,
            self.default,
            self.gt,
            self.ge,
            self.le,
            self.min_len,
            self.le_limit,
            group,
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type, "required": self.required, "doc": self.doc}
        if self.default is not None:
            out["default"] = self.default
        for key in ("gt", "ge", "le", "min_len", "le_limit"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out

    def constraint_text(self) -> str:
        """The constraints in words, for the op reference."""
        parts = []
        if self.gt is not None:
            parts.append(f"> {self.gt:g}")
        if self.ge is not None:
            parts.append(f">= {self.ge:g}")
        if self.le is not None:
            parts.append(f"<= {self.le:g}")
        if self.le_limit is not None:
            parts.append(f"<= limits.{self.le_limit}")
        if self.min_len is not None:
            parts.append(f"length >= {self.min_len}")
        return ", ".join(parts)


def _repr(obj: object, names: tuple[str, ...]) -> str:
    """A dataclass's repr: ``Class(name=value, ...)``."""
    inner = ", ".join(f"{name}={getattr(obj, name)!r}" for name in names)
    return f"{type(obj).__qualname__}({inner})"


# Every group by name, in the order they are declared (the generator's order).
GROUPS: dict[str, Group] = {}


class Group:
    """Fields several messages share, under one name: splice them into each with ``*GROUP``.

    Each message that has one field of a group has them all (checked when the schema loads).
    Two groups may share a name when they differ only in their docs (``captured_output`` says
    whose output it is); names, types and required-ness are the group's and must agree. A
    field belongs to one group at most (no nesting). (A plain class for the reason F is one.)
    """

    __slots__ = ("doc", "fields", "name")

    def __init__(self, name: str, doc: str, fields: tuple[F, ...]) -> None:
        for f in fields:
            if f.group is not None:
                raise AssertionError(f"group {name}: field {f.name} is already in group {f.group}")
        self.name: Final = name
        self.doc: Final = doc
        self.fields: Final = tuple(f.with_group(name) for f in fields)
        first = GROUPS.setdefault(name, self)
        if first.shape() != self.shape() or first.doc != self.doc:
            raise AssertionError(f"group {self.name} is declared twice with different fields or doc")

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        assert isinstance(other, Group)
        return (self.name, self.doc, self.fields) == (other.name, other.doc, other.fields)

    def __hash__(self) -> int:
        return hash((self.name, self.doc, self.fields))

    def __repr__(self) -> str:
        return _repr(self, ("name", "doc", "fields"))

    def __iter__(self) -> Iterator[F]:
        return iter(self.fields)

    def shape(self) -> tuple[tuple[str, str, bool], ...]:
        return tuple((f.name, f.type, f.required) for f in self.fields)


def groups_of(where: str, fields: tuple[F, ...]) -> tuple[str, ...]:
    """The groups a message has, in the order of their first field; each one whole."""
    out = tuple(dict.fromkeys(f.group for f in fields if f.group is not None))
    if out:
        names = {f.name for f in fields}
        for name in out:
            missing = [f.name for f in GROUPS[name].fields if f.name not in names]
            if missing:
                raise AssertionError(f"{where}: has part of group {name} but not {', '.join(missing)}")
    return out


class OpSpec:
    """One op: its args, result, EVENT and INPUT fields, errors and rules. (A plain class for the
    reason F is one; equality, hash and repr are a frozen dataclass's, ``fields_by_name`` apart.)"""

    __slots__ = (
        "args",
        "capability",
        "doc",
        "errors",
        "events",
        "events_when",
        "exclusive",
        "fields_by_name",
        "final",
        "input",
        "name",
        "one_of",
        "result",
    )
    _COMPARED = (
        "name",
        "capability",
        "doc",
        "args",
        "result",
        "events",
        "input",
        "errors",
        "one_of",
        "exclusive",
        "final",
        "events_when",
    )

    def __init__(
        self,
        name: str,
        capability: str,
        doc: str,
        args: tuple[F, ...] = (),
        result: tuple[F, ...] = (),
        events: tuple[F, ...] = (),
        input: tuple[F, ...] = (),
        errors: tuple[str, ...] = (),
        one_of: tuple[tuple[str, ...], ...] = (),
        exclusive: tuple[tuple[str, ...], ...] = (),
        final: str = RESPONSE_OR_ERROR,
        events_when: tuple[str, ...] = (),
    ) -> None:
        self.name: Final = name
        self.capability: Final = capability
        self.doc: Final = doc
        self.args: Final = args
        self.result: Final = result
        self.events: Final = events  # fields of EVENT frames, when the op streams
        self.input: Final = input  # fields of INPUT frames the op accepts
        self.errors: Final = errors
        # Cross-field rules on args: exactly one of each group given / at most one of each group given
        # ("given" = not nil and not false).
        self.one_of: Final = one_of
        self.exclusive: Final = exclusive
        # What may end a request of this op: "response_or_error", or "error_only" for an op that runs
        # until cancelled (file.watch): it never sends a RESPONSE, its final frame is always an ERROR.
        self.final: Final = final
        # Bool args of which one must be true for the op to send any EVENT (exec's stream); empty:
        # events whenever the op has them.
        self.events_when: Final = events_when
        self.fields_by_name: Final[dict[str, F]] = {f.name: f for f in args}
        self._check()

    def _check(self) -> None:
        if self.final not in (RESPONSE_OR_ERROR, ERROR_ONLY):
            raise AssertionError(f"{self.name}: final must be {RESPONSE_OR_ERROR} or {ERROR_ONLY}")
        if self.final == ERROR_ONLY and self.result:
            raise AssertionError(f"{self.name}: an op that never answers has no result fields")
        for name in self.events_when:
            if self.fields_by_name[name].type != "bool" or not self.events:
                raise AssertionError(f"{self.name}: events_when names bool args of an op with events")
        for rule, groups in (("one_of", self.one_of), ("exclusive", self.exclusive)):
            for names in groups:
                if len(names) < 2 or any(n not in self.fields_by_name for n in names):
                    raise AssertionError(f"{self.name}: {rule} {names} must name two or more of its args")
        if any(f.group is not None for f in self.args):
            raise AssertionError(f"{self.name}: args take no field group (their type lists every field)")
        groups_of(f"{self.name} result", self.result)
        groups_of(f"{self.name} events", self.events)
        groups_of(f"{self.name} input", self.input)

    def _key(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in OpSpec._COMPARED)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        assert isinstance(other, OpSpec)
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return _repr(self, OpSpec._COMPARED)

    def sends_events(self, args: Mapping[str, Any]) -> bool:
        """Whether a request with these args may receive EVENT frames."""
        if not self.events:
            return False
        return not self.events_when or any(args.get(name) is True for name in self.events_when)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "capability": self.capability,
            "doc": self.doc,
            "args": {f.name: f.to_json() for f in self.args},
            "result": {f.name: f.to_json() for f in self.result},
            "final": self.final,
        }
        if self.events:
            out["events"] = {f.name: f.to_json() for f in self.events}
        if self.events_when:
            out["events_when"] = list(self.events_when)
        if self.input:
            out["input"] = {f.name: f.to_json() for f in self.input}
        if self.one_of:
            out["one_of"] = [list(g) for g in self.one_of]
        if self.exclusive:
            out["exclusive"] = [list(g) for g in self.exclusive]
        if self.errors:
            out["errors"] = list(self.errors)
        return out


def _bad(name: str, want: str, got: Any) -> GuestdError:
    return GuestdError(
        ErrorCode.BAD_REQUEST,
        f"field {name!r} must be {want}, got {type(got).__name__}",
        details={"field": name},
    )


# Named nested types: a field of type NAME is a map of these fields, list<NAME> a list of them.
# Why a run ended and what it used (PROTOCOL.md "Why a run ended"): in every result of a run.
_FIGURES = Group(
    "run_figures",
    "why a run ended and what it used",
    (
        F(
            "killed_by",
            "enum(timeout|idle_timeout|cancel|signal|oom)?",
            "why the run ended when it did not exit by itself: guestd ended it (timeout, idle_timeout, cancel), "
            "the kernel's OOM killer, or another signal; nil: it exited by itself (or is still running)",
        ),
        F(
            "oom_killed",
            "bool?",
            "the OOM killer killed a process of this run (the run's cgroup memory.events); nil: not known "
            "(no memory controller on the runs' cgroups)",
        ),
        F("cpu_user_s", "float?", "CPU seconds in user mode used by the run (nil: not known)"),
        F("cpu_sys_s", "float?", "CPU seconds in the kernel used by the run (nil: not known)"),
        F(
            "max_rss_bytes",
            "uint?",
            "peak memory of the run's cgroup (memory.peak: every process of the run, page cache included); nil: "
            "not known (no memory controller on the runs' cgroups, Linux before 5.19, or part of a long-lived run)",
        ),
    ),
)

# Background processes: where each stream's ring starts, and with spill: true the files holding every byte.
_RING_STARTS = Group(
    "ring_starts",
    "where each stream's ring of a background process starts",
    (
        F(
            "stdout_ring_start",
            "uint?",
            "offset of the oldest stdout byte still in the ring: [0, stdout_ring_start) is gone from it "
            "(with spill, at the same offsets in stdout_spill)",
        ),
        F("stderr_ring_start", "uint?", "the same for stderr"),
    ),
)
_SPILL_FILES_DOC = "spill: the files holding every byte of stdout and stderr"
_PROCESS_SPILL = Group(
    "spill_files",
    _SPILL_FILES_DOC,
    (
        F(
            "stdout_spill",
            "spill_info?",
            "process.start spill: the file holding stdout from byte 0 (bytes: what is on disk so far; final once "
            "the process has exited and its streams ended)",
        ),
        F("stderr_spill", "spill_info?", "the same for stderr"),
    ),
)


RECORDS: dict[str, tuple[F, ...]] = {}


def _check_record(typ: str, record: tuple[F, ...], name: str, value: Any) -> Any:
    items = value if typ.startswith("list<") else [value]
    if not isinstance(items, list):
        raise _bad(name, "a list", value)
    checked = []
    for i, item in enumerate(items):
        where = f"{name}[{i}]" if typ.startswith("list<") else name
        if not isinstance(item, dict):
            raise _bad(where, "a map", item)
        try:
            checked.append(validate(record, item))
        except GuestdError as err:
            inner = err.details.get("field")
            full = f"{where}.{inner}"
            message = err.message.replace(repr(inner), repr(full))
            raise GuestdError(err.code, message, details={**err.details, "field": full}) from None
    return checked if typ.startswith("list<") else checked[0]


def _check_str(name: str, value: Any) -> Any:
    if not isinstance(value, str):
        raise _bad(name, "a string", value)
    return value


def _check_int(name: str, value: Any) -> Any:
    if not isinstance(value, int) or isinstance(value, bool):
        raise _bad(name, "an integer", value)
    return value


def _check_uint(name: str, value: Any) -> Any:
    if not isinstance(value, int) or isinstance(value, bool):
        raise _bad(name, "an integer", value)
    if value < 0:
        raise GuestdError(ErrorCode.BAD_REQUEST, f"field {name!r} must be >= 0", details={"field": name})
    return value


def _check_float(name: str, value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(name, "a number", value)
    if value != value or value in (float("inf"), float("-inf")):
        raise GuestdError(ErrorCode.BAD_REQUEST, f"field {name!r} must be finite", details={"field": name})
    return float(value)


def _check_bool(name: str, value: Any) -> Any:
    if not isinstance(value, bool):
        raise _bad(name, "a boolean", value)
    return value


def _check_bin(name: str, value: Any) -> Any:
    if not isinstance(value, bytes):
        raise _bad(name, "binary (msgpack bin)", value)
    return value


def _check_path(name: str, value: Any) -> Any:
    # Returned as received: the daemon's dispatcher turns it into an os str, the client keeps it.
    if not isinstance(value, (str, bytes)):
        raise _bad(name, "a path (string, or binary for names that are not UTF-8)", value)
    return value


def _check_map(name: str, value: Any) -> Any:
    if not isinstance(value, dict):
        raise _bad(name, "a map", value)
    return value


def _check_str_map(name: str, value: Any) -> Any:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise _bad(name, "a map of string to string", value)
    return value


def _check_uint_list(name: str, value: Any) -> Any:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise _bad(name, "a list of non-negative integers", value)
    return value


def _check_str_list(name: str, value: Any) -> Any:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _bad(name, "a list of strings", value)
    return value


def _check_path_list(name: str, value: Any) -> Any:
    if not isinstance(value, list) or not all(isinstance(v, (str, bytes)) for v in value):
        raise _bad(name, "a list of paths (each a string, or binary for names that are not UTF-8)", value)
    return value


# The built-in types' checkers, one lookup instead of a chain of comparisons on the hot path.
_BUILTIN_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "str": _check_str,
    "int": _check_int,
    "uint": _check_uint,
    "float": _check_float,
    "bool": _check_bool,
    "bin": _check_bin,
    "path": _check_path,
    "map": _check_map,
    "map<str,str>": _check_str_map,
    "list<uint>": _check_uint_list,
    "list<str>": _check_str_list,
    "list<path>": _check_path_list,
}


def _unknown_type(typ: str, name: str, value: Any) -> Any:
    raise AssertionError(f"unknown schema type {typ}")


def _check_enum(choices: tuple[str, ...], name: str, value: Any) -> Any:
    if value not in choices:
        raise GuestdError(
            ErrorCode.BAD_REQUEST,
            f"field {name!r} must be one of {', '.join(choices)}",
            details={"field": name},
        )
    return value


def _nil_refused(name: str) -> GuestdError:
    # Nil is never "absent": a field whose type has no "?" refuses it, required or not.
    return GuestdError(ErrorCode.BAD_REQUEST, f"field {name!r} may not be nil", details={"field": name})


class TypeCheck:
    """What a schema type string says, worked out once per string (:func:`type_check`): whether
    it takes nil (a "?" type, or "any") and the checker of a value that is not nil (None: any
    value; a built-in type's own function; a record's or an enum's, its choices split once).
    The checkers are module functions or partials of them, so an F caching one stays picklable."""

    __slots__ = ("checker", "takes_nil")

    def __init__(self, typ: str) -> None:
        base = typ[:-1] if typ.endswith("?") else typ
        self.takes_nil = typ.endswith("?") or base == "any"
        self.checker: Callable[[str, Any], Any] | None = None
        if base == "any":
            return
        self.checker = _BUILTIN_CHECKS.get(base)
        if self.checker is not None:
            return
        record = RECORDS.get(base[5:-1] if base.startswith("list<") else base)
        if record is not None:
            self.checker = functools.partial(_check_record, base, record)
            return
        m = _ENUM.match(base)
        if m is None:
            self.checker = functools.partial(_unknown_type, base)
        else:
            self.checker = functools.partial(_check_enum, tuple(m.group(1).split("|")))


_TYPE_CHECKS: dict[str, TypeCheck] = {}  # made at a type's first value (RECORDS is full by then)


def type_check(typ: str) -> TypeCheck:
    found = _TYPE_CHECKS.get(typ)
    if found is None:
        found = _TYPE_CHECKS[typ] = TypeCheck(typ)
    return found


def check_value(name: str, typ: str, value: Any) -> Any:
    """Validate one value against a schema type; returns it (ints widened to float)."""
    check = type_check(typ)
    if value is None:
        if check.takes_nil:
            return None
        raise _nil_refused(name)
    return value if check.checker is None else check.checker(name, value)


class FieldCheck:
    """What :func:`check_value` and the constraints come to for one field, worked out at its
    first value: its type's :class:`TypeCheck` (copied here: one attribute load less per
    value) and whether any constraint is set. validate runs every request's args and every
    reply the client receives through these (parsing the type string per value was half of
    validate's time: 8.8 -> 4.4 us for an exec reply)."""

    __slots__ = ("checker", "constrained", "takes_nil")

    def __init__(self, f: F) -> None:
        types = type_check(f.type)
        self.takes_nil = types.takes_nil
        self.checker = types.checker
        self.constrained = any(c is not None for c in (f.gt, f.ge, f.le, f.min_len, f.le_limit))


def validate(fields: tuple[F, ...], body: dict[str, Any], limits: object | None = None) -> dict[str, Any]:
    """Check required fields, types and constraints, fill defaults, drop unknown keys.

    ``limits`` (guestd's ``Limits``) enables the ``le_limit`` checks; without it they are skipped.
    """
    out: dict[str, Any] = {}
    for f in fields:
        name = f.name
        if name in body:
            value = body[name]
            check = f.check
            if check is None:
                check = f.check = FieldCheck(f)
            if value is None:
                if not check.takes_nil:
                    raise _nil_refused(name)
            else:
                if check.checker is not None:
                    value = check.checker(name, value)
                if check.constrained:
                    _check_constraints(f, value, limits)
            out[name] = value
        elif f.required:
            raise GuestdError(ErrorCode.BAD_REQUEST, f"missing required field {name!r}", details={"field": name})
        else:
            out[name] = f.default
    return out


def validate_args(spec: OpSpec, body: dict[str, Any], limits: object | None = None) -> dict[str, Any]:
    """An op's args: :func:`validate`, then the op's cross-field rules."""
    args = validate(spec.args, body, limits)
    for group in spec.one_of:
        given = [name for name in group if args.get(name) not in (None, False)]
        if len(given) != 1:
            raise GuestdError(
                ErrorCode.BAD_REQUEST,
                f"give exactly one of {' / '.join(repr(n) for n in group)}",
                details={"field": given[1] if len(given) > 1 else group[0]},
            )
    for group in spec.exclusive:
        given = [name for name in group if args.get(name) not in (None, False)]
        if len(given) > 1:
            raise GuestdError(
                ErrorCode.BAD_REQUEST,
                f"give at most one of {' / '.join(repr(n) for n in group)}",
                details={"field": given[1]},
            )
    return args


def _check_constraints(f: F, value: Any, limits: object | None) -> None:
    def out_of_range(rule: str) -> GuestdError:
        return GuestdError(ErrorCode.BAD_REQUEST, f"field {f.name!r} must be {rule}", details={"field": f.name})

    if f.gt is not None and not value > f.gt:
        raise out_of_range(f"> {f.gt:g}")
    if f.ge is not None and not value >= f.ge:
        raise out_of_range(f">= {f.ge:g}")
    if f.le is not None and not value <= f.le:
        raise out_of_range(f"<= {f.le:g}")
    if f.min_len is not None and len(value) < f.min_len:
        raise out_of_range(f"at least {f.min_len} long")
    if f.le_limit is not None and limits is not None:
        bound = getattr(limits, f.le_limit)
        if value > bound:
            err = limit_error(f.le_limit, bound, f"{f.name} may be at most {bound:g} (limits.{f.le_limit})")
            err.details["field"] = f.name
            raise err


# --------------------------------------------------------------------------- messages

# Every signal field is a str (an integer is bad_request naming the field): PROTOCOL.md 7.
_SIGNAL_DOC = (
    "signal as a str: a name with or without SIG, any case (TERM, SIGTERM, term, USR1, RTMIN), "
    'or its number in ASCII decimal digits ("15", 1..64)'
)

HELLO_CLIENT = (
    F("versions", "list<uint>", "protocol versions the client speaks", True),
    F("client", "str", "client name/version, for logs", default=""),
    F(
        "max_frame",
        "uint?",
        "largest payload the client accepts; the server never sends more (values below 65536 are raised to 65536)",
    ),
    F(
        "stream_window",
        "uint?",
        "initial stream credit the client grants per stream, both directions "
        "(the server uses the smaller of this and its own limit, at least 65536)",
    ),
    F("token", "str?", "access token, when the server is configured with one"),
    F("time_ns", "int?", "the host's wall clock; a guest clock off by > 1 s is corrected and a restore suspected"),
)

HELLO_SERVER = (
    F("version", "uint", "the negotiated protocol version", True),
    F("server", "str", "guestd/<package version>", True),
    F("capabilities", "list<str>", "capability names (system, exec, files, ...)", True),
    F("ops", "list<str>", "every op this server serves", True),
    F("limits", "map", "name -> value of every limit (see PROTOCOL.md)", True),
    F("stream_window", "uint", "negotiated initial credit per stream, bytes", True),
    F("max_frame", "uint", "negotiated max payload the server will send", True),
    F("boot_id", "str", "kernel boot id of the guest", True),
    F("session", "str", "random id of this connection, for logs", True),
)

ERROR_BODY = (
    F("code", "str", "stable error code", True),
    F("message", "str", "human-readable text", True),
    F("errno", "int?", "OS errno when an OS call failed"),
    F("details", "map", "structured extras: field, limit, stage, path, ..."),
)

WINDOW_BODY = (F("bytes", "uint", "additional stream bytes the sender may now send", True),)
CANCEL_BODY: tuple[F, ...] = ()

# --------------------------------------------------------------------------- records

RECORDS.update(
    {
        "dir_entry": (
            F("name", "path", "entry name", True),
            F(
                "type",
                "enum(file|dir|symlink|fifo|socket|char|block|other)",
                "file type (not following symlinks)",
                True,
            ),
            F("size", "uint", "st_size", True),
            F("mode", "uint", "permission bits", True),
            F("mtime_ns", "int", "modification time, ns since the epoch", True),
        ),
        "code_output": (
            F("kind", "enum(result|display)", "the cell's value, or a display() call", True),
            F("data", "map", "MIME bundle: type -> value; image/* values are bin, text types str", True),
        ),
        "code_error": (
            F("ename", "str", "exception class name", True),
            F("evalue", "str", "exception message", True),
            F("traceback", "list<str>", "formatted traceback lines", True),
        ),
        "kernel_info": (
            F("name", "str", "kernel name: \"python\" (code.create's default) or a kernelspec's", True),
            F(
                "python",
                "str",
                "the program the kernel runs: the Python interpreter, or the kernelspec's argv[0]",
                True,
            ),
            F("own", "bool", "guestd's own private Python (not the workload's: no package it installs)", True),
            F(
                "setting",
                "str",
                'where it comes from: [code] python ("guestd", "auto", a name or path) or "kernelspec"',
                True,
            ),
            F("missing", "bool?", "[code] python names no interpreter that exists: code.create fails unavailable"),
        ),
        "context_info": (
            F("id", "str", "context id", True),
            F("name", "str?", "context name"),
            F("state", "enum(starting|idle|busy|dead)", "kernel state", True),
            F("pid", "int?", "kernel pid"),
            F("memory", "uint?", "kernel RSS, bytes"),
            F("last_activity", "float?", "wall clock of the last run"),
            F("execution_count", "int?", "the kernel's execution counter"),
            F("queued", "uint", "runs waiting", True),
            F("restarts", "uint", "kernel restarts", True),
            F("kernel", "str?", 'the kernel: "python" ([code] python\'s interpreter) or a kernelspec name'),
        ),
        "process_info": (
            F("id", "str", "process id", True),
            F("pid", "int", "OS pid", True),
            F("command", "str", "the command line", True),
            F("state", "enum(running|exited)", "", True),
            F("pty", "bool", "runs on a pty", True),
            F("started_at", "float", "wall clock at start", True),
            F("ended_at", "float?", "wall clock at exit"),
            F("exit_code", "int?", "exit status"),
            F("signal", "int?", "terminating signal"),
            F("stdout_offset", "uint", "bytes written to stdout so far", True),
            F("stderr_offset", "uint", "bytes written to stderr so far", True),
            F("cpu_s", "float?", "CPU seconds (running only)"),
            F("rss", "uint?", "resident memory, bytes (running only)"),
            *_FIGURES,
            *_RING_STARTS,
            *_PROCESS_SPILL,
        ),
        "listener": (
            F("port", "uint", "TCP port", True),
            F("address", "str", "bound address (0.0.0.0 or :: for every address)", True),
            F("family", "enum(ipv4|ipv6)", "address family", True),
            F("pid", "int?", "pid of a process holding the socket, when guestd may see it"),
            F("command", "str?", "that process's command line (at most 256 characters)"),
        ),
        "spill_info": (
            F("path", "path", "the file (read it with file.read at the reply's offsets)", True),
            F("bytes", "uint", "bytes in it: the stream's first bytes", True),
            F(
                "stopped",
                "enum(cap|disk_full|behind|io_error)?",
                "why the file holds less than the stream: limits.max_spill_bytes, the file system's reserve, "
                "the disk falling 16 MiB behind, a write error; nil: all of it",
            ),
        ),
        "shell_info": (
            F("id", "str", "session id", True),
            F("name", "str?", "session name"),
            F("pid", "int", "bash pid", True),
            F("cwd", "path", "current directory", True),
            F("busy", "bool", "a command is running", True),
            F("alive", "bool", "bash is running", True),
            F("commands", "uint", "commands run", True),
            F("restarts", "uint", "bash restarts", True),
            F("stray_bytes", "uint", "output between commands, discarded", True),
        ),
    }
)

RECORDS.update(
    {
        "pressure": (
            F("cpu_some", "float?", "cpu: some, avg10 %"),
            F("memory_some", "float?", "memory: some, avg10 %"),
            F("memory_full", "float?", "memory: full, avg10 %"),
            F("io_some", "float?", "io: some, avg10 %"),
            F("io_full", "float?", "io: full, avg10 %"),
        ),
        "disk_usage": (
            F("mount", "path", "mount point", True),
            F("fs", "str", "file system type", True),
            F("total_bytes", "uint", "size", True),
            F("used_bytes", "uint", "used (size - free blocks)", True),
            F("free_bytes", "uint", "free for an unprivileged user (f_bavail)", True),
            F("inodes_total", "uint", "inodes (0 where the file system has no fixed count)", True),
            F("inodes_free", "uint", "free inodes", True),
        ),
        "snapshot_hazards": (
            F("listening", "list<str>", "listening TCP sockets, address:port (at most 256)", True),
            F("established", "list<str>", "established TCP connections, local -> remote (at most 256)", True),
            F("listening_count", "uint", "all listening TCP sockets", True),
            F("established_count", "uint", "all established TCP connections", True),
        ),
        "metrics_sample": (
            F("t", "float", "guest wall clock of the sample", True),
            F("interval_s", "float?", "the window CPU % was measured over (nil: no window, interval_ms 0)"),
            F("cpus", "uint", "CPUs online", True),
            F("cpu_percent", "float?", "guest CPU busy over the window, % of all CPUs (100: every CPU busy)"),
            F(
                "workload_cpu_percent",
                "float?",
                "CPU used by the workload cgroup over the window, % of all CPUs (nil: no workload cgroup)",
            ),
            F("memory_total_bytes", "uint", "MemTotal", True),
            F("memory_available_bytes", "uint", "MemAvailable", True),
            F("memory_used_bytes", "uint", "MemTotal - MemAvailable", True),
            F("workload_memory_bytes", "uint?", "the workload cgroup's memory.current (nil: no memory controller)"),
            F("workload_memory_peak_bytes", "uint?", "its memory.peak since guestd made it (Linux 5.19)"),
            F("workload_memory_max_bytes", "uint?", "its memory.max (nil: max, or no memory controller)"),
            F("processes", "uint", "processes in the guest (guestd's pid namespace)", True),
            F("workload_pids", "uint?", "tasks in the workload cgroup, as pids.max counts them (pids.current)"),
            F(
                "workload_oom_kills",
                "uint?",
                "OOM kills in the workload cgroup since guestd made it (memory.events oom_kill)",
            ),
            F("pressure", "pressure?", "guest-wide PSI (/proc/pressure; nil where the kernel has none)"),
            F("workload_pressure", "pressure?", "the workload cgroup's PSI"),
            F("disks", "list<disk_usage>", "real file systems (no proc, sysfs, cgroup...), at most 32", True),
        ),
    }
)

# --------------------------------------------------------------------------- ops


def _captured(who: str) -> Group:
    """The bounded-capture fields shared by exec, shell.run and code.run results."""
    out: list[F] = []
    for s in ("stdout", "stderr"):
        out += [
            F(s, "bin", f"captured {s} (empty in stream mode)", True),
            F(f"{s}_bytes", "uint", f"total bytes {who} wrote to {s}", True),
            F(f"{s}_dropped", "uint", f"bytes of {s} not returned", True),
        ]
    fields = (
        *out,
        F("stdout_gap_at", "uint?", "offset in stdout where the dropped bytes were cut out"),
        F("stderr_gap_at", "uint?", "offset in stderr where the dropped bytes were cut out"),
    )
    return Group("captured_output", "the bounded capture of a run's stdout and stderr", fields)


_OUTPUT_RESULT = (
    F("exit_code", "int?", "exit status when the process exited normally"),
    F("signal", "int?", "terminating signal number when killed by a signal"),
    F("timed_out", "enum(wall|idle)?", "which timeout fired, nil when none did"),
    *_captured("the process"),
    F("duration_s", "float", "wall time from spawn to result", True),
    F("pid", "int", "process id of the started process", True),
    *_FIGURES,
    F("detached", "str?", "on_timeout detach: the background process id the command goes on as"),
)

_MERGE_STDERR = F(
    "merge_stderr",
    "bool",
    "stderr into stdout's pipe: one stream in write order, as a terminal shows it (stderr stays empty)",
    default=False,
)

_SPILL = F(
    "spill",
    "bool",
    "also write the full stdout and stderr to files in guestd's spill directory (result fields "
    "stdout_spill/stderr_spill; the bytes dropped from the reply are at [gap_at, gap_at+dropped) there); "
    "not with stream",
    default=False,
)
_SPILL_RESULT = Group(
    "spill_files",
    _SPILL_FILES_DOC,
    (
        F("stdout_spill", "spill_info?", "spill: the file holding stdout from byte 0"),
        F("stderr_spill", "spill_info?", "spill: the file holding stderr from byte 0"),
    ),
)
# Added to a result by the code around the run (Services.with_changes, KeptRuns.keep), not by the run's own.
_CHANGES_RESULT = Group(
    "reported_changes",
    "report_changes: what changed under the workspace during the run",
    (F("changes", "change_report?", "report_changes: what changed under the workspace during the run"),),
)
_KEPT_RESULT = Group("kept_run_id", "keep: the run's id", (F("run_id", "str?", "keep: the run's id"),))

_SHAPING = (
    F(
        "strip_ansi",
        "bool",
        "remove ANSI escape sequences (colours, cursor moves, titles) from the returned output; counts stay raw",
        default=False,
    ),
    F(
        "collapse_cr",
        "bool",
        "each returned line as a terminal leaves it after its \\r redraws (progress bars); counts stay raw",
        default=False,
    ),
)

_KEEP = F(
    "keep",
    "bool",
    "the run goes on if the request goes away (connection lost, cancel) and its result stays "
    "fetchable by run id (run.get, run.wait); an event {ev: kept, run_id} comes first",
    default=False,
)
_KEPT_EVENT = F("run_id", "str", "kept: the run's id")

# Fields several ops declare alike (args take no Group: each is spliced in where it stands).
_ARGV_OR_SHELL = (
    F("argv", "list<str>?", "program and arguments (exactly one of argv / shell)", min_len=1),
    F("shell", "str?", "command string run by /bin/sh -c"),
)
_ENV = (
    F("env", "map<str,str>?", "environment variables"),
    F(
        "env_mode",
        "enum(merge|replace)",
        "merge env into guestd's (a run as the workload user gets its HOME, USER, LOGNAME unless env "
        "names them), or use env alone",
        default="merge",
    ),
)
_CAPTURE_BOUNDS = (
    F("max_output", "uint", "bytes kept per stream", default=65536, le_limit="max_output"),
    F("capture", "enum(tail|head_tail)", "which bytes are kept when over max_output", default="tail"),
)
_REPORT_CHANGES = F(
    "report_changes",
    "bool",
    "also report the files created, modified and deleted under the workspace during the run",
    default=False,
)
_OUTPUT_DATA_EVENT = F("data", "bin", "stdout/stderr: next bytes of the stream")
_TARGET_PATH = F("path", "path", "target path", True)
_PARENTS = F("parents", "bool", "create missing parent directories", default=False)

_ON_TIMEOUT = F(
    "on_timeout",
    "enum(kill|detach)",
    "kill: end the command; detach: it goes on as a background process (result field detached)",
    default="kill",
)

OPS: tuple[OpSpec, ...] = (
    OpSpec(
        "ping",
        "system",
        "Liveness check; answered inline, never queued behind other work.",
        result=(F("t_ns", "int", "guest monotonic clock, ns", True),),
    ),
    OpSpec(
        "info",
        "system",
        "Version, capabilities, limits, uptime and resource figures of the guest.",
        result=(
            F("version", "str", "guestd package version", True),
            F("protocol_version", "uint", "negotiated protocol version", True),
            F("capabilities", "list<str>", "capability names", True),
            F("ops", "list<str>", "ops served", True),
            F("limits", "map", "limit name -> value", True),
            F("boot_id", "str", "kernel boot id", True),
            F("pid", "int", "guestd pid", True),
            F("uptime_s", "float", "seconds since guestd started", True),
            F("host_uptime_s", "float", "seconds since the guest booted", True),
            F("load", "any", "1/5/15-minute load averages", True),
            F("memory", "map", "total, available, used (bytes)", True),
            F("disk", "map", "total, used, free of the root filesystem (bytes)", True),
            F("cpu_count", "int", "logical CPUs", True),
            F("connections", "int", "open client connections", True),
            F("hostname", "str", "guest hostname", True),
            F("kernels", "list<kernel_info>", "code kernels and the Python (program) each runs"),
            F(
                "snapshot",
                "map",
                "generation, instance_id, sandbox_id, quiesced, suspected_restore, restored_at, simulated (why "
                "privileged steps are simulated; nil: done)",
                True,
            ),
            F("workload_cgroup", "str", "disabled | unavailable: why | active: path and limits", True),
            F("spawn", "str", "how runs start: clone3 (into their cgroup, like vfork) or popen (fallback)", True),
            F(
                "runs_ended_at_start",
                "uint",
                "processes of runs a previous guestd left in the workload cgroup, ended at start",
                True,
            ),
        ),
    ),
    OpSpec(
        "exec",
        "exec",
        "Run a process to completion with bounded output capture and timeouts that end the "
        "whole process tree. Could-not-start failures (bad argv, bad cwd) are ERROR frames "
        "with details.stage; a process that ran and failed is a RESPONSE with its exit status.",
        args=(
            *_ARGV_OR_SHELL,
            F("cwd", "path?", "working directory (default: guestd's)"),
            *_ENV,
            F("stdin", "bin?", "bytes fed to stdin, then closed; nil means /dev/null"),
            F("stdin_stream", "bool", "stdin comes from INPUT frames (data / eof)", default=False),
            _MERGE_STDERR,
            F("timeout_s", "float?", "wall-clock timeout", gt=0, le_limit="max_exec_timeout_s"),
            F(
                "idle_timeout_s",
                "float?",
                "timeout with no output on either stream",
                gt=0,
                le_limit="max_exec_timeout_s",
            ),
            F("kill_grace_s", "float", "SIGTERM -> SIGKILL grace after a timeout", default=2.0, ge=0, le=60),
            _ON_TIMEOUT,
            *_CAPTURE_BOUNDS,
            F("stream", "bool", "send output as EVENT frames as it arrives", default=False),
            _SPILL,
            *_SHAPING,
            F(
                "linger_s",
                "float",
                "after exit, how long to wait for pipes held by leftover children",
                default=0.5,
                ge=0,
                le=60,
            ),
            _REPORT_CHANGES,
        ),
        result=(
            *_OUTPUT_RESULT,
            *_CHANGES_RESULT,
            *_SPILL_RESULT,
        ),
        events=(
            F("ev", "enum(started|stdout|stderr)", "event type", True),
            F("pid", "int", "started: process id"),
            _OUTPUT_DATA_EVENT,
        ),
        input=(
            F("data", "bin", "bytes to write to stdin (stdin_stream only; counts against the window)"),
            F("eof", "bool", "close stdin"),
            F("signal", "str", _SIGNAL_DOC + " for the process group; one guestd does not know is ignored"),
        ),
        errors=("bad_request", "not_found", "permission_denied", "not_a_directory", "limit", "too_large", "cancelled"),
        one_of=(("argv", "shell"),),
        exclusive=(("stdin", "stdin_stream"), ("stream", "spill")),
        events_when=("stream",),
    ),
    OpSpec(
        "file.read",
        "files",
        "Read a whole file or a byte range in one reply (at most limits.max_read bytes).",
        args=(
            F("path", "path", "absolute path, or relative to guestd's cwd", True),
            F("offset", "uint", "first byte", default=0),
            F("length", "uint?", "bytes to read; nil reads to the end"),
        ),
        result=(
            F("data", "bin", "the bytes", True),
            F("size", "uint", "file size at the time of the read", True),
            F("eof", "bool", "true when data reaches the end of the file", True),
        ),
        errors=("not_found", "is_a_directory", "not_a_file", "permission_denied", "too_large"),
    ),
    OpSpec(
        "file.write",
        "files",
        "Write a file from bytes in one request. overwrite is an atomic replace (temp file, "
        "fsync, rename): readers see the old or the new file, never a mix, and a failure "
        "leaves the old file untouched.",
        args=(
            _TARGET_PATH,
            F("data", "bin", "content", True),
            F(
                "flag",
                "enum(overwrite|create|append)",
                "overwrite (atomic replace), create (fail if it exists), append",
                default="overwrite",
            ),
            F("perm", "uint?", "permission bits for a new file (default 0o644; overwrite keeps the old file's)"),
            _PARENTS,
        ),
        result=(F("size", "uint", "file size after the write", True),),
        errors=(
            "not_found",
            "exists",
            "is_a_directory",
            "not_a_directory",
            "not_a_file",
            "permission_denied",
            "no_space",
        ),
    ),
    OpSpec(
        "file.upload",
        "files",
        "Stream a file of any size into the guest: INPUT frames carry data, then eof. The "
        "server grants credit with WINDOW frames (the initial credit is the negotiated hello.stream_window). "
        "Written to a temp file and renamed into place on eof, so it is atomic like file.write.",
        args=(
            _TARGET_PATH,
            F("flag", "enum(overwrite|create)", "replace atomically, or fail if it exists", default="overwrite"),
            F("perm", "uint?", "permission bits (default 0o644)"),
            _PARENTS,
            F("size", "uint?", "expected size; a mismatch at eof fails and keeps the old file"),
        ),
        result=(F("size", "uint", "bytes written", True),),
        input=(F("data", "bin", "next bytes"), F("eof", "bool", "all data sent; commit the file")),
        errors=("not_found", "exists", "is_a_directory", "permission_denied", "no_space", "bad_request", "limit"),
    ),
    OpSpec(
        "file.download",
        "files",
        "Stream a file (or a range) out of the guest as EVENT frames, within the client's "
        "WINDOW credit (initially the negotiated hello.stream_window). Each data EVENT holds at most "
        "chunk bytes and fits the client's max_frame.",
        args=(
            F("path", "path", "source path", True),
            F("offset", "uint", "first byte", default=0),
            F("length", "uint?", "bytes to send; nil sends to the end"),
            F("chunk", "uint?", "most bytes per EVENT; default limits.max_chunk", ge=1, le_limit="max_chunk"),
        ),
        result=(F("bytes", "uint", "bytes sent", True), F("size", "uint", "file size at open", True)),
        events=(
            F("ev", "enum(start|data)", "event type", True),
            F("size", "uint", "start: file size at open"),
            F("data", "bin", "data: next bytes"),
        ),
        errors=("not_found", "is_a_directory", "not_a_file", "permission_denied"),
    ),
    OpSpec(
        "file.stat",
        "files",
        "Metadata of a path.",
        args=(F("path", "path", "path", True), F("follow", "bool", "follow a final symlink", default=True)),
        result=(
            F("type", "enum(file|dir|symlink|fifo|socket|char|block|other)", "file type", True),
            F("size", "uint", "bytes", True),
            F("mode", "uint", "permission bits", True),
            F("uid", "int", "owner", True),
            F("gid", "int", "group", True),
            F("mtime_ns", "int", "modification time, ns since the epoch", True),
            F("target", "path?", "symlink target when type is symlink"),
        ),
        errors=("not_found", "permission_denied"),
    ),
    OpSpec(
        "file.list",
        "files",
        "List a directory: the first max_entries entries in order of their names as bytes "
        "(so a truncated listing is always the same prefix), with the total count.",
        args=(
            F("path", "path", "directory", True),
            F("max_entries", "uint?", "cap; default limits.max_list_entries", le_limit="max_list_entries"),
        ),
        result=(
            F("entries", "list<dir_entry>", "sorted by name bytes", True),
            F("total", "uint", "entries in the directory (without . and ..), returned or not", True),
            F("truncated", "bool", "true when more entries exist than were returned", True),
        ),
        errors=("not_found", "not_a_directory", "permission_denied"),
    ),
    OpSpec(
        "file.mkdir",
        "files",
        "Create a directory.",
        args=(
            F("path", "path", "directory", True),
            F("parents", "bool", "create missing parents, no error when it exists (mkdir -p)", default=True),
            F("perm", "uint", "permission bits", default=0o755),
        ),
        result=(F("created", "bool", "false when it already existed", True),),
        errors=("exists", "not_found", "not_a_directory", "permission_denied"),
    ),
    OpSpec(
        "file.remove",
        "files",
        "Remove a file, symlink or empty directory; with recursive, a whole tree (symlinks are "
        "removed, never followed).",
        args=(F("path", "path", "path", True), F("recursive", "bool", "remove a directory tree", default=False)),
        result=(F("removed", "uint", "entries removed", True),),
        errors=("not_found", "not_empty", "permission_denied"),
    ),
    OpSpec(
        "file.rename",
        "files",
        "Rename (move) a path atomically within one filesystem.",
        args=(
            F("src", "path", "existing path", True),
            F("dst", "path", "new path", True),
            F("overwrite", "bool", "replace an existing dst", default=True),
        ),
        errors=("not_found", "exists", "permission_denied", "is_a_directory", "not_a_directory"),
    ),
)

_CODE_REF = F("context", "str?", 'context id or name; nil means the context named "default", created on first use')

_CODE_RESULT = (
    F("context", "str", "id of the context that ran the code", True),
    F("status", "enum(ok|error|timeout|interrupted|died)", "how the run ended", True),
    F("timeout_action", "enum(interrupted|restarted)?", "after a timeout: the kernel was interrupted, or restarted"),
    F("exit_reason", "str?", "status died: how the kernel process ended"),
    *_captured("the cell (UTF-8)"),
    F(
        "results",
        "list<code_output>",
        "the cell's value and displays, in order (empty with stream: each went as a result/display event)",
        True,
    ),
    F(
        "results_dropped",
        "uint",
        "rich results not returned: over 64, over limits.max_output or the client's max_frame (measured "
        "encoded), nested deeper than 56 levels, or not encodable",
        True,
    ),
    F(
        "error",
        "code_error?",
        "when the cell raised, an interrupted or timed-out cell included (KeyboardInterrupt); also with stream, "
        "after its error event",
    ),
    F("stdin_exhausted", "bool", "the cell asked for more input lines than were supplied", True),
    F("execution_count", "int?", "the kernel's execution counter for this cell"),
    F("duration_s", "float", "wall time of the run", True),
    *_FIGURES,
)

CODE_OPS: tuple[OpSpec, ...] = (
    OpSpec(
        "code.create",
        "code",
        "Create a persistent context: a Python kernel (from the warm pool when one is ready) in the Python the "
        "config names ([code] python: the workload's python3 in the shipped config, guestd's own without one; "
        "info.kernels says which), or any Jupyter kernelspec installed in the guest. A Python without ipykernel "
        "fails at once: unavailable, details.reason no_ipykernel (no_python: none there), details.python. "
        "A name that already exists returns that context. "
        "A kernel that fails to start, or whose start is given up or cancelled, is ended (its whole run) "
        "before the answer.",
        args=(
            F("cwd", "path?", "working directory of the kernel"),
            F("env", "map<str,str>?", "environment variables added to the kernel's"),
            F("name", "str?", "a name to find the context by"),
            F(
                "kernel",
                "str?",
                'nil or "python": the Python kernel ([code] python); another name: that installed kernelspec (an '
                "unknown name is not_found with details.installed)",
                min_len=1,
            ),
            F(
                "start_timeout_s",
                "float?",
                "the longest wait for the kernel to start, this one and the context's restarts (a kernel not ready "
                "by then is ended, and the create fails unavailable, details.reason start_timeout); nil: guestd "
                "waits while the kernel makes progress (uses CPU or reads), gives up after 30 s without any "
                "(details.reason no_progress) and after 300 s in all. A ready pooled kernel is already started; "
                "one of the pool still starting is waited for at most this long",
                gt=0,
                le=600,
            ),
        ),
        result=(
            F("id", "str", "context id", True),
            F("name", "str?", "its name"),
            F("pid", "int", "kernel process id", True),
            F("pooled", "bool", "true when a pre-started kernel was used", True),
            F("existing", "bool", "true when name matched an existing context", True),
            F("kernel", "str?", 'the context\'s kernel: "python" or the kernelspec name'),
        ),
        errors=("limit", "not_found", "unavailable"),
    ),
    OpSpec(
        "code.run",
        "code",
        "Run code in a context. Runs on one context are serialized (bounded queue); contexts run in parallel. "
        "A timeout interrupts the kernel (SIGINT) and restarts it if it is not idle within interrupt_grace_s; "
        "output so far is kept. input()/getpass() fail at once unless input_lines are given. With stream, the "
        "response's stdout, stderr and results are empty (the *_bytes counts exact, error still given): they went "
        "as events. A cell ended by code.interrupt or its timeout sends its error event (ename KeyboardInterrupt) "
        "before the response, whose status is interrupted (timeout after a timeout).",
        args=(
            _CODE_REF,
            F("code", "str", "the cell", True),
            F(
                "timeout_s",
                "float?",
                "wall-clock timeout for the cell, the wait in the context's queue included (a run still queued "
                "when it expires fails as timeout, details.stage queue); nil: the cell has none and the queue "
                "wait is bounded by the config's code.queue_wait_s",
                gt=0,
                le_limit="max_exec_timeout_s",
            ),
            F(
                "interrupt_grace_s",
                "float",
                "after a timeout, how long the interrupt may take before a restart",
                default=2.0,
                ge=0,
                le_limit="max_exec_timeout_s",
            ),
            F("input_lines", "list<str>?", "answers for input()/getpass(), in order"),
            F("strip_ansi", "bool", "remove ANSI colour codes from output and tracebacks", default=False),
            *_CAPTURE_BOUNDS,
            F("stream", "bool", "send output and results as EVENT frames as they arrive", default=False),
            _KEEP,
        ),
        result=(*_CODE_RESULT, *_KEPT_RESULT),
        events=(
            F("ev", "enum(stdout|stderr|result|display|error|kept)", "event type", True),
            _KEPT_EVENT,
            F("data", "bin", "stdout/stderr: next bytes"),
            F("bundle", "map", "result/display: the MIME bundle"),
            F("ename", "str", "error: exception class"),
            F("evalue", "str", "error: message"),
            F("traceback", "list<str>", "error: formatted traceback lines"),
        ),
        errors=("not_found", "unavailable", "limit", "bad_request", "timeout"),
        events_when=("stream", "keep"),  # keep without stream: the one kept event
    ),
    OpSpec(
        "code.interrupt",
        "code",
        "Interrupt a context's kernel (SIGINT to its process group, or interrupt_request on the control channel "
        "for a kernelspec whose interrupt_mode is message); a running cell ends with status interrupted.",
        args=(_CODE_REF,),
        errors=("not_found",),
    ),
    OpSpec(
        "code.restart",
        "code",
        "Replace the context's kernel with a fresh one (state lost, same id, same cwd/env).",
        args=(_CODE_REF,),
        result=(F("pid", "int", "the new kernel's process id", True),),
        errors=("not_found", "unavailable"),
    ),
    OpSpec(
        "code.close",
        "code",
        "Close a context and kill its kernel (a close whose request is cancelled still ends the kernel and "
        "releases it).",
        args=(_CODE_REF,),
        errors=("not_found",),
    ),
    OpSpec(
        "code.list",
        "code",
        "Every context with its state.",
        result=(
            F("contexts", "list<context_info>", "every context", True),
            F("pool_ready", "uint", "pre-started kernels ready in the pool", True),
        ),
    ),
)

_PID = F("id", "str", "process id returned by process.start", True)
_TERMINAL_SIZE = (F("rows", "uint", "rows", True, ge=1, le=9999), F("cols", "uint", "columns", True, ge=1, le=9999))
_EXIT = (
    F("state", "enum(running|exited)", "process state", True),
    F("exit_code", "int?", "exit status once exited normally"),
    F("signal", "int?", "terminating signal once killed"),
    *_FIGURES,
)

PROCESS_OPS: tuple[OpSpec, ...] = (
    OpSpec(
        "process.start",
        "process",
        "Start a background process and return at once. It keeps running when the connection closes; "
        "its output is kept in per-stream rings addressed by absolute offsets. A program that cannot be started "
        "is an error, as for exec: not_found or permission_denied with errno and details.stage spawn "
        "(details.argv0), or details.stage cwd (details.cwd) for the working directory; with shell, /bin/sh "
        "starts and a missing command is the process's exit status 127.",
        args=(
            *_ARGV_OR_SHELL,
            F("cwd", "path?", "working directory"),
            *_ENV,
            F("stdin", "bool", "keep a stdin pipe for process.write (else /dev/null)", default=False),
            F(
                "pty",
                "bool",
                "run on a pseudo-terminal (output merged into stdout, input via process.write)",
                default=False,
            ),
            F("rows", "uint", "pty rows", default=24, ge=1, le=9999),
            F("cols", "uint", "pty columns", default=80, ge=1, le=9999),
            F("ring_bytes", "uint", "bytes kept per stream", default=1024 * 1024, ge=1, le_limit="max_ring_bytes"),
            _MERGE_STDERR,
            F(
                "spill",
                "bool",
                "also write the full stdout and stderr to files in guestd's spill directory, each from byte 0 "
                "(process_info and process.wait name them: stdout_spill/stderr_spill; what the ring no longer "
                "holds, [0, *_ring_start), is at the same offsets there); the files go when the process is forgotten "
                "(process.forget, or its retention ends)",
                default=False,
            ),
        ),
        result=(F("id", "str", "process id", True), F("pid", "int", "OS pid", True)),
        errors=("not_found", "permission_denied", "not_a_directory", "limit", "bad_request"),
        one_of=(("argv", "shell"),),
    ),
    OpSpec(
        "process.list",
        "process",
        "Every kept process.",
        result=(F("processes", "list<process_info>", "every kept process", True),),
    ),
    OpSpec(
        "process.attach",
        "process",
        "Stream a process's output from the given offsets, then live until it exits (follow) or until "
        "what is buffered now has been sent. Bytes overwritten in the ring are reported by a lost event.",
        args=(
            _PID,
            F("stdout_from", "uint", "first stdout offset wanted", default=0),
            F("stderr_from", "uint", "first stderr offset wanted", default=0),
            F("follow", "bool", "keep streaming until the process exits", default=True),
            F("chunk", "uint?", "most bytes per event; default limits.max_chunk", ge=1, le_limit="max_chunk"),
        ),
        result=(
            *_EXIT,
            F("stdout_offset", "uint", "next stdout offset (reattach from here)", True),
            F("stderr_offset", "uint", "next stderr offset (reattach from here)", True),
        ),
        events=(
            F("ev", "enum(stdout|stderr|lost)", "event type", True),
            F("data", "bin", "stdout/stderr: bytes starting at offset"),
            F("offset", "uint", "absolute offset of data[0] (lost: where delivery resumes)"),
            F("stream", "str", "lost: which stream"),
            F("bytes", "uint", "lost: bytes no longer in the ring"),
        ),
        errors=("not_found",),
    ),
    OpSpec(
        "process.wait",
        "process",
        "Wait for exit, at most timeout_s.",
        args=(
            _PID,
            F("timeout_s", "float?", "give up after this long (timed_out: true)", ge=0, le_limit="max_exec_timeout_s"),
        ),
        result=(*_EXIT, F("timed_out", "bool", "the timeout passed first", True), *_RING_STARTS, *_PROCESS_SPILL),
        errors=("not_found",),
    ),
    OpSpec(
        "process.signal",
        "process",
        "Signal the process group; KILL also kills descendants that left the group. After the main process "
        "exited: KILL ends what the run left running in its cgroup leaf and answers {} when there is a workload "
        "cgroup; without one, and for any other signal, bad_request (details.process).",
        args=(_PID, F("signal", "str", _SIGNAL_DOC + "; one guestd does not know is bad_request", True)),
        errors=("not_found", "bad_request"),
    ),
    OpSpec(
        "process.write",
        "process",
        "Write bytes to the process's stdin (or pty). Writes to one process go in whole and in arrival "
        "order, one at a time (a paste sent as concurrent chunks arrives as sent). A write the process has "
        "not taken within the config's processes.stdin_timeout_s (default 30 s, counted from arrival) fails "
        "as timeout; every error carries details.written (bytes that went in), and writes queued behind a "
        "failed one fail unsent with its error code (details.stage queue). A write to a process that has "
        "exited is bad_request.",
        args=(_PID, F("data", "bin", "bytes", True)),
        result=(F("written", "uint", "bytes written", True),),
        errors=("not_found", "bad_request", "timeout", "io_error"),
    ),
    OpSpec("process.close_stdin", "process", "Close stdin (a pty gets ^D).", args=(_PID,), errors=("not_found",)),
    OpSpec(
        "process.resize",
        "process",
        "Set the pty size (the foreground job gets SIGWINCH). A process without a pty: bad_request "
        "(details.process, no details.field).",
        args=(_PID, *_TERMINAL_SIZE),
        errors=("not_found", "bad_request"),
    ),
    OpSpec(
        "process.forget",
        "process",
        "Drop a finished process and its output. A process still running is bad_request (details.process, "
        "no details.field): signal it first.",
        args=(_PID,),
        errors=("not_found", "bad_request"),
    ),
)

_SESSION_REF = F("id", "str", "session id or name", True)

SHELL_OPS: tuple[OpSpec, ...] = (
    OpSpec(
        "shell.create",
        "shell",
        "Start a persistent bash session. A name another session has is exists, details.session = that "
        "session's id, details.field = name.",
        args=(
            F("cwd", "path?", "starting directory"),
            F(
                "env",
                "map<str,str>?",
                "environment variables added to guestd's (with the workload user's HOME, USER, LOGNAME)",
            ),
            F("name", "str?", "a name to find the session by"),
        ),
        result=(F("id", "str", "session id", True), F("pid", "int", "bash's pid", True)),
        errors=("limit", "not_found", "not_a_directory", "exists", "unavailable"),
    ),
    OpSpec(
        "shell.run",
        "shell",
        "Run a command in the session: cd, variables, functions, aliases and activated venvs persist. "
        "stdin is /dev/null unless input is given. Output capture and counts as in exec; no markers in it.",
        args=(
            _SESSION_REF,
            F("command", "str", "bash command text (multi-line, heredocs allowed; a NUL byte is bad_request)", True),
            F("input", "bin?", "bytes for the command's stdin"),
            _MERGE_STDERR,
            F(
                "check_syntax",
                "bool",
                "parse with bash -n first: a syntax error is bad_request (details.stage syntax), nothing runs",
                default=False,
            ),
            F("stream", "bool", "send output as EVENT frames as it arrives (flow control as exec)", default=False),
            F("stdin_stream", "bool", "the command's stdin comes from INPUT frames (data / eof)", default=False),
            F(
                "pty",
                "bool",
                "run the command (in the session's state) on a terminal (rows x cols): stdin, stdout and stderr are "
                "its secondary side, output is one stream (stdout), INPUT data is typed into it, eof is ^D, "
                "INPUT signal goes to the command's process group; not with input, stdin_stream or "
                "on_timeout detach",
                default=False,
            ),
            F("rows", "uint", "pty: the terminal's rows (shell.resize changes them)", default=24, ge=1, le=9999),
            F("cols", "uint", "pty: the terminal's columns", default=80, ge=1, le=9999),
            F(
                "timeout_s",
                "float?",
                "wall-clock timeout: SIGINT, then the command's processes are ended",
                gt=0,
                le_limit="max_exec_timeout_s",
            ),
            F("idle_timeout_s", "float?", "timeout with no output", gt=0, le_limit="max_exec_timeout_s"),
            _ON_TIMEOUT,
            _KEEP,
            _SPILL,
            *_SHAPING,
            *_CAPTURE_BOUNDS,
            _REPORT_CHANGES,
        ),
        result=(
            F("exit_code", "int?", "the command's status (nil when the session had to be restarted)"),
            F("timed_out", "enum(wall|idle)?", "which timeout fired"),
            F("interrupted", "bool", "the command was interrupted by a timeout", True),
            F("session_restarted", "bool", "bash was restarted (cwd and exported variables kept)", True),
            F("cwd", "path", "working directory after the command", True),
            *_captured("the command"),
            F("duration_s", "float", "wall time", True),
            *_FIGURES,
            F(
                "detached",
                "str?",
                "on_timeout detach: the background process id the command goes on as (exit_code and killed_by are "
                "then nil, timed_out says which timeout; process.wait gives the job's status)",
            ),
            *_CHANGES_RESULT,
            *_KEPT_RESULT,
            *_SPILL_RESULT,
        ),
        events=(
            F("ev", "enum(stdout|stderr|kept)", "event type", True),
            _OUTPUT_DATA_EVENT,
            _KEPT_EVENT,
        ),
        input=(
            F("data", "bin", "bytes for the command's stdin (stdin_stream or pty; counts against the window)"),
            F("eof", "bool", "close the command's stdin (pty: type ^D)"),
            F("signal", "str", "pty only: " + _SIGNAL_DOC + " for the command's process group"),
        ),
        errors=("not_found", "limit", "bad_request", "unavailable"),
        exclusive=(("input", "stdin_stream"), ("stream", "spill")),
        events_when=("stream", "keep"),  # keep without stream: the one kept event
    ),
    OpSpec(
        "shell.resize",
        "shell",
        "Set the terminal size of the session's running pty command (shell.run pty); its process group "
        "gets SIGWINCH. bad_request when no pty command runs in the session, with details.session (the "
        "session's id, also when id was its name) and no details.field.",
        args=(
            _SESSION_REF,
            *_TERMINAL_SIZE,
        ),
        errors=("not_found", "bad_request"),
    ),
    OpSpec(
        "shell.list",
        "shell",
        "Every session.",
        result=(F("sessions", "list<shell_info>", "every session", True),),
    ),
    OpSpec(
        "shell.close",
        "shell",
        "End a session (a close whose request is cancelled still ends its bash and releases it).",
        args=(_SESSION_REF,),
        errors=("not_found",),
    ),
)

_SIMULATED = F(
    "simulated",
    "str?",
    "why the privileged steps were recorded instead of done (not configured as a guest: in_guest = "
    "false; or simulate_privileged); nil: they were done",
)

SNAPSHOT_OPS: tuple[OpSpec, ...] = (
    OpSpec(
        "snapshot.prepare",
        "snapshot",
        "Before pausing the VM: wait for in-flight file writes, sync filesystems, remove saved random-seed "
        "files, optionally stop accepting new work (until restore or snapshot.resume), and report what is "
        "still running. Idempotent.",
        args=(
            F(
                "quiesce",
                "bool",
                "new requests wait until restore/resume (ping, info and snapshot ops still answer)",
                default=False,
            ),
            F("timeout_s", "float", "how long to wait for in-flight writes", default=30.0, ge=0, le=3600),
            F(
                "freeze",
                "bool",
                "after the writes settled, freeze the workload cgroup (cgroup.freeze) until resume or restore; "
                "implies quiesce",
                default=False,
            ),
            F(
                "fsfreeze",
                "path?",
                "also freeze this file system (FIFREEZE: a mount point, never /) until resume or restore; implies "
                "quiesce",
            ),
            F(
                "freeze_max_s",
                "float",
                "thaw by itself after this long without resume or restore (guestd's monotonic clock)",
                default=300.0,
                gt=0,
                le=86400,
            ),
        ),
        result=(
            F("writes_settled", "bool", "no file write was in flight when it returned", True),
            F("synced", "bool", "sync(2) ran", True),
            F("seed_files_removed", "list<str>", "random-seed files removed (or that would be, when simulating)", True),
            F("quiesced", "bool", "new work is held", True),
            F("running", "map", "{processes, busy_contexts, busy_shells}: ids still running", True),
            F("frozen", "bool", "the workload cgroup is frozen (every process of it stopped)", True),
            F("fs_frozen", "path?", "the file system frozen (FIFREEZE), if any"),
            F("hazards", "snapshot_hazards", "what every clone would duplicate", True),
            F("duration_s", "float", "wall time", True),
            _SIMULATED,
        ),
    ),
    OpSpec(
        "clock.check",
        "snapshot",
        "Compare the guest's wall clock with the host's (cheap: the host may call it every few seconds): jumps "
        "of either clock and drift since the previous check or hello, measured against the guest's monotonic "
        "clock; a guest clock more than 0.2 s off is set to the host's, and a step back while runs are in "
        "flight is reported (backwards_under_runs). Answered while quiesced.",
        args=(F("time_ns", "int", "the host's wall clock, ns since the epoch", True, ge=0, le=9223372036854775807),),
        result=(
            F("offset_s", "float", "guest wall clock minus the host's, before any correction", True),
            F("since_last_s", "float?", "guest monotonic seconds since the previous observation (nil: the first)"),
            F(
                "host_jump_s",
                "float?",
                "the host's clock moved this much more than the guest's monotonic clock since the previous "
                "observation (more than 1 s: a host clock step, or the VM was paused or restored)",
            ),
            F("guest_jump_s", "float?", "the guest's wall clock moved this much more than its monotonic clock"),
            F("drift_ppm", "float?", "guest wall clock rate against the host's (observations >= 10 s apart, no jump)"),
            F("clock", "str", "done | simulated | kept (within 0.2 s)", True),
            F("stepped_s", "float?", "how far the clock was set (negative: backwards)"),
            F("runs_in_flight", "uint", "runs of the workload alive at the check", True),
            F(
                "backwards_under_runs",
                "bool",
                "the clock was set back while runs were in flight (their CLOCK_REALTIME timers fire late by that)",
                True,
            ),
            _SIMULATED,
        ),
        errors=("bad_request",),
    ),
    OpSpec("snapshot.resume", "snapshot", "Accept new work again after a quiescing prepare (no restore happened)."),
    OpSpec(
        "snapshot.restore",
        "snapshot",
        "First thing after every restore or clone (or pause/resume): re-seed the kernel CRNG (RNDADDENTROPY and "
        "RNDRESEEDCRNG), set the clock if off, re-seed guestd, code kernels incl. the warm pool "
        "(random, numpy, tempfile) and shells ($RANDOM), "
        "apply a new identity, drop connections from before the snapshot. Requests arriving meanwhile wait. "
        "The same nonce again is a no-op returning the first report; an older generation is refused (stale).",
        args=(
            F("generation", "uint", "strictly increasing per restore of this VM lineage", True),
            F("nonce", "str", "unique per restore call; a replay with the same nonce changes nothing", True),
            F("time_ns", "int", "the host's wall clock, ns since the epoch", True),
            F("entropy", "bin", "host randomness", True, min_len=32),
            F("identity", "map?", "{sandbox_id, hostname, env: {K: V} for future execs, token}"),
        ),
        result=(
            F("generation", "uint", "the generation now current", True),
            F("replayed", "bool", "true when this nonce was seen before (nothing was done again)", True),
            F("crng", "str", "done | simulated", True),
            F("clock", "str", "done | simulated | kept (within the threshold)", True),
            F("clock_skew_s", "float", "guest clock minus host clock before the fix", True),
            F("identity", "list<str>", "identity fields applied", True),
            F("connections_dropped", "uint", "connections from before the snapshot that were closed", True),
            F(
                "contexts_reseeded",
                "list<str>",
                "code contexts whose kernel confirmed its new seed before this reply (also while running a cell)",
                True,
            ),
            F(
                "contexts_pending",
                "list<str>",
                "contexts not confirmed within 50 ms (a C call holding the interpreter, a kernel starting): "
                "re-seeded when it returns, always before their next cell",
                True,
            ),
            F("shells_reseeded", "list<str>", "shell sessions whose $RANDOM was re-seeded", True),
            F("shells_pending", "list<str>", "busy sessions, re-seeded before their next command", True),
            F("actions", "list<str>", "privileged steps recorded instead of done (see simulated)", True),
            _SIMULATED,
            F("instance_id", "str", "guestd's regenerated instance id", True),
            F("hostname", "str?", "done | simulated, when a hostname was given"),
            F("machine_id", "str?", "done | simulated, when a sandbox id was given (/etc/machine-id)"),
            F("reseed_errors", "list<str>", "contexts or sessions that could not be re-seeded", True),
            F("crng_ms", "float", "time of the CRNG re-seed", True),
            F(
                "workloads_ms",
                "float",
                "time re-seeding kernels and shells took (overlaps the generation file, the thaw and the signals)",
                True,
            ),
            F("duration_s", "float", "time the restore took in the guest", True),
            F("thawed", "bool", "a freeze of snapshot.prepare was lifted (after the CRNG re-seed)", True),
            F("generation_file", "str", "the file the workload reads the generation and identity from", True),
            F(
                "signalled",
                "list<uint>",
                "pids of workload processes started with GUESTD_ON_RESTORE that were sent their signal",
                True,
            ),
        ),
        errors=("stale", "bad_request", "permission_denied"),
    ),
)

# A relay stream (port.connect, port.accept): TCP bytes both ways under the request's credit.
_RELAY_EVENTS = (
    F(
        "ev",
        "enum(connected|data|eof)",
        "connected: the TCP connection is up; data: bytes from it; eof: it sent FIN",
        True,
    ),
    F("data", "bin", "data: the next bytes the guest socket delivered (counts against the credit)"),
)
_RELAY_INPUT = (
    F("data", "bin", "bytes to write to the guest socket (counts against the credit)"),
    F("eof", "bool", "half-close: shut down the guest socket's write side after the data before it"),
)
_RELAY_RESULT = (
    F("sent", "uint", "bytes written to the guest socket", True),
    F("received", "uint", "bytes read from the guest socket", True),
)
_CHUNK = F("chunk", "uint?", "most bytes per data event; default limits.max_chunk", ge=1, le_limit="max_chunk")
_GUEST_ADDRESS = F(
    "address",
    "str",
    "an IP literal of the guest's own (127.0.0.1, ::1, an address of one of its interfaces)",
    default="127.0.0.1",
)

_WANTED_PORTS = F(
    "ports",
    "list<uint>?",
    "only listeners on these ports (at most 1024, each 1..65535); nil: every port",
)
_LISTING = (
    F("listeners", "list<listener>", "listening sockets, by port, then address: at most 4096", True),
    F("total", "uint", "listening sockets found (on ports), listed or not; absent from an older guestd"),
    F(
        "truncated",
        "bool",
        "more sockets were found than listed (the highest ports are left out); absent from an older guestd, "
        "which cut at 4096 without saying",
    ),
    F(
        "owners_truncated",
        "bool",
        "the search for the processes holding them stopped at its budget (32,768 descriptors): a listener "
        "without pid may have one",
    ),
)

PORT_OPS: tuple[OpSpec, ...] = (
    OpSpec(
        "port.connect",
        "port",
        "Open a TCP connection to a port in the guest and relay its bytes: INPUT data is written to it, "
        "its bytes come back as data events, both under the request's credit; eof half-closes either way. "
        "Ends with a RESPONSE once both directions have ended (section 5.1).",
        args=(
            F("port", "uint", "guest TCP port", True, ge=1, le=65535),
            _GUEST_ADDRESS,
            F("connect_timeout_s", "float", "give up connecting after this long (timeout)", default=10.0, gt=0, le=300),
            _CHUNK,
        ),
        result=_RELAY_RESULT,
        events=_RELAY_EVENTS,
        input=_RELAY_INPUT,
        errors=("unavailable", "timeout", "permission_denied", "limit", "io_error", "bad_request"),
    ),
    OpSpec(
        "port.reverse",
        "port",
        "Guest -> host forward (off unless the config enables it): listen on a guest port; each connection "
        "to it is announced with an accepted event and waits (at most accept_timeout_s, at most "
        "limits.max_port_pending at once) for the host to claim it with port.accept. input eof stops listening.",
        args=(
            F("port", "uint", "guest TCP port to listen on; 0 picks a free one", True, le=65535),
            F("address", "str", "guest address to listen on", default="127.0.0.1"),
            F(
                "accept_timeout_s",
                "float",
                "how long an announced connection waits to be claimed",
                default=10.0,
                gt=0,
                le=300,
            ),
        ),
        result=(F("accepted", "uint", "connections announced", True),),
        events=(
            F(
                "ev",
                "enum(listening|accepted)",
                "listening: the guest port is open; accepted: a connection waits",
                True,
            ),
            F("forward", "str", "listening: the forward's id, for port.accept"),
            F("port", "uint", "listening: the guest port"),
            F("conn", "uint", "accepted: the connection's number, for port.accept"),
        ),
        input=(F("eof", "bool", "stop listening; the request then answers"),),
        errors=("permission_denied", "limit", "exists", "io_error", "bad_request"),
    ),
    OpSpec(
        "port.accept",
        "port",
        "Claim a connection a port.reverse of this connection announced and relay it exactly like port.connect "
        "(connected event first); refuse resets it instead.",
        args=(
            F("forward", "str", "the forward's id (its listening event)", True),
            F("conn", "uint", "the connection's number (its accepted event)", True),
            F("refuse", "bool", "reset the guest connection (the host could not reach its destination)", default=False),
            _CHUNK,
        ),
        result=_RELAY_RESULT,
        events=_RELAY_EVENTS,
        input=_RELAY_INPUT,
        errors=("not_found", "limit", "io_error"),
    ),
    OpSpec(
        "port.list",
        "port",
        "The guest's listening TCP sockets (IPv4 and IPv6), one record per socket, with the process holding "
        "each: at most 4096 (the lowest ports), total counts them all and truncated says the list was cut; "
        "ports asks about those ports only (whole however many listeners the others have).",
        args=(_WANTED_PORTS,),
        result=_LISTING,
        errors=("bad_request",),
    ),
    OpSpec(
        "port.watch",
        "port",
        "Long poll: answer as soon as the set of listening sockets differs from the one the digest names "
        "(at once without a digest), or after timeout_s with changed false.",
        args=(
            F("digest", "str?", "the digest of the last reply; nil answers at once, with changed true"),
            F("timeout_s", "float", "longest wait for a change", default=30.0, ge=0, le=3600),
            F(
                "interval_s",
                "float",
                "how often the guest looks (at least ten times as long as one look takes)",
                default=0.25,
                ge=0.02,
                le=60,
            ),
            _WANTED_PORTS,
        ),
        result=(
            F("digest", "str", "names the whole set of listeners (of ports), also what the list leaves out", True),
            F("changed", "bool", "the set differs from the digest sent (true when none was sent)", True),
            *_LISTING,
        ),
        errors=("bad_request",),
    ),
    OpSpec(
        "port.wait",
        "port",
        "Wait until a guest port accepts connections (with http, until GET path answers 2xx or 3xx), "
        "at most timeout_s.",
        args=(
            F("port", "uint", "guest TCP port", True, ge=1, le=65535),
            _GUEST_ADDRESS,
            F("timeout_s", "float", "deadline", default=30.0, ge=0, le_limit="max_exec_timeout_s"),
            F("http", "bool", "also require an HTTP GET to answer 2xx or 3xx", default=False),
            F("path", "str", "the GET's path", default="/"),
        ),
        result=(
            F("ready", "bool", "the port accepted (and answered) before the deadline", True),
            F("elapsed_s", "float", "time waited", True),
            F("http_status", "int?", "status of the last GET, when http"),
        ),
        errors=("permission_denied", "bad_request"),
    ),
)

# --------------------------------------------------------------------------- workspace
# Trees, search, edit and the change feed: capability "files", built on its file-system layer
# (PROTOCOL.md section 8.1).

RECORDS.update(
    {
        "write_item": (
            _TARGET_PATH,
            F("data", "bin", "content", True),
            F("perm", "uint?", "permission bits of a new file (default 0o644; a replaced file keeps its own)"),
        ),
        "patched_file": (
            F("path", "path", "the file, relative to the patch's directory", True),
            F("action", "enum(modify|create|delete)", "what the patch did to it", True),
            F("hunks", "uint", "hunks applied", True),
        ),
        "change_report": (
            F("created", "list<path>", "paths created (relative to the workspace), sorted", True),
            F("modified", "list<path>", "paths whose content or metadata changed, sorted", True),
            F("deleted", "list<path>", "paths deleted, sorted", True),
            F("total", "uint", "changed paths in all, listed or not", True),
            F("truncated", "bool", "more than the lists hold (limits: 1000 paths per list)", True),
            F(
                "overflow",
                "bool",
                "changes may be missing, rescan: the kernel's event queue or guestd's bounded backlog overflowed, "
                "a directory past the watcher's bounds is not followed, or the watcher ended",
                True,
            ),
        ),
    }
)

_EDITED_FILE = F("path", "path", "the file", True)
_EDIT_RESULT = (
    F("size", "uint", "file size after the edit", True),
    F(
        "snippet",
        "str",
        "the changed lines of the new content with 4 lines of context, numbered like cat -n (a deletion: the line "
        "now at start_line with 4 either side; undo: the lines the undo changed, found as the bytes between the "
        "two contents' common prefix and suffix; empty for an empty file)",
        True,
    ),
    F("start_line", "uint", "line number of the snippet's first line", True),
    F("undo_depth", "uint", "edits of this file that file.undo can now revert", True),
)
_EDIT_ERRORS = (
    "not_found",
    "conflict",
    "is_a_directory",
    "not_a_file",
    "permission_denied",
    "too_large",
    "bad_request",
    "no_space",
)
_TIMEOUT_S = F("timeout_s", "float", "deadline: the reply then says what was done in time", default=30.0, gt=0, le=3600)

WORKSPACE_OPS: tuple[OpSpec, ...] = (
    OpSpec(
        "file.view",
        "files",
        "A file's lines with line numbers (cat -n), or a directory listed two levels deep (hidden names left out).",
        args=(
            F("path", "path", "file or directory", True),
            F(
                "start_line",
                "uint?",
                "first line (1-based); nil: 1. Past the last line (or after end_line) is bad_request naming "
                "start_line (details.total_lines); any range of an empty file shows nothing",
                ge=1,
            ),
            F("end_line", "uint?", "last line, inclusive; nil or past the last line: the last line", ge=1),
        ),
        result=(
            F("kind", "enum(file|dir)", "what the path is", True),
            F(
                "content",
                "str",
                "numbered lines (file: each ends with a newline, a last line without one too) or one path per line "
                "(dir: each line ends with a newline, directories with / before it)",
                True,
            ),
            F("start_line", "uint?", "file: first line shown (0 for an empty file)"),
            F("end_line", "uint?", "file: last line shown"),
            F("total_lines", "uint?", "file: lines in the file"),
            F("truncated", "bool", "less than asked for was shown (256 KiB of content, 2000 entries)", True),
        ),
        errors=("not_found", "not_a_file", "permission_denied", "too_large", "bad_request"),
    ),
    OpSpec(
        "file.str_replace",
        "files",
        "Replace the one occurrence of old with new (an atomic replace that keeps owner and mode). old must occur "
        "exactly once: else conflict with details.reason no_match or multiple_matches, details.matches and "
        "details.lines (the line of each match, at most 100).",
        args=(
            _EDITED_FILE,
            F("old", "str", "text to replace, matched exactly (bytes of its UTF-8)", True, min_len=1),
            F("new", "str", "replacement (may be empty)", True),
        ),
        result=_EDIT_RESULT,
        errors=_EDIT_ERRORS,
    ),
    OpSpec(
        "file.insert",
        "files",
        "Insert text as whole lines after line (0: at the top); a newline is added to text that lacks one. A line "
        "beyond the file is bad_request naming line (details.total_lines).",
        args=(
            _EDITED_FILE,
            F("line", "uint", "insert after this line (0..lines in the file)", True),
            F("text", "str", "the lines to insert", True),
        ),
        result=_EDIT_RESULT,
        errors=_EDIT_ERRORS,
    ),
    OpSpec(
        "file.replace_lines",
        "files",
        "Replace lines start_line..end_line (inclusive) with text as whole lines; empty text deletes them.",
        args=(
            _EDITED_FILE,
            F("start_line", "uint", "first line replaced (1-based)", True, ge=1),
            F("end_line", "uint", "last line replaced, >= start_line", True, ge=1),
            F("text", "str", "the new lines", True),
        ),
        result=_EDIT_RESULT,
        errors=_EDIT_ERRORS,
    ),
    OpSpec(
        "file.undo",
        "files",
        "Revert the last edit (file.str_replace, insert, replace_lines) of this file, byte for byte. Refused "
        "with conflict (details.reason no_history, changed_since) when there is none or the file changed since; "
        "a missing file is not_found.",
        args=(_EDITED_FILE,),
        result=_EDIT_RESULT,
        errors=_EDIT_ERRORS,
    ),
    OpSpec(
        "file.apply_patch",
        "files",
        "Apply a unified diff (diff -u, git diff) to files under path, all or nothing: every hunk must apply "
        "(at its line, or where its context occurs once) or nothing changes and the error is conflict with "
        "details.hunks, one report per failed hunk. A patch that does not parse (no --- / +++ headers, a "
        "malformed @@ line, a file without hunks, a name with .. or absolute) is bad_request naming patch.",
        args=(
            F("path", "path", "directory the patch's file names are relative to", True),
            F("patch", "bin", "the diff", True, min_len=1),
            F("strip", "uint", "leading path components to drop from names (patch -p)", default=1, le=32),
        ),
        result=(F("files", "list<patched_file>", "each file changed, in patch order", True),),
        errors=(
            "conflict",
            "bad_request",
            "not_found",
            "not_a_file",
            "permission_denied",
            "too_large",
            "exists",
            "limit",
        ),
    ),
    OpSpec(
        "file.glob",
        "files",
        "Paths under path that match pattern, one glob read as file.grep's globs are (ripgrep's --glob): "
        "without / it matches a name at any depth, with / it is anchored at path, ** crosses directories, "
        "a trailing / matches directories only; sorted by bytes, at most max_results. Symlinks are listed, "
        "never followed. Matching takes time linear in the path and the glob, and timeout_s covers it.",
        args=(
            F("path", "path", "directory to search", True),
            F(
                "pattern",
                "str",
                "e.g. *.py (any depth), src/**/*.py, /*.py (the top only); blank, # or ! patterns and ones "
                "that do not compile are bad_request",
                True,
                min_len=1,
            ),
            F("gitignore", "bool", "leave out what .gitignore files in the tree ignore", default=False),
            F("hidden", "bool", "include names starting with a dot", default=True),
            F("max_results", "uint", "most paths returned", default=10_000, ge=1, le=1_000_000),
            _TIMEOUT_S,
        ),
        result=(
            F("paths", "list<path>", "matching paths relative to path, sorted by bytes", True),
            F("total", "uint", "matching paths found, returned or not", True),
            F("truncated", "bool", "total > max_results, or the walk stopped at a bound (see bound)", True),
            F(
                "bound",
                "enum(entries|depth|deadline)?",
                "the bound that stopped the walk early (depth: also a directory not entered because the "
                ".gitignore rules along its path are too costly to hold)",
            ),
        ),
        errors=("not_found", "not_a_directory", "permission_denied", "bad_request"),
    ),
    OpSpec(
        "file.grep",
        "files",
        "Search file contents under path line by line, streaming one event per matching or context line within "
        "the request's credit. Files are walked as ripgrep walks them (symlinks not followed, .git left out, "
        "overrides, .gitignore, hidden); binary files (a NUL byte) are skipped. Always ripgrep (rg), run as a "
        "workload process: in a run cgroup under the workload's limits, as the workload user (nobody when guestd is "
        "root without one), killed at timeout_s or when the request is cancelled; a guest without rg answers "
        "unavailable (details.reason no_rg).",
        args=(
            F("path", "path", "directory (or file) to search", True),
            F(
                "pattern",
                "str",
                "a regex in ripgrep's syntax (Rust regex: linear time, no look-around or backreferences; one it "
                "refuses is bad_request with rg's message) or a literal",
                True,
                min_len=1,
            ),
            F("literal", "bool", "pattern is a fixed string", default=False),
            F("ignore_case", "bool", "case-insensitive", default=False),
            F("globs", "list<str>", "ripgrep --glob filters: glob includes, !glob excludes", default=[]),
            F("context", "uint", "lines of context before and after each match", default=0, le=100),
            F("max_matches", "uint", "stop after this many matching lines", default=1000, ge=1, le=1_000_000),
            F("gitignore", "bool", "respect .gitignore files in the tree", default=True),
            F("hidden", "bool", "search names starting with a dot", default=False),
            F(
                "engine",
                "enum(auto|rg)",
                "both mean ripgrep, the only engine (the Python engine was removed: one regex dialect everywhere)",
                default="auto",
            ),
            _TIMEOUT_S,
        ),
        result=(
            F("matches", "uint", "matching lines sent", True),
            F("files", "uint", "files with a match", True),
            F("truncated", "bool", "max_matches was reached", True),
            F("timed_out", "bool", "timeout_s passed: the events sent are what was found in time", True),
            F("engine", "enum(rg)", "what searched: always rg", True),
        ),
        events=(
            F("ev", "enum(match|context)", "a matching line, or a context line around one", True),
            F("path", "path", "the file, relative to path (its name when path is a file)", True),
            F("line", "uint", "line number (1-based)", True),
            F("data", "bin", "the line and a newline, at most 4096 bytes (never empty; counts against credit)"),
            F(
                "truncated",
                "bool",
                "the line was longer than 4096 bytes: data is its start; a match anywhere in it is still reported",
            ),
        ),
        errors=("not_found", "permission_denied", "bad_request", "unavailable", "limit", "io_error"),
    ),
    OpSpec(
        "file.write_many",
        "files",
        "Write several files in one request: every file goes to a temp file first, then all are renamed into "
        "place; if any cannot be prepared, none is written.",
        args=(
            F(
                "files",
                "list<write_item>",
                "the files (at most 256; together they fit one request frame, limits.max_frame)",
                True,
                min_len=1,
            ),
            _PARENTS,
        ),
        result=(F("written", "uint", "files written", True), F("bytes", "uint", "bytes written", True)),
        errors=("not_found", "is_a_directory", "not_a_directory", "permission_denied", "no_space", "too_large"),
    ),
    OpSpec(
        "tree.upload",
        "files",
        "Stream a tar archive (ustar, GNU or pax) into a new directory path: INPUT data under the request's credit, "
        "then eof. Extracted into a hidden temp directory beside path and renamed into place when complete; "
        "any failure removes it (nothing half-extracted is left). Absolute names, .., links pointing out, hard "
        "links, devices and FIFOs are bad_request with details.entry naming the entry.",
        args=(
            F("path", "path", "the directory to create", True),
            F(
                "replace",
                "bool",
                "replace an existing directory (swapped atomically, the old tree then removed)",
                default=False,
            ),
            _PARENTS,
        ),
        result=(
            F(
                "entries",
                "uint",
                "archive entries applied, each counted as it comes: a . entry (its mode and mtime go to path "
                "itself) and an entry a later one of the same name replaced included, a directory made only "
                "because an entry lies below it not",
                True,
            ),
            F("bytes", "uint", "file bytes written", True),
        ),
        input=(F("data", "bin", "next bytes of the tar stream"), F("eof", "bool", "the archive is complete")),
        errors=("bad_request", "exists", "not_found", "permission_denied", "no_space", "limit"),
    ),
    OpSpec(
        "tree.download",
        "files",
        "Stream a directory out as a pax tar archive (data events under the request's credit): files, "
        "directories and symlinks (as symlinks, never followed), with modes and mtimes; FIFOs, sockets and "
        "devices are left out and counted.",
        args=(
            F("path", "path", "the directory", True),
            F("include", "list<str>", "ripgrep-style globs: only matching files (directories are walked)", default=[]),
            F("exclude", "list<str>", "globs left out (with everything below a directory that matches)", default=[]),
            F("gitignore", "bool", "leave out what .gitignore files ignore", default=False),
            _CHUNK,
        ),
        result=(
            F(
                "entries",
                "uint",
                "entries archived; the archive has no entry for path itself (names are relative to it, without ./)",
                True,
            ),
            F("bytes", "uint", "tar bytes sent", True),
            F("skipped", "uint", "entries left out: special files, unreadable or vanished ones", True),
        ),
        events=(F("ev", "enum(data)", "event type", True), F("data", "bin", "next bytes of the archive")),
        errors=("not_found", "not_a_directory", "permission_denied"),
    ),
    OpSpec(
        "file.watch",
        "files",
        "Watch a directory tree (inotify) until cancelled: one event per changed path, its relative path as data "
        "under the request's credit, changes to one path coalesced while credit is out, new directories followed "
        "(what a directory made or moved in from outside holds is reported as created; a directory moved within "
        "the tree is one change at each end; onto an existing directory's name, that name is deleted then "
        "created), guestd's own temp names never reported, and an overflow event "
        "(never silence) when changes were lost. A watcher that fails ends the watch with unavailable.",
        args=(
            F("path", "path", "directory to watch", True),
            F("include", "list<str>", "globs: only matching files are reported", default=[]),
            F("exclude", "list<str>", "globs left out", default=[]),
            F(
                "latency_s",
                "float",
                "changes to one path within this window become one event",
                default=0.05,
                ge=0,
                le=10,
            ),
        ),
        final=ERROR_ONLY,
        events=(
            F(
                "ev",
                "enum(ready|change|overflow)",
                "ready: the watch is set up; overflow: changes were lost, rescan (at most one a second)",
                True,
            ),
            F("kind", "enum(created|modified|deleted)", "change: what happened to the path"),
            F("dir", "bool", "change: the path is a directory"),
            F("data", "bin", "change: the path relative to path, as bytes"),
        ),
        errors=("not_found", "not_a_directory", "permission_denied", "limit", "unavailable"),
    ),
    OpSpec(
        "file.changes",
        "files",
        "Paths changed under the workspace since cursor (the workspace's change journal, started by the first "
        "call). Without cursor, answers at once with the current cursor and an empty report. Without a "
        "workspace in the config: unavailable, details.reason no_workspace.",
        args=(F("cursor", "uint?", "the cursor of a previous reply"),),
        result=(
            F("cursor", "uint", "pass it to the next call", True),
            F("changes", "change_report", "what changed since cursor", True),
        ),
        errors=("unavailable", "bad_request"),
    ),
)

METRICS_OPS: tuple[OpSpec, ...] = (
    OpSpec(
        "metrics",
        "metrics",
        "Guest-wide and workload-cgroup figures: CPU % over a window, memory, disks, processes, PSI, OOM kills. "
        "One sample (two readings interval_ms apart), or with stream a sample EVENT every interval_ms until "
        "count samples, a cancel or the connection's end (the first interval_ms after the request, over that "
        "window; none at once); an oom EVENT comes before a sample whenever the workload cgroup's OOM kill count "
        "grew since the one before (never before the first).",
        args=(
            F("interval_ms", "uint", "the window CPU % is measured over, and a stream's period", default=200, le=60000),
            F("stream", "bool", "send samples as EVENT frames (interval_ms >= 100)", default=False),
            F("count", "uint?", "stream: stop after this many samples (nil: until cancelled)", ge=1),
        ),
        result=(
            F("sample", "metrics_sample?", "the sample (nil when streamed)"),
            F("samples", "uint", "samples taken: 1 without stream, the sample events sent with it", True),
        ),
        events=(
            F("ev", "enum(sample|oom)", "event type", True),
            F("sample", "metrics_sample", "sample: the figures"),
            F("oom_kills", "uint", "oom: the workload cgroup's OOM kill count now"),
            F("new", "uint", "oom: kills since the previous sample"),
        ),
        errors=("bad_request",),
        events_when=("stream",),
    ),
)

# --------------------------------------------------------------------------- kept runs
# shell.run / code.run {keep: true}: capability "process" (PROTOCOL.md 10.4).

_RUN_ID = F("id", "str", "run id (the kept event's run_id)", True)
_RUN = F("run", "run_info", "the run", True)

RECORDS.update(
    {
        "run_info": (
            F("id", "str", "run id", True),
            F("op", "str", "the op that was kept: shell.run or code.run", True),
            F("target", "str", "the shell session or code context it ran in", True),
            F("what", "str", "the command or cell (at most 200 characters)", True),
            F("state", "enum(running|done|failed)", "done: result holds the op's reply; failed: error", True),
            F("started_at", "float", "wall clock, s since the epoch", True),
            F("ended_at", "float?", "wall clock when it ended"),
            F(
                "result",
                "map?",
                "run.get/run.wait of a done run: the op's reply exactly as it would have been sent, without run_id "
                "(run_info carries it as id)",
            ),
            F("error", "map?", "failed: {code, message, details} as the op's error would have been"),
        ),
    }
)

RUN_OPS: tuple[OpSpec, ...] = (
    OpSpec(
        "run.get",
        "process",
        "A kept run with its result or error once it has ended.",
        args=(_RUN_ID,),
        result=(_RUN,),
        errors=("not_found",),
    ),
    OpSpec(
        "run.wait",
        "process",
        "Wait up to timeout_s for a kept run to end; the run as run.get gives it (state running when it has not).",
        args=(
            _RUN_ID,
            F("timeout_s", "float", "how long to wait", default=30.0, ge=0, le_limit="max_exec_timeout_s"),
        ),
        result=(_RUN,),
        errors=("not_found",),
    ),
    OpSpec(
        "run.list",
        "process",
        "Every kept run, oldest first (no results).",
        result=(F("runs", "list<run_info>", "the runs", True),),
    ),
    OpSpec(
        "run.cancel",
        "process",
        "Cancel a running kept run as a cancel of its request would have before it was kept (a shell "
        "command is interrupted, a cell's kernel too); waits up to timeout_s for it to end, then the run "
        "as run.get gives it (failed with error cancelled, details.run). A run that has ended is returned as it "
        "is. A kept request still in flight then ends with error cancelled, details.reason cancel, as if its "
        "client had cancelled it.",
        args=(
            _RUN_ID,
            F("timeout_s", "float", "how long to wait for the run to end", default=10.0, ge=0, le=60.0),
        ),
        result=(_RUN,),
        errors=("not_found",),
    ),
)

OPS = OPS + CODE_OPS + PROCESS_OPS + SHELL_OPS + SNAPSHOT_OPS + PORT_OPS + WORKSPACE_OPS + METRICS_OPS + RUN_OPS
OPS_BY_NAME = {op.name: op for op in OPS}


def _check_record_groups() -> None:
    for name, fields in RECORDS.items():
        groups_of(f"record {name}", fields)


_check_record_groups()


def schema_document() -> dict[str, Any]:
    from guestd.wire.frames import DEFAULT_MAX_FRAME, FRAME_VERSION, HEADER_SIZE, MAGIC, Kind

    return {
        "protocol_version": PROTOCOL_VERSION,
        "frame": {
            "header_size": HEADER_SIZE,
            "layout": ["magic:2", "frame_version:u8", "kind:u8", "length:u32be", "id:u32be"],
            "magic_hex": MAGIC.hex(),
            "frame_version": FRAME_VERSION,
            "default_max_frame": DEFAULT_MAX_FRAME,
            "payload": "one msgpack map (str keys); bin for bytes; str is UTF-8",
        },
        "kinds": {k.name.lower(): int(k) for k in Kind},
        "messages": {
            "hello_client": {f.name: f.to_json() for f in HELLO_CLIENT},
            "hello_server": {f.name: f.to_json() for f in HELLO_SERVER},
            "request": {
                "op": {"type": "str", "required": True, "doc": "op name"},
                "args": {"type": "map", "required": False, "doc": "op arguments (see ops)"},
            },
            "error": {f.name: f.to_json() for f in ERROR_BODY},
            "window": {f.name: f.to_json() for f in WINDOW_BODY},
            "cancel": {},
        },
        "error_codes": [c.value for c in ErrorCode],
        "records": {name: {f.name: f.to_json() for f in fields} for name, fields in RECORDS.items()},
        "ops": {op.name: op.to_json() for op in OPS},
    }


def schema_json() -> str:
    import json

    return json.dumps(schema_document(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    sys.stdout.write(schema_json())
