"""Background processes, reattach by offset, rings, signals, stdin, PTYs: real processes, real guestd."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from guestd.client import AsyncClient, Client, GuestdError
from guestd.testing import Guestd, StartGuestd, live_procs_with, unique_sleep

SEQ = "for i in $(seq 1 {n}); do printf '%06d\\n' $i; done"


def numbered(n: int) -> bytes:
    return "".join(f"{i:06d}\n" for i in range(1, n + 1)).encode()


def test_start_returns_at_once_and_survives_its_connection(guestd: Guestd) -> None:
    with guestd.client() as c:
        p = c.process_start("sleep 0.5; echo done")
    with guestd.client() as c:  # a new connection: the process is still there
        listed = {x.id: x for x in c.process_list()}
        assert listed[p.id].state == "running" and listed[p.id].pid == p.pid
        w = c.process_wait(p.id, timeout_s=10)
        assert {k: getattr(w, k) for k in ("state", "exit_code", "signal", "timed_out", "killed_by")} == {
            "state": "exited",
            "exit_code": 0,
            "signal": None,
            "timed_out": False,
            "killed_by": None,
        }
        collected = c.process_output(p.id)
        out, err, final = collected.stdout, collected.stderr, collected.status
        assert (out, err, final.stdout_offset) == (b"done\n", b"", 5)
        c.process_forget(p.id)
        with pytest.raises(GuestdError) as ei:
            c.process_wait(p.id)
        assert ei.value.code == "not_found"


def test_reattach_after_dropped_connection_gets_every_byte_once(guestd: Guestd) -> None:
    n = 20000

    async def go() -> None:
        c = await AsyncClient.connect(guestd.address)
        p = await c.process_start(SEQ.format(n=n) + "; sleep 0.2")
        got = bytearray()
        offset = 0
        a = c.attach(p.id)
        async for name, at, data in a:
            assert name == "stdout" and at == offset
            got += data
            offset = at + len(data)
            if len(got) > 30000:
                break
        await c.close()  # the connection drops mid-stream
        c2 = await AsyncClient.connect(guestd.address)
        a2 = c2.attach(p.id, stdout_from=offset)
        async for name, at, data in a2:
            assert name == "stdout" and at == offset  # resumes exactly where we stopped
            got += data
            offset = at + len(data)
        final = await a2.result()
        assert bytes(got) == numbered(n)
        assert final.stdout_offset == len(got) and final.exit_code == 0
        assert a2.lost_bytes == {"stdout": 0, "stderr": 0}
        await c2.close()

    asyncio.run(go())


def test_ring_overflow_is_reported_as_lost_bytes(guestd: Guestd) -> None:
    with guestd.client() as c:
        p = c.process_start(SEQ.format(n=5000), ring_bytes=7000)
        c.process_wait(p.id, timeout_s=30)

        async def go() -> tuple[bytes, int]:
            a = c.aio.attach(p.id)
            data = bytearray()
            async for _name, _, chunk in a:
                data += chunk
            await a.result()
            return bytes(data), a.lost_bytes["stdout"]

        data, lost = c._run(go())
        full = numbered(5000)
        assert lost == len(full) - 7000 and data == full[-7000:]


def test_stalled_attacher_blocks_neither_process_nor_other_readers(guestd: Guestd) -> None:
    async def go() -> None:
        slow = await AsyncClient.connect(guestd.address, stream_window=64 * 1024)
        fast = await AsyncClient.connect(guestd.address)
        p = await fast.process_start("head -c 5000000 /dev/zero; echo end", ring_bytes=16 << 20)
        stalled = slow.attach(p.id)  # never read: its window fills and stays full
        got = 0
        a = fast.attach(p.id)
        async for _, _, data in a:
            got += len(data)
        assert got == 5_000_004 and (await a.result()).exit_code == 0
        assert (await fast.process_wait(p.id, timeout_s=30)).state == "exited"
        stalled.cancel()
        await slow.close()
        await fast.close()

    asyncio.run(go())


def test_signals_reach_grandchildren_and_kill_sweeps_escapees(client: Client) -> None:
    marker = unique_sleep()
    p = client.process_start(f"sh -c '{marker}' & {marker} & setsid {marker} & wait")

    def sleeps() -> int:
        return sum(1 for x in live_procs_with(marker) if x.name() == "sleep")

    deadline = time.monotonic() + 5
    while sleeps() < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sleeps() == 3  # a grandchild (via sh -c), a child, and one that left the group
    client.process_signal(p.id, "KILL")
    assert client.process_wait(p.id, timeout_s=10).signal == 9
    deadline = time.monotonic() + 5
    while live_procs_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live_procs_with(marker) == []


def test_term_to_the_group(client: Client) -> None:
    p = client.process_start("trap 'echo got-term; exit 5' TERM; echo ready; while :; do sleep 0.05; done")
    deadline = time.monotonic() + 5
    while client.process_list() and not [x for x in client.process_list() if x.id == p.id and x.stdout_offset]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    client.process_signal(p.id, "TERM")
    res = client.process_wait(p.id, timeout_s=10)
    collected = client.process_output(p.id)
    out = collected.stdout
    assert res.exit_code == 5 and out == b"ready\ngot-term\n"
    with pytest.raises(GuestdError):
        client.process_signal(p.id, "TERM")  # exited
    with pytest.raises(GuestdError) as ei:
        client.process_signal(p.id, "NOPE")
    assert ei.value.code == "bad_request"


def test_stdin_write_and_close(client: Client) -> None:
    p = client.process_start(["sh", "-c", 'while read l; do echo "<$l>"; done; echo eof'], stdin=True)
    client.process_write(p.id, "a\nb\n")
    client.process_close_stdin(p.id)
    client.process_wait(p.id, timeout_s=10)
    assert client.process_output(p.id).stdout == b"<a>\n<b>\neof\n"
    q = client.process_start(["true"])
    with pytest.raises(GuestdError) as ei:
        client.process_write(q.id, "x")
    assert ei.value.code == "bad_request"


def test_pty_size_resize_and_an_interactive_repl(client: Client) -> None:
    p = client.process_start(["sh", "-c", "stty size; read x; stty size"], pty=True, rows=33, cols=101, stdin=True)
    deadline = time.monotonic() + 5
    while b"33 101" not in client.process_output(p.id, follow=False).stdout:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    client.process_resize(p.id, 40, 120)
    client.process_write(p.id, "go\r")
    client.process_wait(p.id, timeout_s=10)
    out = client.process_output(p.id).stdout
    assert b"33 101" in out and b"40 120" in out
    repl = client.process_start(["python3", "-q", "-i", "-c", ""], pty=True)
    client.process_write(repl.id, "print(6 * 7)\r")
    deadline = time.monotonic() + 20
    while b"42" not in client.process_output(repl.id, follow=False).stdout:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    client.process_write(repl.id, "\x03")  # ^C through the terminal: KeyboardInterrupt, REPL lives on
    # Type on only after the REPL has handled it: ^C flushes the terminal's pending input.
    while b"KeyboardInterrupt" not in client.process_output(repl.id, follow=False).stdout:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    client.process_write(repl.id, "exit()\r")
    assert client.process_wait(repl.id, timeout_s=20).exit_code == 0


def test_pty_drives_a_pager_and_an_editor_stand_in(client: Client, tmp_path: object) -> None:
    f = f"{tmp_path}/long.txt"
    with open(f, "w") as fh:
        fh.write("".join(f"row {i}\n" for i in range(200)))
    less = client.process_start(["less", f], pty=True, rows=10, cols=40)
    deadline = time.monotonic() + 10
    while b"row 5" not in client.process_output(less.id, follow=False).stdout:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    client.process_write(less.id, "G")  # jump to the end
    while b"row 199" not in client.process_output(less.id, follow=False).stdout:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    client.process_write(less.id, "q")
    assert client.process_wait(less.id, timeout_s=10).exit_code == 0
    repo = f"{tmp_path}/repo"
    os.makedirs(repo)
    editor = f"{tmp_path}/editor.sh"
    with open(editor, "w") as fh:  # a stand-in editor that asks on the terminal, then edits the todo list
        fh.write(
            "#!/bin/sh\nprintf 'squash? ' > /dev/tty; read a < /dev/tty\n"
            '[ "$a" = y ] && sed -i \'2s/^pick/squash/\' "$1"\nexit 0\n'
        )
    os.chmod(editor, 0o755)
    script = (
        "git init -q . && git config user.email t@t && git config user.name t && "
        "for i in 1 2 3; do echo $i > f; git add f; git commit -qm c$i; done && "
        f"GIT_SEQUENCE_EDITOR={editor} GIT_EDITOR=true git rebase -i HEAD~2 && git --no-pager log --format=%s"
    )
    reb = client.process_start(["sh", "-c", script], pty=True, cwd=repo)
    while b"squash?" not in client.process_output(reb.id, follow=False).stdout:
        assert time.monotonic() < deadline + 20
        time.sleep(0.05)
    client.process_write(reb.id, "y\r")
    assert client.process_wait(reb.id, timeout_s=30).exit_code == 0
    log = client.process_output(reb.id).stdout.split(b"squash?")[-1]
    subjects = [ln.strip() for ln in log.replace(b"\r", b"").split(b"\n") if ln.strip() in (b"c1", b"c2", b"c3")]
    assert subjects == [b"c2", b"c1"]  # c3 was squashed into c2 by the answer typed on the terminal


def test_limits_and_bad_input(fresh_guestd: StartGuestd) -> None:
    g = fresh_guestd()
    with g.client() as c:
        with pytest.raises(GuestdError) as ei:
            c.process_start(["true"], ring_bytes=1 << 40)
        assert ei.value.code == "limit" and ei.value.details["limit"] == "max_ring_bytes"
        with pytest.raises(GuestdError) as ei:
            c.process_start(["/nonexistent"])
        assert ei.value.code == "not_found" and ei.value.details["stage"] == "spawn"
        p = c.process_start(["sleep", "30"])
        with pytest.raises(GuestdError) as ei:
            c.process_forget(p.id)
        assert ei.value.code == "bad_request"
        c.process_signal(p.id, "KILL")
        c.process_wait(p.id, timeout_s=10)
        c.process_forget(p.id)


def test_kept_processes_are_bounded_and_expire(fresh_guestd: StartGuestd) -> None:
    g = fresh_guestd("--max-processes", "2", "--max-kept-processes", "3", "--process-retention", "1")
    with g.client() as c:
        a = c.process_start(["sleep", "30"])
        c.process_start(["sleep", "30"])
        with pytest.raises(GuestdError) as ei:
            c.process_start(["true"])
        assert ei.value.code == "limit" and ei.value.details["limit"] == "max_processes"
        c.process_signal(a.id, "KILL")
        c.process_wait(a.id, timeout_s=10)
        done = [c.process_start(["true"]).id]
        c.process_wait(done[0], timeout_s=10)
        # 3 kept (1 running, 2 finished): a new start drops the oldest finished one
        new = c.process_start(["true"])
        ids = {p.id for p in c.process_list()}
        assert a.id not in ids and done[0] in ids and new.id in ids
        c.process_wait(new.id, timeout_s=10)
        time.sleep(1.2)  # past the 1 s retention
        c.process_start(["true"])  # retention is enforced on each start (and by a periodic sweep)
        assert done[0] not in {p.id for p in c.process_list()}


def test_concurrent_stdin_writes_arrive_whole_and_in_order(guestd: Guestd) -> None:
    # Issue 21, defect 6: a second write in flight replaced the first's writer (2 x 200,000
    # bytes sent, 265,536 received out of order, the first write failing after 30 s).
    import hashlib

    chunks = [bytes([65 + i]) * 200_000 for i in range(2)] + [bytes([67 + i]) * 4096 for i in range(16)]

    async def go() -> None:
        c = await AsyncClient.connect(guestd.address)
        p = await c.process_start(["sha256sum"], stdin=True)
        written = await asyncio.gather(*(c.process_write(p.id, ch, deadline=30) for ch in chunks))
        assert written == [len(ch) for ch in chunks]
        await c.process_close_stdin(p.id)
        assert (await c.process_wait(p.id, timeout_s=10)).exit_code == 0
        collected = await c.process_output(p.id)
        out = collected.stdout
        assert out.split()[0].decode() == hashlib.sha256(b"".join(chunks)).hexdigest()
        await c.close()

    asyncio.run(go())


def test_a_stdin_write_the_process_does_not_take_is_a_typed_timeout(
    fresh_guestd: StartGuestd, tmp_path: object
) -> None:
    # Before: io_error with an empty message (TimeoutError is an OSError in Python 3.11).
    conf = f"{tmp_path}/guestd.toml"
    with open(conf, "w") as f:
        f.write("[processes]\nstdin_timeout_s = 1\n")
    g = fresh_guestd("--config", conf)

    async def go() -> None:
        c = await AsyncClient.connect(g.address)
        p = await c.process_start(["sleep", "60"], stdin=True)  # never reads

        async def queue_behind() -> int:
            # Arrives well after the first: the first's deadline ends its turn before this one's
            # (CI, loaded machine: this queued write failed io_error, not timeout).
            await asyncio.sleep(0.3)
            return await c.process_write(p.id, b"y", deadline=30)

        first, queued, same_time = await asyncio.gather(
            c.process_write(p.id, b"x" * 1_000_000, deadline=30),
            queue_behind(),
            c.process_write(p.id, b"z", deadline=30),
            return_exceptions=True,
        )
        assert isinstance(first, GuestdError) and first.code == "timeout", first
        assert 0 < first.details["written"] < 1_000_000 and first.message
        for behind in (queued, same_time):
            assert isinstance(behind, GuestdError) and behind.code == "timeout", behind
            assert behind.details == {"process": p.id, "written": 0, "stage": "queue"}
        await c.process_signal(p.id, "KILL")
        await c.close()

    asyncio.run(go())


def test_a_write_to_an_exited_process_says_it_exited(client: Client) -> None:
    for kw in ({"pty": True}, {"stdin": True}):
        p = client.process_start(["true"], **kw)  # type: ignore[arg-type]
        client.process_wait(p.id, timeout_s=10)
        with pytest.raises(GuestdError) as ei:
            client.process_write(p.id, "late\r")
        assert ei.value.code == "bad_request" and "exited" in ei.value.message, (kw, ei.value)


def test_spill_keeps_every_byte_the_ring_drops(fresh_guestd: StartGuestd, tmp_path: object) -> None:
    """process.start spill: the files hold each stream from byte 0, so [0, ring_start) read back
    from the file plus what attach still delivers from the ring is the whole stream; the
    per-stream cap stops a spill with its reason; wait and list name the files; forget removes
    them; without spill the ring start is still reported and no file is named."""
    from guestd.testing.local import limits_config

    g = fresh_guestd("--config", limits_config(str(tmp_path), max_spill_bytes=200_000))
    with g.client() as c:
        full, err = numbered(5000), b"e" * 3000
        p = c.process_start(
            "seq -f '%06g' 1 5000; head -c 3000 /dev/zero | tr '\\0' e >&2", ring_bytes=7000, spill=True
        )
        w = c.process_wait(p.id, timeout_s=60)
        assert w.state == "exited" and w.exit_code == 0
        assert w.stdout_ring_start == len(full) - 7000 and w.stderr_ring_start == 0
        out_spill, err_spill = w.stdout_spill, w.stderr_spill
        assert out_spill is not None and err_spill is not None
        assert (out_spill.bytes, out_spill.stopped) == (len(full), None)
        assert (err_spill.bytes, err_spill.stopped) == (len(err), None)
        dropped = c.read_file(out_spill.path, offset=0, length=w.stdout_ring_start)
        collected = c.process_output(p.id)  # from offset 0: the ring's part only
        out, errout = collected.stdout, collected.stderr
        assert len(out) == 7000 and dropped + out == full
        assert c.read_file(err_spill.path) == err == errout
        listed = next(x for x in c.process_list() if x.id == p.id)
        assert listed.stdout_spill == out_spill and listed.stdout_ring_start == w.stdout_ring_start

        # The cap: the file holds the stream's first max_spill_bytes, and says why it stopped.
        big = c.process_start("seq -f '%06g' 1 40000", ring_bytes=1000, spill=True)
        wb = c.process_wait(big.id, timeout_s=60)
        assert wb.stdout_spill is not None
        assert (wb.stdout_spill.bytes, wb.stdout_spill.stopped) == (200_000, "cap")
        assert wb.stdout_ring_start == 40000 * 7 - 1000
        tail = c.read_file(wb.stdout_spill.path, offset=199_000, length=2000)
        assert tail == numbered(40000)[199_000:200_000]

        # Without spill: the ring start, no file.
        q = c.process_start("seq -f '%06g' 1 2000", ring_bytes=1000)
        wq = c.process_wait(q.id, timeout_s=60)
        assert wq.stdout_ring_start == 2000 * 7 - 1000 and wq.stdout_spill is None

        # forget: the files go with the process.
        c.process_forget(p.id)
        deadline = time.monotonic() + 10
        # Removed one after the other, after their pending writes: wait (bounded) for both.
        while (os.path.exists(out_spill.path) or os.path.exists(err_spill.path)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(out_spill.path) and not os.path.exists(err_spill.path)
