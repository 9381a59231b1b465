"""Client drivers for the transcripts of kept runs, code contexts, shell sessions, background
processes, snapshots, ports and refused hellos (``runs_*``, ``keep_*``, ``code_*``, ``shell_*``,
``process_*``, ``snapshot_*``, ``ports_*``, ``auth_*``).

Each driver makes guestd's :class:`~guestd.client.AsyncClient` send the client frames of its
transcript, in the transcript's order: one call per request, and the requests a transcript sends
in one write started together (:func:`together`). An error the transcript expects in the middle
is checked where it comes (:func:`refused`); the driver returns the last call's result, or lets
the last call's error propagate when the transcript ends with one.

Transcripts a driver cannot produce are left out, with the reason:

Requests the typed methods never send (``process.start {}``, ``run.get {}``, ``shell.run`` with
``keep`` and ``stream`` together, ``port.watch`` without its ``timeout_s``) go through
:meth:`AsyncClient.call`.
- ``ports_reverse_accept``: guestd's :meth:`AsyncClient.reverse_forward` claims each announced
  connection by itself, concurrently with whatever the caller does, and refuses only when its host
  destination is down: the order of its frames against the transcript's other requests, and the
  connection numbers it claims, are not the caller's to fix (a server test for the relay).
- ``auth_token_wrong`` pipelines a request behind the refused hello, which the client never does
  (``auth_token_missing`` has a driver, but its refusal comes in connect, before the driver runs).
- ``auth_peer_refused``: a server test (no client frame at all).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any

from guestd.client import AsyncClient
from guestd.client.runs import start_kept
from guestd.wire.errors import GuestdError
from tests.conformance_calls import CallContext, ClientCall


def now_ns() -> int:
    """The host clock a restore or clock.check carries: a day ahead of this one, so a guestd with
    simulated privileged steps reports the clock set (the transcripts: {"$now_ns": 86400000000000})."""
    return time.time_ns() + 86_400 * 10**9


async def refused(call: Awaitable[object], code: str, **details: object) -> GuestdError:
    """The typed error ``call`` must fail with (its code and the details the transcript lists)."""
    try:
        await call
    except GuestdError as e:
        assert e.code == code, f"expected {code}, got {e.code}: {e.message}"
        for key, value in details.items():
            assert (e.details or {}).get(key) == value, f"details.{key}: {e.details}"
        return e
    raise AssertionError(f"expected error {code}, the call succeeded")


async def together(*calls: Awaitable[Any]) -> list[Any]:
    """Start the calls at once, in order (their requests go out in that order): results and
    errors, as the transcript's one write of several requests gets them."""
    return list(await asyncio.gather(*calls, return_exceptions=True))


def expect_codes(results: list[Any], *codes: str | None) -> None:
    """``codes[i]`` is the error code results[i] must be (None: a result, not an error)."""
    for got, code in zip(results, codes, strict=True):
        if code is None:
            assert not isinstance(got, BaseException), got
        else:
            assert isinstance(got, GuestdError) and got.code == code, got


# ------------------------------------------------------------------------- kept runs (10.4)


async def keep_shell_run(c: AsyncClient, ctx: CallContext) -> object:
    shell = await c.shell_create()
    result = await c.shell_run(shell.id, "echo kept", keep=True)
    assert result.run_id is not None and result.stdout == b"kept\n"
    run = await c.run_get(result.run_id)
    assert run.state == "done" and run.target == shell.id
    expect_codes(
        await together(
            c.call("shell.run", {"id": shell.id, "command": "echo x", "keep": True, "stream": True}),
            c.call("shell.run", {"id": shell.id, "command": "echo x", "keep": True, "pty": True}),
        ),
        "bad_request",
        "bad_request",
    )
    await c.shell_close(shell.id)
    return None


async def shell_run_nul(c: AsyncClient, ctx: CallContext) -> object:
    shell = await c.shell_create()
    expect_codes(await together(c.shell_run(shell.id, f"touch {ctx.tmp}/nul-ran\0; echo rest")), "bad_request")
    ran = await c.shell_run(shell.id, f"test -e {ctx.tmp}/nul-ran && echo ran || echo nothing")
    assert ran.stdout == b"nothing\n"
    await c.shell_close(shell.id)
    return None


