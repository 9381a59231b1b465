"""Workload ops start a few per loop iteration (guestd/server/pacing.py), so a flood of them never
holds back the control plane: a daemon's real Connection and admission chain in this process,
with handlers that record the loop iteration they started in (milliseconds, no guestd process)."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from guestd.config import Config
from guestd.server.connection import Connection
from guestd.server.daemon import Daemon
from guestd.server.pacing import STARTS_PER_ITERATION, StartPacer
from guestd.testing.rawwire import SinkTransport
from guestd.wire.frames import Kind, encode_frame


class Iterations:
    """Counts the loop's iterations: a callback that schedules itself runs once in each."""

    def __init__(self) -> None:
        self.count = 0
        self._loop = asyncio.get_running_loop()
        self._handle = self._loop.call_soon(self._tick)

    def _tick(self) -> None:
        self.count += 1
        self._handle = self._loop.call_soon(self._tick)

    def stop(self) -> None:
        self._handle.cancel()

    async def run(self, n: int) -> None:
        for _ in range(n):
            await asyncio.sleep(0)


def test_work_ops_are_paced_and_control_ops_are_not() -> None:
    daemon = Daemon(Config())
    assert "pace" in daemon.admission.names()
    for op in ("exec", "file.read", "code.run", "process.start", "shell.run", "port.connect", "port.list"):
        daemon.dispatcher.route(op)  # registers its capability, as its first request does
        assert daemon.pacer.check(op) is daemon.pacer, op
    for op in (
        "ping",
        "info",
        "metrics",
        "snapshot.prepare",
        "snapshot.restore",
        "clock.check",
        "process.signal",
        "code.interrupt",
        "run.cancel",
        "shell.resize",
        "process.list",
    ):
        daemon.dispatcher.route(op)
        assert daemon.pacer.check(op) is None, op


def test_a_flood_of_execs_starts_a_few_per_iteration_and_a_control_op_goes_first() -> None:
    """100 execs from one connection, then a metrics request from another, all before the loop
    runs: before pacing every exec handler started in the first iteration (100 in one), and
    the metrics request's handler after them."""
    starts: list[tuple[str, int]] = []

    async def go() -> None:
        it = Iterations()

        def compose(server: Any) -> None:
            async def exec_handler(ctx: Any, args: Any) -> dict[str, Any]:
                starts.append(("exec", it.count))
                await asyncio.sleep(0)
                return {}

            async def metrics_handler(ctx: Any, args: Any) -> dict[str, Any]:
                starts.append(("metrics", it.count))
                return {}

            server.dispatcher.add("exec", exec_handler)
            server.dispatcher.add("metrics", metrics_handler, control=True)  # as guestd.metrics registers it

        daemon = Daemon(Config(), compose)
        daemon.settle()
        a, b = Connection(daemon, "a", serial=True), Connection(daemon, "b", serial=True)
        sinks = SinkTransport(), SinkTransport()
        for conn, sink in zip((a, b), sinks, strict=True):
            conn.connection_made(sink)  # type: ignore[arg-type]
            conn.data_received(encode_frame(Kind.HELLO, 0, {"versions": [1]}))
        a.data_received(
            b"".join(encode_frame(Kind.REQUEST, i, {"op": "exec", "args": {"argv": ["true"]}}) for i in range(1, 101))
        )
        b.data_received(encode_frame(Kind.REQUEST, 1, {"op": "metrics", "args": {}}))
        for _ in range(400):
            await it.run(1)
            if len(sinks[0].finals()) == 100 and sinks[1].finals():
                break
        it.stop()
        assert len(sinks[0].finals()) == 100
        assert sinks[1].finals()[1][0] == Kind.RESPONSE

    asyncio.run(go())
    per_iteration = Counter(at for op, at in starts if op == "exec")
    assert sum(per_iteration.values()) == 100
    assert max(per_iteration.values()) <= STARTS_PER_ITERATION  # was 100 in one iteration
    # A control op waits for no batch: among the first handlers to start (was the 101st).
    assert [op for op, _ in starts].index("metrics") <= STARTS_PER_ITERATION


