"""The client against a compromised guest: it must neither hang nor grow without bound."""

from __future__ import annotations

import asyncio
import os
import socket
import statistics
import threading
import time
import tracemalloc
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from guestd.client import AsyncClient, Client, GuestdError, GuestProtocolError, aio
from guestd.testing.fakeguest import (
    FakeGuest,
    answers,
    code_reply,
    info_reply,
    next_request,
    send_download,
)
from guestd.testing.rawwire import RawPeer
from guestd.wire.frames import HEADER, MAGIC, Kind, encode_frame


def test_oversize_frame_closes_the_connection(evil: Callable[..., str]) -> None:
    def script(p: RawPeer) -> None:
        _, rid, _ = p.recv()
        p.send_bytes(HEADER.pack(MAGIC, 1, Kind.RESPONSE, 1 << 30, rid))  # "a 1 GiB reply follows"
        p.sock.recv(1)

    with Client(evil(script)) as c, pytest.raises(GuestProtocolError):
        c.ping(deadline=10)


def test_wrongly_typed_reply_is_a_protocol_error(evil: Callable[..., str]) -> None:
    def script(p: RawPeer) -> None:
        _, rid, _ = p.recv()
        p.send(Kind.RESPONSE, rid, {"t_ns": "not a number"})
        p.sock.recv(1)

    with Client(evil(script)) as c, pytest.raises(GuestProtocolError):
        c.ping(deadline=10)


def test_stream_beyond_the_granted_window_is_refused(evil: Callable[..., str]) -> None:
    def script(p: RawPeer) -> None:
        _, rid, _ = p.recv()
        for _ in range(200):  # 200 x 32 KiB, never waiting for WINDOW
            p.send_bytes(encode_frame(Kind.EVENT, rid, {"ev": "data", "data": b"z" * 32768}))
        p.sock.recv(1)

    async def no_reader(c: Client) -> None:
        call = c.aio._conn.start("file.download", {"path": "/anything"})  # events are never consumed
        await c.aio._conn.wait(call, 10)

    with Client(evil(script)) as c, pytest.raises(GuestProtocolError):
        c._run(no_reader(c))


def test_more_download_bytes_than_the_file_has(evil: Callable[..., str]) -> None:
    def script(p: RawPeer) -> None:
        _, rid, _ = p.recv()
        p.send(Kind.EVENT, rid, {"ev": "start", "size": 10})
        p.send(Kind.EVENT, rid, {"ev": "data", "data": b"y" * 100})
        p.sock.recv(1)

    with Client(evil(script)) as c, pytest.raises(GuestProtocolError):
        c.download("/anything", progress_timeout=10)


def test_a_silent_guest_hits_the_client_deadline(evil: Callable[..., str]) -> None:
    def script(p: RawPeer) -> None:
        p.recv()
        p.sock.recv(1)  # never answers

    with Client(evil(script)) as c, pytest.raises(GuestdError) as ei:
        c.ping(deadline=0.5)
    assert ei.value.code == "timeout"


def test_garbage_instead_of_a_hello(tmp_path: object) -> None:
    path = f"{tmp_path}/junk.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)

    def serve() -> None:
        conn, _ = srv.accept()
        conn.recv(4096)
        conn.sendall(b"HTTP/1.1 200 OK\r\n\r\n" * 10)
        conn.recv(1)

    threading.Thread(target=serve, daemon=True).start()
    with pytest.raises(GuestdError):
        Client(f"unix:{path}", connect_timeout=5)
    srv.close()


def test_replies_to_ids_never_sent_are_ignored(evil: Callable[..., str]) -> None:
    def script(p: RawPeer) -> None:
        _, rid, _ = p.recv()
        for bogus in (rid + 1000, 0xFFFFFFFF):
            p.send(Kind.RESPONSE, bogus, {"t_ns": 1})
            p.send(Kind.EVENT, bogus, {"ev": "data", "data": b"x" * 1000})
            p.send(Kind.ERROR, bogus, {"code": "internal", "message": "for nobody"})
        p.send(Kind.RESPONSE, rid, {"t_ns": 42})
        p.sock.recv(1)

    with Client(evil(script)) as c:
        assert c.call("ping", deadline=10)["t_ns"] == 42  # the reply to the id sent, not the stray ones


# ----------------------------------------------------------------------------- issue 22
# A fake guestd (guestd/testing/fakeguest.py) drives the real Client and AsyncClient. Memory is
# measured with tracemalloc in this process (the client's loop thread included).

MiB = 1024 * 1024