async def runs_get_wait_list(c: AsyncClient, ctx: CallContext) -> object:
    shell = await c.shell_create()
    run_id = await start_kept(c, "shell.run", {"id": shell.id, "command": "sleep 1; echo late"})
    assert (await c.run_get(run_id)).state == "running"
    assert (await c.run_wait(run_id, timeout_s=0.1)).state == "running"
    done = await c.run_wait(run_id, timeout_s=10.0)
    assert done.state == "done" and done.result is not None
    assert any(r.id == run_id for r in await c.run_list())
    await c.shell_close(shell.id)
    return done


async def runs_cancel(c: AsyncClient, ctx: CallContext) -> object:
    shell = await c.shell_create()
    run_id = await start_kept(c, "shell.run", {"id": shell.id, "command": "sleep 30"})
    assert (await c.run_get(run_id)).state == "running"
    cancelled = await c.run_cancel(run_id, timeout_s=10.0)
    assert cancelled.state == "failed" and (cancelled.error or {}).get("code") == "cancelled"
    assert (await c.shell_run(shell.id, "echo after")).stdout == b"after\n"
    again = await c.run_cancel(run_id, timeout_s=10.0)
    assert again.state == "failed"
    await c.shell_close(shell.id)
    return again


async def runs_errors(c: AsyncClient, ctx: CallContext) -> object:
    results = await together(
        c.run_get("r-none"),
        c.run_wait("r-none", timeout_s=0.0),
        c.run_cancel("r-none", timeout_s=0.0),
        c.run_list(),
        c.call("run.get", {}),
        c.call("run.cancel", {"id": "r-none", "timeout_s": 61.0}),
    )
    expect_codes(results, "not_found", "not_found", "not_found", None, "bad_request", "bad_request")
    raise results[-1]


# ------------------------------------------------------------------------- code contexts (9)


async def code_lifecycle(c: AsyncClient, ctx: CallContext) -> object:
    context = await c.code_create(name="code_lifecycle")
    ran = await c.code_run("x = 6 * 7\nprint(x)\nx", context=context.id)
    assert ran.status == "ok" and ran.stdout == b"42\n"
    failed = await c.code_run("1/0", context=context.id)
    assert failed.status == "error" and failed.error is not None and failed.error.ename == "ZeroDivisionError"
    assert (await c.code_create(name="code_lifecycle")).existing
    assert any(x.id == context.id for x in await c.code_list())
    await c.code_close(context.id)
    await refused(c.code_run("x", context=context.id), "not_found")
    await c.code_close(context.id)
    return None


async def code_stream_interrupt_restart(c: AsyncClient, ctx: CallContext) -> object:
    context = await c.code_create()
    first = c.code_run_stream('y = 1\nprint("a")\ny + 1', context=context.id)
    async for _ in first:
        pass
    assert (await first.result()).status == "ok"
    sleeper = c.code_run_stream('import time\nprint("sleeping", flush=True)\ntime.sleep(30)', context=context.id)
    events = aiter(sleeper)
    assert await anext(events) == ("stdout", b"sleeping\n")
    await c.code_interrupt(context.id)
    async for _ in events:
        pass
    assert (await sleeper.result()).status == "interrupted"
    await c.code_restart(context.id)
    after = await c.code_run("y", context=context.id)
    assert after.status == "error" and after.error is not None and after.error.ename == "NameError"
    await c.code_close(context.id)
    return None


async def keep_code_run(c: AsyncClient, ctx: CallContext) -> object:
    context = await c.code_create()
    kept = await c.code_run('print("kept")', context=context.id, keep=True)
    assert kept.run_id is not None
    run = await c.run_get(kept.run_id)
    assert run.op == "code.run" and run.state == "done"
    expect_codes(
        await together(
            c.call("code.run", {"context": context.id, "code": "1", "keep": True, "stream": True}),
            c.call("code.run", {"context": context.id}),
            c.code_interrupt("c-none"),
            c.code_restart("c-none"),
        ),
        "bad_request",
        "bad_request",
        "not_found",
        "not_found",
    )
    await c.code_close(context.id)
    return None


# ------------------------------------------------------------------------- shell sessions (10)


