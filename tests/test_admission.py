"""The admission chain (guestd/server/admission.py): the ordered steps every request passes
before its handler runs, and the narrow host a connection talks to.

Most tests drive the chain, its steps and a daemon's Connection in this process, without a
guestd process (milliseconds each); the last one checks a real guestd over its Unix socket: a
refused op, an op held at the snapshot gate until a restore, and bulk replies (file.read, more
at once than the bound, through a path that is not UTF-8) answer as they did."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping
from typing import Any, cast

import pytest

from guestd.config import Config
from guestd.server.admission import (
    BULK_REPLIES,
    REPLIED,
    ROUTE,
    AdmissionChain,
    bound_bulk_replies,
    os_paths,
)
from guestd.server.connection import Connection
from guestd.server.daemon import Daemon
from guestd.server.dispatch import Dispatcher, Route
from guestd.server.request import Handler, RequestContext
from guestd.testing import StartGuestd
from guestd.testing.rawwire import RawPeer, SinkTransport
from guestd.wire.errors import ErrorCode, GuestdError
from guestd.wire.frames import Kind, encode_frame
from guestd.wire.schema import OPS_BY_NAME


def _ping(args: Any) -> dict[str, Any]:
    return {"t_ns": 1}


def _info(args: Any) -> dict[str, Any]:
    return {}


def _system_declared(dispatcher: Dispatcher, loaded: list[str]) -> None:
    """The system capability declared: registered (and recorded) at its first request."""

    def load() -> None:
        loaded.append("system")
        dispatcher.add("ping", inline=_ping)
        dispatcher.add("info", inline=_info)

    dispatcher.declare("system", load)


def _deny(op: str) -> None:
    raise GuestdError(ErrorCode.PERMISSION_DENIED, f"op {op!r} denied", details={"op": op})


# -- the chain --------------------------------------------------------------------------------
def test_checks_run_in_order_around_the_route_and_a_refusal_ends_the_chain() -> None:
    dispatcher = Dispatcher()
    loaded: list[str] = []
    _system_declared(dispatcher, loaded)
    chain = AdmissionChain(dispatcher)
    calls: list[str] = []

    def policy(op: str) -> None:
        calls.append(f"policy {op}")
        if op == "info":
            _deny(op)

    def after(op: str) -> None:
        calls.append(f"after {op}")

    chain.add("after", check=after)
    chain.add("policy", check=policy, before_route=True)
    assert chain.names() == ["policy", ROUTE, "after"]
    with pytest.raises(GuestdError) as refused:
        chain.admit("info", "test")
    assert refused.value.code == "permission_denied" and refused.value.details == {"op": "info"}
    assert calls == ["policy info"] and loaded == []  # refused before the route: nothing registered
    route, _handler, gate = chain.admit("ping", "test")
    assert route.spec.name == "ping" and route.inline is _ping and gate is None
    assert calls == ["policy info", "policy ping", "after ping"] and loaded == ["system"]
    assert chain.admit("ping", "test")[0] is route  # routed now: the same order, the route kept
    assert calls[3:] == ["policy ping", "after ping"] and loaded == ["system"]


def test_a_refusal_after_the_route_runs_no_later_check() -> None:
    dispatcher = Dispatcher()
    _system_declared(dispatcher, [])
    chain = AdmissionChain(dispatcher)
    calls: list[str] = []
    chain.add("refuse", check=_deny)
    chain.add("later", check=calls.append)
    with pytest.raises(GuestdError):
        chain.admit("ping", "test")
    assert calls == []
    with pytest.raises(GuestdError):  # once routed too
        chain.admit("ping", "test")
    assert calls == []
    chain.remove("refuse")
    assert chain.names() == [ROUTE, "later"]
    chain.admit("ping", "test")
    assert calls == ["ping"]


def test_an_unknown_op_is_the_routes_error() -> None:
    chain = AdmissionChain(Dispatcher())
    with pytest.raises(GuestdError) as unknown:
        chain.admit("no.such.op", "test")
    assert unknown.value.code == "unknown_op"


def test_gates_are_waited_for_in_the_chains_order() -> None:
    async def go() -> None:
        dispatcher = Dispatcher()
        _system_declared(dispatcher, [])
        chain = AdmissionChain(dispatcher)
        first, second = asyncio.Event(), asyncio.Event()
        chain.add("first", check=lambda op: first, before_route=True)
        chain.add("second", check=lambda op: second)
        gate = chain.admit("ping", "test")[2]
        assert gate is not None
        waiting = asyncio.ensure_future(gate.wait())
        second.set()
        for _ in range(20):
            await asyncio.sleep(0)
        assert not waiting.done()  # the first still holds it
        first.set()
        await asyncio.wait_for(waiting, 10)

    asyncio.run(go())


def test_wraps_are_built_once_per_route_the_first_added_outermost() -> None:
    async def go() -> None:
        dispatcher = Dispatcher()
        ran: list[str] = []

        async def clock_check(ctx: RequestContext, args: Any) -> Mapping[str, Any]:
            ran.append("handler")
            return {"args": args}

        dispatcher.add("clock.check", clock_check)
        chain = AdmissionChain(dispatcher)
        built: list[str] = []

        def wrap_as(name: str) -> Any:
            def wrap(route: Route, handler: Handler) -> Handler:
                built.append(name)

                async def wrapped(ctx: RequestContext, args: Any) -> Mapping[str, Any]:
                    ran.append(name)
                    return await handler(ctx, args)

                return wrapped

            return wrap

        chain.add("outer", wrap=wrap_as("outer"))
        chain.add("inner", wrap=wrap_as("inner"))
        handlers = {chain.admit("clock.check", "test")[1] for _ in range(3)}
        assert len(handlers) == 1 and built == ["inner", "outer"]  # once, inside out
        (handler,) = handlers
        assert await handler(cast(RequestContext, None), {"time_ns": 5}) == {"args": {"time_ns": 5}}
        assert ran == ["outer", "inner", "handler"]
        dispatcher.add("clock.check", clock_check)  # registered again: wrapped again
        chain.admit("clock.check", "test")
        assert built == ["inner", "outer", "inner", "outer"]
        chain.add("third", check=lambda op: None)  # the chain changed: wrapped again
        chain.admit("clock.check", "test")
        assert len(built) == 6

    asyncio.run(go())


def test_a_step_is_named_once_and_does_something() -> None:
    chain = AdmissionChain(Dispatcher())
    chain.add("policy", check=lambda op: None)
    with pytest.raises(ValueError):
        chain.add("policy", check=lambda op: None)
    with pytest.raises(ValueError):
        chain.add(ROUTE, check=lambda op: None)
    with pytest.raises(ValueError):
        chain.add("idle")


def test_hello_hooks_run_in_their_order() -> None:
    chain = AdmissionChain(Dispatcher())
    seen: list[tuple[str, object]] = []
    chain.add_hello_hook(lambda hello: seen.append(("a", hello.get("time_ns"))))
    chain.add_hello_hook(lambda hello: seen.append(("b", hello.get("time_ns"))))
    chain.hello({"versions": [1], "time_ns": 7})
    assert seen == [("a", 7), ("b", 7)]


# -- the server's own steps ----------------------------------------------------------------------
def test_path_arguments_reach_the_handler_as_os_strs() -> None:
    async def go() -> None:
        got: list[Any] = []

        async def handler(ctx: RequestContext, args: Any) -> Mapping[str, Any]:
            got.append(args)
            return {}

        converting = os_paths(Route(OPS_BY_NAME["file.read"], handler), handler)
        await converting(cast(RequestContext, None), {"path": b"/tmp/\xff", "offset": 3})
        await converting(cast(RequestContext, None), {"path": "/tmp/plain"})
        assert got == [{"path": os.fsdecode(b"/tmp/\xff"), "offset": 3}, {"path": "/tmp/plain"}]
        # An op without path arguments keeps its handler: no layer added.
        assert os_paths(Route(OPS_BY_NAME["clock.check"], handler), handler) is handler

    asyncio.run(go())


class _Link:
    """The little of a connection the bulk-reply bound uses."""

    def __init__(self) -> None:
        self.step_state: dict[object, Any] = {}
        self.drains = 0

    async def drain(self) -> None:
        self.drains += 1


class _Request:
    def __init__(self, conn: _Link, name: str, log: list[str]) -> None:
        self.conn = conn
        self.name = name
        self.log = log

    def respond(self, result: Mapping[str, Any]) -> None:
        self.log.append(f"reply {self.name}")


def test_bulk_replies_are_built_a_few_at_a_time_per_connection_and_sent_inside_the_bound() -> None:
    async def go() -> None:
        log: list[str] = []
        release = asyncio.Event()
        inside: list[str] = []

        async def read(ctx: RequestContext, args: Any) -> Mapping[str, Any]:
            name = cast(_Request, ctx).name
            inside.append(name)
            log.append(f"build {name}")
            await release.wait()
            return {"data": b"x"}

        bounded = bound_bulk_replies(Route(OPS_BY_NAME["file.read"], read, bulk_reply=True), read)
        assert bound_bulk_replies(Route(OPS_BY_NAME["file.read"], read), read) is read  # no flag: untouched
        one, other = _Link(), _Link()
        n = BULK_REPLIES + 2
        runs = [
            asyncio.ensure_future(bounded(cast(RequestContext, _Request(link, f"{tag}{i}", log)), {}))
            for tag, link in (("a", one), ("b", other))
            for i in range(n)
        ]
        for _ in range(50):
            await asyncio.sleep(0)
        # BULK_REPLIES per connection build at once; the rest wait for a slot.
        assert sorted(inside) == sorted([f"a{i}" for i in range(BULK_REPLIES)] + [f"b{i}" for i in range(BULK_REPLIES)])
        release.set()
        assert await asyncio.gather(*runs) == [REPLIED] * (2 * n)
        assert one.drains == other.drains == n  # each waited for its connection to take output first
        # A reply goes out before its slot is given back: the first waiting build starts after it.
        a_log = [entry for entry in log if entry.endswith(tuple(f"a{i}" for i in range(n)))]
        assert a_log.index(f"build a{BULK_REPLIES}") > a_log.index("reply a0")

    asyncio.run(go())


# -- the daemon's chain and host ----------------------------------------------------------------
def test_the_daemon_composes_policy_first_and_its_own_steps_last() -> None:
    daemon = Daemon(Config())
    assert daemon.admission.names() == ["policy", "first_request", ROUTE, "pace", "snapshot", "bulk_reply", "paths"]
    daemon.settle()  # the first reply's work started: its step leaves the chain
    assert daemon.admission.names() == ["policy", ROUTE, "pace", "snapshot", "bulk_reply", "paths"]


def test_during_a_restore_even_ping_waits_at_the_snapshot_gate_but_the_restore_does_not() -> None:
    """The snapshot's step, registered from its own register(), as a daemon's connection runs it."""
    states: list[Any] = []

    def compose(server: Any) -> None:
        from guestd.snapshot import handlers as snapshot_ops
        from guestd.system import handlers as system_ops

        system_ops.register(server.services)
        states.append(snapshot_ops.register(server.services, server.admission))

    async def go() -> None:
        cfg = Config()
        cfg.simulate_privileged = True
        cfg.policy.deny_ops = ["info"]
        daemon = Daemon(cfg, compose)
        (state,) = states
        conn = Connection(daemon, "test", serial=True)
        sink = SinkTransport()
        conn.connection_made(sink)  # type: ignore[arg-type]
        conn.data_received(encode_frame(Kind.HELLO, 0, {"versions": [1]}))
        await state.lock.acquire()  # as snapshot.restore does while it works
        state.ready.clear()
        conn.data_received(
            encode_frame(Kind.REQUEST, 1, {"op": "ping", "args": {}})
            + encode_frame(Kind.REQUEST, 2, {"op": "info", "args": {}})
            + encode_frame(Kind.REQUEST, 3, {"op": "snapshot.resume", "args": {}})
        )
        for _ in range(20):
            await asyncio.sleep(0)
        finals = sink.finals()
        assert 1 not in finals  # held
        assert finals[2][0] == Kind.ERROR and finals[2][1]["code"] == "permission_denied"  # policy first
        assert 3 not in finals  # every op but the restore itself waits
        state.ready.set()
        state.lock.release()
        for _ in range(200):
            finals = sink.finals()
            if 1 in finals and 3 in finals:
                break
            await asyncio.sleep(0)
        assert finals[1][0] == Kind.RESPONSE and "t_ns" in finals[1][1]
        assert finals[3] == (Kind.RESPONSE, {})

    asyncio.run(go())


# -- a real guestd ----------------------------------------------------------------------------
def test_a_real_guestd_refuses_gates_and_bounds_as_before(fresh_guestd: StartGuestd, tmp_path: Any) -> None:
    config = os.path.join(str(tmp_path), "guestd.toml")
    with open(config, "w") as f:
        f.write('[policy]\ndeny_ops = ["shell.*"]\n')
    g = fresh_guestd("--config", config, "--simulate-privileged", "--code-pool", "0")
    peer = RawPeer(g.raw_socket())
    peer.hello()
    # Refused by the policy, with the error it always gave.
    peer.request(1, "shell.create", {})
    assert peer.recv_final(1) == (
        Kind.ERROR,
        {
            "code": "permission_denied",
            "message": "op 'shell.create' is denied by policy.deny_ops (shell.*)",
            "details": {"policy": "deny_ops", "op": "shell.create"},
        },
    )
    # Held at the snapshot gate while quiesced; a restore lets it through.
    marker = os.path.join(str(tmp_path), "ran")
    peer.request(2, "snapshot.prepare", {"quiesce": True})
    assert peer.recv_final(2)[1]["quiesced"]
    peer.request(3, "exec", {"argv": ["touch", marker]})
    peer.request(4, "ping", {})  # health checks pass the gate; answered after the exec was admitted
    early = _finals_until(peer, 4)
    assert early[4][0] == Kind.RESPONSE and 3 not in early
    assert not os.path.exists(marker)
    restore = {"generation": 1, "nonce": "n1", "time_ns": time.time_ns(), "entropy": os.urandom(64)}
    peer.request(5, "snapshot.restore", restore)
    finals = peer.recv_finals([3, 5])
    assert finals[5][0] == Kind.RESPONSE and finals[3][0] == Kind.RESPONSE and finals[3][1]["exit_code"] == 0
    assert os.path.exists(marker)
    # Bulk replies: more reads at once than the per-connection bound, through a name that is
    # not UTF-8 (sent as bin, handed to the handler as an os str): each gets its bytes.
    name = os.path.join(os.fsencode(str(tmp_path)), b"data-\xff")
    with open(name, "wb") as out:
        out.write(b"0123456789" * 1000)
    ids = list(range(10, 10 + 3 * BULK_REPLIES))
    for i in ids:
        peer.request(i, "file.read", {"path": name, "offset": i, "length": 100})
    reads = peer.recv_finals(ids)
    assert all(reads[i] == (Kind.RESPONSE, reads[i][1]) for i in ids), reads
    assert [reads[i][1]["data"] for i in ids] == [(b"0123456789" * 1000)[i : i + 100] for i in ids]


def _finals_until(peer: RawPeer, req_id: int) -> dict[int, tuple[int, dict[str, Any]]]:
    """Every final frame read up to and including ``req_id``'s."""
    finals: dict[int, tuple[int, dict[str, Any]]] = {}
    while req_id not in finals:
        kind, rid, body = peer.recv()
        if kind in (Kind.RESPONSE, Kind.ERROR):
            finals[rid] = (kind, body)
    return finals