def test_a_connection_that_floods_waits_behind_itself_not_in_front_of_others() -> None:
    """Connection a sends 100 execs at once, then b and c send 3 each: turns go round robin
    across connections (a, b, c, a, b, c, ...), so b's and c's all start within the next three
    iterations' turns. With one queue in arrival order they started after a's 100."""
    starts: list[tuple[str, int, int]] = []

    async def go() -> None:
        it = Iterations()

        def compose(server: Any) -> None:
            async def exec_handler(ctx: Any, args: Any) -> dict[str, Any]:
                starts.append((ctx.conn.transport_name, it.count, ctx.stream.id))
                await asyncio.sleep(0)
                return {}

            server.dispatcher.add("exec", exec_handler)

        daemon = Daemon(Config(), compose)
        daemon.settle()
        conns = {name: Connection(daemon, name, serial=True) for name in "abc"}
        sinks = {name: SinkTransport() for name in conns}
        for name, conn in conns.items():
            conn.connection_made(sinks[name])  # type: ignore[arg-type]
            conn.data_received(encode_frame(Kind.HELLO, 0, {"versions": [1]}))
        for name, n in (("a", 100), ("b", 3), ("c", 3)):
            conns[name].data_received(
                b"".join(
                    encode_frame(Kind.REQUEST, i, {"op": "exec", "args": {"argv": ["true"]}}) for i in range(1, n + 1)
                )
            )
        for _ in range(400):
            await it.run(1)
            if [len(sink.finals()) for sink in sinks.values()] == [100, 3, 3]:
                break
        it.stop()
        assert [len(sink.finals()) for sink in sinks.values()] == [100, 3, 3]

    asyncio.run(go())
    first = starts[0][1]
    late = [(name, at - first) for name, at, _ in starts if name != "a" and at - first > 3]
    assert not late, late  # one queue: every one of b's and c's, 13-14 iterations after
    per_iteration = Counter(at for _, at, _ in starts)
    assert max(per_iteration.values()) <= STARTS_PER_ITERATION
    for name in "abc":  # each connection's own requests start in the order they arrived
        ids = [request_id for conn, _, request_id in starts if conn == name]
        assert ids == sorted(ids), name


def test_turns_go_in_arrival_order_and_a_cancelled_one_is_skipped() -> None:
    async def go() -> tuple[list[int], bool, bool]:
        pacer = StartPacer({}, per_iteration=2)
        it = Iterations()
        order: list[int] = []

        async def request(i: int) -> None:
            await pacer.wait("test")
            order.append(i)

        tasks = [asyncio.get_running_loop().create_task(request(i)) for i in range(7)]
        await asyncio.sleep(0)  # every task waits for its turn now (0 and 1 got one at once)
        tasks[3].cancel()
        await it.run(20)
        it.stop()
        return order, all(t.done() for t in tasks), tasks[3].cancelled()

    order, all_done, cancelled = asyncio.run(go())
    assert order == [0, 1, 2, 4, 5, 6]
    assert all_done and cancelled


def test_turns_go_round_robin_across_sources_skipping_cancelled_ones() -> None:
    """Two start at once; then a (5 requests), b (1) and c (2) wait, and b's only one and a's
    second are cancelled: turns go a, c, a, c, a, a, each source's in arrival order, and a source
    whose turns were all cancelled leaves the ring (the next request starts at once again)."""

    async def go() -> tuple[list[tuple[str, int]], int]:
        pacer = StartPacer({}, per_iteration=2)
        it = Iterations()
        order: list[tuple[str, int]] = []
        loop = asyncio.get_running_loop()

        async def request(source: str, i: int) -> None:
            await pacer.wait(source)
            order.append((source, i))

        arrivals = [("x", 0), ("x", 1), *(("a", i) for i in range(5)), ("b", 0), ("c", 0), ("c", 1)]
        tasks = {arrival: loop.create_task(request(*arrival)) for arrival in arrivals}
        await asyncio.sleep(0)  # x's two started at once; the others wait for turns
        tasks["b", 0].cancel()
        tasks["a", 1].cancel()
        await it.run(20)
        at = it.count
        await pacer.wait("y")  # nothing waits: starts without a suspension
        suspended = it.count - at
        it.stop()
        return order, suspended

    order, suspended = asyncio.run(go())
    assert order == [("x", 0), ("x", 1), ("a", 0), ("c", 0), ("a", 2), ("c", 1), ("a", 3), ("a", 4)]
    assert suspended == 0


