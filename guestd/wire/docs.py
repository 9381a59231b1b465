"""Render the op reference of protocol/PROTOCOL.md from the schema.

``python -m guestd.wire.docs`` rewrites the block between the AUTO markers; a
test fails when the checked-in block differs, so the prose never drifts from
what the daemon validates.
"""

from __future__ import annotations

import os
import sys

from guestd.wire.schema import ERROR_ONLY, OPS, RECORDS, F

BEGIN = "<!-- BEGIN AUTO: op reference (python -m guestd.wire.docs) -->"
END = "<!-- END AUTO -->"


def _default(f: F) -> str:
    if f.required:
        return "required"
    if f.default is None:
        return "nil"
    if isinstance(f.default, bool):
        return str(f.default).lower()
    if f.name == "perm":
        return oct(f.default)
    return f"`{f.default!r}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")  # a bare | would split a markdown table cell


def _meaning(f: F) -> str:
    rule = f.constraint_text()
    return f"{f.doc} ({rule})" if rule and f.doc else (f.doc or rule)


def _table(title: str, fields: tuple[F, ...], with_default: bool) -> list[str]:
    if not fields:
        return []
    out = [f"*{title}*", ""]
    if with_default:
        out += ["| field | type | default | meaning |", "|---|---|---|---|"]
        out += [f"| `{f.name}` | `{_cell(f.type)}` | {_default(f)} | {_cell(_meaning(f))} |" for f in fields]
    else:
        out += ["| field | type | meaning |", "|---|---|---|"]
        out += [
            f"| `{f.name}` | `{_cell(f.type)}`{'' if f.required else ' (optional)'} | {_cell(f.doc)} |" for f in fields
        ]
    return [*out, ""]


def _too_many(group: tuple[str, ...]) -> str:
    if len(group) == 2:
        return f"both given: `bad_request` with `details.field` = `{group[1]}`"
    return "more than one given: `bad_request` with `details.field` naming the second of them, in this order"


def op_reference() -> str:
    lines: list[str] = []
    for op in OPS:
        lines += [f"### `{op.name}` ({op.capability})", "", op.doc, ""]
        lines += _table("args", op.args, True) or ["*args*: none", ""]
        if op.final == ERROR_ONLY:
            lines += [
                "*result*: none (`final: error_only`): never a RESPONSE; the request runs until cancelled "
                "and ends only with an ERROR (`cancelled` on cancel, or the error that stopped it)",
                "",
            ]
        else:
            lines += _table("result (RESPONSE)", op.result, False) or ["*result*: empty map", ""]
        lines += _table("events (EVENT)", op.events, False)
        if op.events_when:
            names = " or ".join(f"`{n}`" for n in op.events_when)
            lines += [f"*events only when* {names} is true (`events_when`); otherwise none at all", ""]
        lines += _table("input (INPUT)", op.input, False)
        # The field a violation names, as schema.validate_args picks it: none given, the group's
        # first; more than one, the second of those given, in the group's order.
        for group in op.one_of:
            lines += [
                "*exactly one of*: "
                + ", ".join(f"`{n}`" for n in group)
                + f" (none given: `bad_request` with `details.field` = `{group[0]}`; {_too_many(group)})",
                "",
            ]
        for group in op.exclusive:
            lines += ["*at most one of*: " + ", ".join(f"`{n}`" for n in group) + f" ({_too_many(group)})", ""]
        if op.errors:
            lines += ["*typical errors*: " + ", ".join(f"`{e}`" for e in op.errors), ""]
    lines += ["### Records", "", "Named map types used by the fields above (`NAME` or `list<NAME>`).", ""]
    for name, fields in RECORDS.items():
        lines += _table(f"`{name}`", fields, False)
    return "\n".join(lines).rstrip() + "\n"


def render_into(text: str) -> str:
    a = text.index(BEGIN) + len(BEGIN)
    b = text.index(END)
    return text[:a] + "\n\n" + op_reference() + "\n" + text[b:]


def protocol_md_path() -> str:
    return os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "protocol", "PROTOCOL.md"
    )


if __name__ == "__main__":
    path = sys.argv[1] if len(sys.argv) > 1 else protocol_md_path()
    with open(path) as f:
        new = render_into(f.read())
    with open(path, "w") as f:
        f.write(new)