def empty_maps(n: int) -> list[dict[str, object]]:
    return [{}] * n  # one byte each on the wire, ~72 bytes each decoded


def peak_growth(fn: Callable[[], object]) -> int:
    """Peak bytes allocated (tracemalloc) while ``fn`` runs, above what was allocated before."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        fn()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_events_for_a_plain_exec_close_the_connection_undecoded(fake_guest: Callable[..., FakeGuest]) -> None:
    """Defect 2: events for a request that asked for no stream; 4 MiB of empty maps each
    (~290 MiB decoded) grew the host by 636 MiB before."""

    def script(p: RawPeer) -> None:
        rid, _, _ = next_request(p)
        junk = encode_frame(Kind.EVENT, rid, {"ev": "stdout", "pad": empty_maps(4 * MiB - 64)})
        for _ in range(2):
            p.send_bytes(junk)
        p.sock.recv(1)

    g = fake_guest(script)

    def run() -> None:
        with Client(g.address) as c, pytest.raises(GuestProtocolError, match="asked for none"):
            c.exec(["true"], timeout_s=5)

    assert peak_growth(run) < 64 * MiB


def test_queued_events_are_bounded_by_their_decoded_size(fake_guest: Callable[..., FakeGuest]) -> None:
    """Defect 2: a stream nobody reads, each event 200 KB on the wire and ~14 MB decoded; the
    queue was bounded by wire bytes (16 MiB: 80 such events, over 1 GiB decoded)."""

    def script(p: RawPeer) -> None:
        rid, _, _ = next_request(p)
        junk = encode_frame(Kind.EVENT, rid, {"ev": "stdout", "pad": empty_maps(200_000)})
        for _ in range(12):
            p.send_bytes(junk)
        p.sock.recv(1)

    g = fake_guest(script)

    async def unread(c: AsyncClient) -> None:
        s = c.exec_stream(["true"])
        await c._conn.wait(s._call, 30)  # the events are never read

    def run() -> None:
        with Client(g.address) as c, pytest.raises(GuestProtocolError):
            c._run(unread(c.aio))

    assert peak_growth(run) < 64 * MiB


def test_one_frame_may_not_decode_to_gigabytes(fake_guest: Callable[..., FakeGuest]) -> None:
    """Defect 2: the final reply of a request in flight, 4 MiB of empty maps."""

    def script(p: RawPeer) -> None:
        rid, _, _ = next_request(p)
        p.send(Kind.RESPONSE, rid, {"t_ns": 1, "pad": empty_maps(4 * MiB - 64)})
        p.sock.recv(1)

    g = fake_guest(script)

    def run() -> None:
        with Client(g.address) as c, pytest.raises(GuestProtocolError, match="decodes to more"):
            c.ping(deadline=30)

    assert peak_growth(run) < 64 * MiB


def test_nesting_is_bounded(fake_guest: Callable[..., FakeGuest]) -> None:
    """Defect 4: a cell value nested 500 deep reached json.dumps and recursive walks (RecursionError)."""

    def script(p: RawPeer) -> None:
        rid, _, _ = next_request(p)
        deep: object = 1
        for _ in range(500):
            deep = [deep]
        p.send(Kind.RESPONSE, rid, code_reply(results=[{"kind": "result", "data": {"application/json": deep}}]))
        p.sock.recv(1)

    with Client(fake_guest(script).address) as c, pytest.raises(GuestProtocolError, match="nests deeper"):
        c.code_run("x")


def test_frames_for_ids_never_sent_do_not_stall_a_shared_loop(fake_guest: Callable[..., FakeGuest]) -> None:
    """Defect 3: a hostile guest's frames for ids never sent were decoded whole and dropped, and
    never ended its connection: a loop shared with a second guest stalled 0.85 s p50. They are
    skipped undecoded now, and the 17th ends the connection; the good guest's pings keep their
    latency (a generous ratio to its own baseline, not an absolute time)."""
    flood = threading.Event()

    def hostile(p: RawPeer) -> None:
        rid, _, _ = next_request(p)
        junk = encode_frame(Kind.RESPONSE, rid + 1000, {"pad": empty_maps(4 * MiB - 64)})
        flood.wait(30)
        try:
            for _ in range(40):
                p.send_bytes(junk)
        finally:
            p.sock.recv(1)

    def good(p: RawPeer) -> None:
        while True:
            rid, _, _ = next_request(p)
            p.send(Kind.RESPONSE, rid, {"t_ns": 1})

    bad_guest, good_guest = fake_guest(hostile), fake_guest(good)

    async def main() -> tuple[float, float, BaseException | None]:
        loop = asyncio.get_running_loop()
        bad = await AsyncClient.connect(bad_guest.address)
        ok = await AsyncClient.connect(good_guest.address)

        async def rtts(n: int) -> list[float]:
            out = []
            for _ in range(n):
                t0 = loop.time()
                await ok.ping()
                out.append(loop.time() - t0)
            return out

        baseline = statistics.median(await rtts(50))
        pending = asyncio.ensure_future(bad.ping(deadline=60))
        flood.set()
        during = await rtts(200)
        outcome = None
        try:
            await asyncio.wait_for(pending, 60)
        except BaseException as e:
            outcome = e
        await bad.close()
        await ok.close()
        return baseline, statistics.median(during), outcome

    baseline, during, outcome = asyncio.run(main())
    assert isinstance(outcome, GuestProtocolError) and "not in flight" in outcome.message
    assert during < 20 * baseline + 0.02, (baseline, during)


def test_a_cancelled_request_may_still_finish_sending(fake_guest: Callable[..., FakeGuest]) -> None:
    """Late frames of a request the client gave up on are not strays: a download cancelled at
    its deadline may still deliver what its credit allowed, and the connection stays up."""

    def script(p: RawPeer) -> None:
        rid, _, _ = next_request(p)
        while True:  # wait for the client's cancel, then send what the credit allows
            kind, cid, _ = p.recv()
            if kind == Kind.CANCEL and cid == rid:
                break
        for _ in range(60):
            p.send(Kind.EVENT, rid, {"ev": "data", "data": b"d" * 65536})
        p.send(Kind.ERROR, rid, {"code": "cancelled", "message": "cancelled"})
        rid, _, _ = next_request(p)
        p.send(Kind.RESPONSE, rid, {"t_ns": 7})
        p.sock.recv(1)

    with Client(fake_guest(script).address) as c:
        with pytest.raises(GuestdError) as ei:
            c.download("/f", deadline=0.3)
        assert ei.value.code == "timeout"
        assert c.call("ping", deadline=10)["t_ns"] == 7


RESTORE_INFO = [{}, {"generation": "2"}, {"generation": float("inf")}, {"generation": None}, {"generation": -3}]


@pytest.mark.parametrize("snapshot", RESTORE_INFO, ids=["missing", "str", "inf", "nil", "negative"])
def test_restore_reads_a_valid_generation_or_refuses(
    fake_guest: Callable[..., FakeGuest], snapshot: dict[str, object]
) -> None:
    """Defect 4: KeyError, ValueError, OverflowError and TypeError escaped ``restore()``."""
    g = fake_guest(answers({"info": info_reply(snapshot=snapshot), "snapshot.restore": {}}))
    with Client(g.address) as c, pytest.raises(GuestProtocolError, match="generation"):
        c.restore()


BAD_BUNDLES = [{b"image/png": b"x"}, {"text/plain": 5}, {"image/png": 5}, {"application/json": {"k": b"\x00"}}]


@pytest.mark.parametrize("bundle", BAD_BUNDLES, ids=["bytes-key", "text-int", "image-int", "json-bytes"])
def test_code_run_bundles_are_what_the_readme_promises(
    fake_guest: Callable[..., FakeGuest], bundle: dict[object, object]
) -> None:
    """Defect 4: bundle values of the wrong type reached callers (and json.dumps in guestctl)."""
    g = fake_guest(answers({"code.run": code_reply(results=[{"kind": "result", "data": bundle}])}))
    with Client(g.address) as c, pytest.raises(GuestProtocolError, match="results"):
        c.code_run("x")


def test_idle_timeout_alone_still_has_a_client_deadline(
    fake_guest: Callable[..., FakeGuest], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defect 5: exec and shell_run with only idle_timeout_s waited for ever on a silent guest.
    The deadline is one hour; here it is shortened so the test sees it."""
    monkeypatch.setattr(aio, "UNBOUNDED_RUN_DEADLINE", 0.5)

    def silent(p: RawPeer) -> None:
        while True:
            next_request(p)

    with Client(fake_guest(silent).address) as c:
        for call in (
            lambda: c.exec(["sleep", "1"], idle_timeout_s=0.1),
            lambda: c.shell_run("s1", "sleep 1", idle_timeout_s=0.1),
            lambda: c.process_wait("p1"),
        ):
            with pytest.raises(GuestdError) as ei:
                within(10, call)
            assert ei.value.code == "timeout"