async def shell_session(c: AsyncClient, ctx: CallContext) -> object:
    shell = await c.shell_create(name="shell_session")
    await c.shell_run(shell.id, f"cd {ctx.tmp} && X=1")
    ran = await c.shell_run(shell.id, 'echo "$X"; echo err >&2; cat; exit 3')
    assert ran.exit_code == 3 and ran.stdout == b"1\n" and ran.stderr == b"err\n"
    assert any(s.id == shell.id for s in await c.shell_list())
    expect_codes(
        await together(c.shell_create(name="shell_session"), c.call("shell.run", {"id": shell.id})),
        "exists",
        "bad_request",
    )
    await c.shell_close(shell.id)
    results = await together(c.shell_run(shell.id, "true"), c.shell_close(shell.id))
    expect_codes(results, "not_found", "not_found")
    raise results[-1]


async def shell_stdin(c: AsyncClient, ctx: CallContext) -> object:
    shell = await c.shell_create()
    assert (await c.shell_run(shell.id, "tr a-z A-Z", input=b"abc")).stdout == b"ABC"
    stream = c.shell_stream(shell.id, 'while read -r l; do echo "<$l>"; done', stdin_stream=True, live=False)
    await stream.write_stdin(b"one\ntwo\n")
    await stream.close_stdin()
    assert (await stream.result()).stdout == b"<one>\n<two>\n"
    command = {"id": shell.id, "command": "cat", "input": b"x", "stdin_stream": True}
    await refused(c.call("shell.run", command), "bad_request")
    await c.shell_close(shell.id)
    return None


async def shell_stream(c: AsyncClient, ctx: CallContext) -> object:
    shell = await c.shell_create()
    stream = c.shell_stream(shell.id, "printf 'line1\\nline2\\n'; printf err >&2")
    out = b"".join([data async for _, data in stream])
    assert len(out) == 15
    result = await stream.result()
    await c.shell_close(shell.id)
    return result


async def shell_pty(c: AsyncClient, ctx: CallContext) -> object:
    shell = await c.shell_create()
    stream = c.shell_stream(shell.id, "echo ready; read -r l; stty size", pty=True, rows=24, cols=80)
    chunks = aiter(stream)
    assert await anext(chunks) == ("stdout", b"ready\r\n")
    await c.shell_resize(shell.id, 30, 100)
    await stream.write_stdin(b"\n")
    rest = b"".join([data async for _, data in chunks])
    assert rest == b"\r\n30 100\r\n"
    await stream.result()
    expect_codes(
        await together(
            c.call("shell.run", {"id": shell.id, "command": "true", "pty": True, "stdin_stream": True}),
            c.shell_resize(shell.id, 30, 100),
            c.shell_resize(shell.id, 0, 100),
        ),
        "bad_request",
        "bad_request",
        "bad_request",
    )
    await c.shell_close(shell.id)
    return None


async def shell_detach(c: AsyncClient, ctx: CallContext) -> object:
    shell = await c.shell_create()
    first = await c.shell_run(shell.id, "echo start; sleep 1; echo end", timeout_s=0.5, on_timeout="detach")
    assert first.timed_out == "wall" and first.detached is not None
    assert (await c.shell_run(shell.id, "echo next")).stdout == b"next\n"
    assert (await c.process_wait(first.detached, timeout_s=10.0)).exit_code == 0
    output = await c.process_output(first.detached, follow=False)
    assert output.stdout == b"start\nend\n"
    pty_detach = {"id": shell.id, "command": "true", "pty": True, "timeout_s": 1.0, "on_timeout": "detach"}
    expect_codes(await together(c.process_forget(first.detached), c.call("shell.run", pty_detach)), None, "bad_request")
    await c.shell_close(shell.id)
    return None


# ------------------------------------------------------------------------- background processes (10)


async def process_stdin(c: AsyncClient, ctx: CallContext) -> object:
    proc = await c.process_start(["cat"], stdin=True)
    assert await c.process_write(proc.id, b"hello") == 5
    await c.process_close_stdin(proc.id)
    assert (await c.process_wait(proc.id, timeout_s=10.0)).exit_code == 0
    assert (await c.process_output(proc.id, follow=False)).stdout == b"hello"
    assert any(p.id == proc.id for p in await c.process_list())
    await refused(c.process_write(proc.id, b"x"), "bad_request")
    await c.process_forget(proc.id)
    return None