def test_a_request_arriving_as_turns_are_handed_out_does_not_start_ahead_of_them() -> None:
    """Request 1 waits for a turn; request 2 arrives in the iteration the turn is handed out, after
    the hand-out: it waits too. Before, it took the free start at once and ran ahead of 1, whose
    task resumes only in the next iteration (a connection's process.write calls reached the
    process out of order: tests/test_processes.py's concurrent writes, 1 of 4 whole-file runs)."""

    async def go() -> list[int]:
        pacer = StartPacer({}, per_iteration=1)
        it = Iterations()
        loop = asyncio.get_running_loop()
        order: list[int] = []

        async def request(i: int) -> None:
            await pacer.wait("a")
            order.append(i)

        tasks = [loop.create_task(request(0)), loop.create_task(request(1))]
        await asyncio.sleep(0)  # 0 started at once, 1 waits; the hand-out is next iteration's first callback
        tasks.append(loop.create_task(request(2)))  # its first step runs right after the hand-out
        await it.run(10)
        it.stop()
        assert all(t.done() for t in tasks)
        return order

    assert asyncio.run(go()) == [0, 1, 2]  # was [0, 2, 1]


def test_an_unloaded_pacer_starts_at_once() -> None:
    """Fewer than its bound in an iteration: wait() returns without a suspension."""

    async def go() -> int:
        pacer = StartPacer({}, per_iteration=3)
        it = Iterations()
        at = it.count
        for _ in range(3):
            await pacer.wait("test")
        it.stop()
        return it.count - at

    assert asyncio.run(go()) == 0


def test_the_bound_holds_while_the_queue_drains_and_new_requests_arrive() -> None:
    """12 requests at once, then 8 more in each of the next iterations: the turns handed out
    in one iteration start in the next, beside those that start at once there. Counted from 0
    at each iteration, 16 handlers started in one."""

    async def go() -> Counter[int]:
        pacer = StartPacer({}, per_iteration=8)
        it = Iterations()
        started: Counter[int] = Counter()
        loop = asyncio.get_running_loop()

        async def request() -> None:
            await pacer.wait("test")
            started[it.count] += 1

        tasks = [loop.create_task(request()) for _ in range(12)]
        for _ in range(6):
            await it.run(1)
            tasks += [loop.create_task(request()) for _ in range(8)]
        await it.run(40)
        it.stop()
        assert all(t.done() for t in tasks)
        return started

    started = asyncio.run(go())
    assert sum(started.values()) == 60
    assert max(started.values()) <= 8, started


def test_a_request_waiting_for_its_turn_waits_for_a_restore_that_began_meanwhile() -> None:
    """20 execs arrive while no restore runs (the snapshot gate open), then a restore begins
    before their turns come: none starts until it ends. When the snapshot gate was checked only
    at arrival, the first turns started inside the restore."""
    states: list[Any] = []
    started: list[int] = []
    iteration: list[Iterations] = []

    def compose(server: Any) -> None:
        from guestd.snapshot import handlers as snapshot_ops

        async def exec_handler(ctx: Any, args: Any) -> dict[str, Any]:
            started.append(iteration[0].count)
            return {}

        server.dispatcher.add("exec", exec_handler)
        states.append(snapshot_ops.register(server.services, server.admission))

    async def go() -> None:
        iteration.append(Iterations())
        cfg = Config()
        cfg.simulate_privileged = True
        daemon = Daemon(cfg, compose)
        daemon.settle()
        (state,) = states
        conn = Connection(daemon, "test", serial=True)
        sink = SinkTransport()
        conn.connection_made(sink)  # type: ignore[arg-type]
        conn.data_received(encode_frame(Kind.HELLO, 0, {"versions": [1]}))
        conn.data_received(
            b"".join(encode_frame(Kind.REQUEST, i, {"op": "exec", "args": {"argv": ["true"]}}) for i in range(1, 21))
        )
        await state.lock.acquire()  # a restore begins, as snapshot.restore does, before any turn
        state.ready.clear()
        for _ in range(50):
            await asyncio.sleep(0)
        assert started == []  # was 8: the first turns started inside the restore
        state.ready.set()
        state.lock.release()
        for _ in range(400):
            await asyncio.sleep(0)
            if len(sink.finals()) == 20:
                break
        iteration[0].stop()
        assert len(started) == 20 and all(kind == Kind.RESPONSE for kind, _ in sink.finals().values())
        # The gate opens in one iteration, and they start in their turns, not all in it.
        assert max(Counter(started).values()) <= STARTS_PER_ITERATION, Counter(started)

    asyncio.run(go())