def test_a_trickle_of_events_does_not_extend_a_deadline(fake_guest: Callable[..., FakeGuest]) -> None:
    """Defect 5: a deadline applied per event let an event every 0.2 s keep a stream alive."""

    def trickle(p: RawPeer) -> None:
        rid, op, _ = next_request(p)
        ev = {"ev": "stdout", "data": b"."} if op != "process.attach" else {"ev": "stdout", "data": b".", "offset": 0}
        while True:
            p.send(Kind.EVENT, rid, ev)
            time.sleep(0.2)

    async def drain(stream: AsyncIterator[object]) -> None:
        async for _ in stream:
            pass

    makers: list[Callable[[AsyncClient], AsyncIterator[object]]] = [
        lambda a: aiter(a.code_run_stream("x", deadline=1.0)),
        lambda a: aiter(a.exec_stream(["x"], deadline=1.0)),
        lambda a: aiter(a.attach("p1", deadline=1.0)),
    ]
    for make in makers:
        with Client(fake_guest(trickle).address) as c:
            t0 = time.monotonic()

            def run(c: Client = c, make: Callable[[AsyncClient], AsyncIterator[object]] = make) -> None:
                c._run(drain(make(c.aio)))

            with pytest.raises(GuestdError) as ei:
                within(10, run)
            assert ei.value.code == "timeout" and time.monotonic() - t0 < 5