async def process_signal_wait(c: AsyncClient, ctx: CallContext) -> object:
    proc = await c.process_start(["sleep", "30"])
    await refused(c.process_forget(proc.id), "bad_request")
    assert (await c.process_wait(proc.id, timeout_s=0.2)).timed_out
    await c.process_signal(proc.id, "TERM")
    assert (await c.process_wait(proc.id, timeout_s=10.0)).signal == 15
    await refused(c.process_signal(proc.id, "TERM"), "bad_request")
    await c.process_forget(proc.id)
    return None


async def process_kill_after_exit(c: AsyncClient, ctx: CallContext) -> object:
    proc = await c.process_start(["true"])
    await c.process_wait(proc.id, timeout_s=10.0)
    await refused(c.process_signal(proc.id, "KILL"), "bad_request")  # no workload cgroup: no leaf to end
    await refused(c.process_signal(proc.id, "HUP"), "bad_request")
    await c.process_forget(proc.id)
    return None


async def process_pty(c: AsyncClient, ctx: CallContext) -> object:
    program = ["sh", "-c", "stty -echo; stty size; read l; stty size"]
    proc = await c.process_start(program, pty=True, rows=24, cols=80)
    attach = c.attach(proc.id)
    events = aiter(attach)
    assert await anext(events) == ("stdout", 0, b"24 80\r\n")
    await c.process_resize(proc.id, 30, 100)
    assert await c.process_write(proc.id, b"\n") == 1
    assert [item async for item in events] == [("stdout", 7, b"30 100\r\n")]
    assert (await attach.result()).exit_code == 0
    plain = await c.process_start(["true"])
    expect_codes(
        await together(c.process_resize(plain.id, 30, 100), c.process_resize(proc.id, 0, 100)),
        "bad_request",
        "bad_request",
    )
    await c.process_wait(plain.id, timeout_s=10.0)
    results = await together(c.process_forget(proc.id), c.process_forget(plain.id))
    expect_codes(results, None, None)
    return results[-1]


async def process_errors(c: AsyncClient, ctx: CallContext) -> object:
    missing = "p-none"
    expect_codes(
        await together(
            c.process_wait(missing, timeout_s=0.0),
            c.process_output(missing),
            c.process_signal(missing, "TERM"),
            c.process_write(missing, b"x"),
            c.process_close_stdin(missing),
            c.process_resize(missing, 24, 80),
            c.process_forget(missing),
        ),
        *["not_found"] * 7,
    )
    expect_codes(
        await together(
            c.call("process.start", {}),
            c.call("process.start", {"argv": []}),
            c.process_start(["/nonexistent/conformance"]),
            c.process_list(),
        ),
        "bad_request",
        "bad_request",
        "not_found",
        None,
    )
    proc = await c.process_start(["sleep", "30"])
    await refused(c.process_signal(proc.id, "NOSUCHSIG"), "bad_request", field="signal")
    await c.process_signal(proc.id, "KILL")
    assert (await c.process_wait(proc.id, timeout_s=10.0)).signal == 9
    await c.process_forget(proc.id)
    return None


# ------------------------------------------------------------------------- snapshots (11)


async def snapshot_prepare_resume(c: AsyncClient, ctx: CallContext) -> object:
    assert (await c.snapshot_prepare(quiesce=True, timeout_s=5.0)).quiesced
    await c.snapshot_prepare(quiesce=True, timeout_s=5.0)
    held = asyncio.ensure_future(c.exec(["echo", "held"]))
    await asyncio.sleep(0)  # the exec's request goes out first, then the ping's (one write in the transcript)
    await c.ping()
    await c.snapshot_resume()
    assert (await held).stdout == b"held\n"
    expect_codes(
        await together(c.call("snapshot.prepare", {"timeout_s": -1.0}), c.snapshot_prepare(fsfreeze="/")),
        "bad_request",
        "bad_request",
    )
    return await c.ping()