def test_download_enforces_the_announced_size(fake_guest: Callable[..., FakeGuest], tmp_path: Path) -> None:
    """Defect 6: data without a start event, more than announced, or more than max_bytes: an
    error, and no file (the partial one removed)."""
    cases: list[tuple[Callable[[RawPeer, int], None], int | None]] = [
        (lambda p, rid: p.send(Kind.EVENT, rid, {"ev": "data", "data": b"x" * 100}), None),
        (lambda p, rid: send_download(p, rid, b"y" * (1 * MiB), announced=10), None),
        (lambda p, rid: send_download(p, rid, b"z" * (1 * MiB)), 10),
    ]
    for i, (send, max_bytes) in enumerate(cases):

        def script(p: RawPeer, send: Callable[[RawPeer, int], None] = send) -> None:
            rid, _, _ = next_request(p)
            send(p, rid)
            p.sock.recv(1)

        out = tmp_path / f"out{i}"
        out.mkdir()
        with Client(fake_guest(script).address) as c, pytest.raises(GuestProtocolError):
            c.download("/f", str(out / "file"), max_bytes=max_bytes, progress_timeout=10)
        assert os.listdir(out) == []


def within(seconds: float, fn: Callable[[], object]) -> object:
    """``fn()`` in a thread; fails the test (instead of hanging it) when it is not done in time."""
    box: list[object] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            box.append(fn())
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        pytest.fail(f"still waiting after {seconds} s")
    if errors:
        raise errors[0]
    return box[0] if box else None


_RUN = {"id": "r1", "op": "code.run", "state": "done", "target": "c1", "what": "1", "started_at": 1.0}
BAD_RUNS = [
    {**_RUN, "result": {}},  # KeyError 'results'
    {**_RUN, "result": code_reply(results=[{"data": "not a map"}])},  # TypeError in check_bundle
    {**_RUN, "op": "shell.run", "result": {"stdout": 5}},  # KeyError / a str where bytes belong
    {**_RUN, "state": "failed", "error": {"code": 5, "details": "x"}},  # GuestdError(details="x")
    {**_RUN, "state": "failed"},  # no error at all: was "internal" with no message
    {**_RUN, "op": "exec", "result": code_reply()},  # an op no run is kept for
]


@pytest.mark.parametrize("run", BAD_RUNS, ids=["empty", "bundle", "shell", "error", "no-error", "op"])
def test_a_run_record_of_the_wrong_shape_is_a_protocol_error(
    fake_guest: Callable[..., FakeGuest], run: dict[str, object]
) -> None:
    """``result_of`` trusted the run record's ``result`` (a bare map in the schema) and ``error``:
    a compromised guest's record raised KeyError or TypeError, or a GuestdError whose details
    were not a map. Each is a GuestProtocolError now; a well-formed one still reads."""
    from guestd.client.runs import result_of

    g = fake_guest(answers({"run.get": {"run": run}}))
    with Client(g.address) as c, pytest.raises(GuestProtocolError):
        result_of(c.run_get("r1"))
    good = fake_guest(answers({"run.get": {"run": {**_RUN, "result": code_reply(stdout=b"42\n")}}}))
    with Client(good.address) as c:
        assert result_of(c.run_get("r1")).stdout == b"42\n"