async def snapshot_restore(c: AsyncClient, ctx: CallContext) -> object:
    await c.info()
    shell = await c.shell_create()
    identity: dict[str, Any] = {"sandbox_id": "sb-conformance", "hostname": "conformance-clone"}
    e1 = b"\x01" * 32
    first = await c.restore(generation=1, nonce="snapshot_restore-1", time_ns=now_ns(), entropy=e1, **identity)
    assert not first.replayed
    again = await c.restore(generation=1, nonce="snapshot_restore-1", time_ns=now_ns(), entropy=e1, **identity)
    assert again.replayed
    await refused(c.restore(generation=1, nonce="snapshot_restore-2", time_ns=now_ns(), entropy=b"\x02" * 32), "stale")
    bad = c.restore(generation=2, nonce="snapshot_restore-3", time_ns=now_ns(), entropy=b"\x03" * 16)
    await refused(bad, "bad_request", field="entropy")
    bad = c.restore(
        generation=2, nonce="snapshot_restore-4", time_ns=now_ns(), entropy=b"\x04" * 32, hostname="bad host"
    )
    await refused(bad, "bad_request", field="identity.hostname")
    bad = c.restore(generation=2, nonce="snapshot_restore-5", time_ns=now_ns(), entropy=b"\x05" * 32, env={"A=B": "x"})
    await refused(bad, "bad_request", field="identity.env.A=B")
    await c.info()
    await c.shell_close(shell.id)
    return None


async def snapshot_clock_check(c: AsyncClient, ctx: CallContext) -> object:
    await c.clock_check(time_ns=now_ns())
    await c.snapshot_prepare(quiesce=True)
    await c.clock_check(time_ns=now_ns())
    await c.snapshot_resume()
    results = await together(
        c.clock_check(time_ns=-1), c.call("clock.check", {"time_ns": 1.5}), c.call("clock.check", {})
    )
    expect_codes(results, "bad_request", "bad_request", "bad_request")
    raise results[-1]


# ------------------------------------------------------------------------- ports (5.1)


async def ports_list_watch_wait(c: AsyncClient, ctx: CallContext) -> object:
    listen = (
        "import socket, time\ns = socket.socket()\ns.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        "s.bind(('127.0.0.1', 18767))\ns.listen()\ntime.sleep(60)\n"
    )
    proc = await c.process_start(["python3", "-c", listen])
    assert (await c.port_wait(18767, timeout_s=10.0)).ready
    assert [x.port for x in await c.port_list(ports=[18767])] == [18767]
    first = await c.call("port.watch", {"ports": [18767]})
    digest = first["digest"]
    assert not (await c.call("port.watch", {"digest": digest, "timeout_s": 0.3, "ports": [18767]}))["changed"]
    await c.process_signal(proc.id, "KILL")
    watch = {"digest": digest, "timeout_s": 10.0, "interval_s": 0.05, "ports": [18767]}
    assert (await c.call("port.watch", watch, deadline=20.0))["changed"]
    results = await together(c.port_wait(18767, timeout_s=0.2), c.port_list(ports=[0]))
    expect_codes(results, None, "bad_request")
    await c.process_wait(proc.id, timeout_s=10.0)
    await c.process_forget(proc.id)
    return None


# ------------------------------------------------------------------------- refused hellos (3)


async def auth_token_accepted(c: AsyncClient, ctx: CallContext) -> object:
    return await c.ping()


async def auth_token_missing(c: AsyncClient, ctx: CallContext) -> object:
    """Never reached: connecting without the token already fails with permission_denied."""
    return await c.ping()


CALLS: dict[str, ClientCall] = {
    "keep_shell_run": keep_shell_run,
    "keep_code_run": keep_code_run,
    "runs_get_wait_list": runs_get_wait_list,
    "runs_cancel": runs_cancel,
    "runs_errors": runs_errors,
    "code_lifecycle": code_lifecycle,
    "code_stream_interrupt_restart": code_stream_interrupt_restart,
    "shell_session": shell_session,
    "shell_run_nul": shell_run_nul,
    "shell_stdin": shell_stdin,
    "shell_stream": shell_stream,
    "shell_pty": shell_pty,
    "shell_detach": shell_detach,
    "process_stdin": process_stdin,
    "process_signal_wait": process_signal_wait,
    "process_kill_after_exit": process_kill_after_exit,
    "process_pty": process_pty,
    "process_errors": process_errors,
    "snapshot_prepare_resume": snapshot_prepare_resume,
    "snapshot_restore": snapshot_restore,
    "snapshot_clock_check": snapshot_clock_check,
    "ports_list_watch_wait": ports_list_watch_wait,
    "auth_token_accepted": auth_token_accepted,
    "auth_token_missing": auth_token_missing,
}
