"""Commands that outlive their timeout (on_timeout "detach"): real guestd, real bash, a real
``python3 -m http.server`` on loopback, real background-process rings."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator

import pytest

from guestd.client import AsyncClient, Client, GuestdError
from guestd.client.results import CodeResult, ExecResult, ShellResult
from guestd.testing import Guestd, StartGuestd

# Prints its port, then a numbered line every 20 ms until stopped: a gap or a duplicate in
# what the detached process delivers shows as a broken sequence.
TICKER = (
    "import sys, time\n"
    "i = 0\n"
    "while True:\n"
    "    print(i, flush=True); i += 1\n"
    "    if i % 7 == 0: print('e', i, file=sys.stderr, flush=True)\n"
    "    time.sleep(0.02)\n"
)


@pytest.fixture
def sh(client: Client, tmp_path: object) -> Iterator[tuple[Client, str]]:
    s = client.shell_create(cwd=str(tmp_path))
    yield client, s.id
    client.shell_close(s.id)


def _ask(c: Client, port: int) -> bytes:
    """One GET from another exec: the server answers, or this fails."""
    probe = f"import urllib.request as u; print(u.urlopen('http://127.0.0.1:{port}/', timeout=5).status)"
    return c.exec(["python3", "-c", probe], timeout_s=20).stdout


def _numbers(out: bytes) -> list[int]:
    return [int(x) for x in out.split()]


def test_shell_timeout_detaches_a_server_and_the_session_goes_on(sh: tuple[Client, str], tmp_path: object) -> None:
    c, sid = sh
    assert c.shell_run(sid, "mkdir -p sub && cd sub && X=kept && greet() { echo hi-$1; }").exit_code == 0
    r = c.shell_run(
        sid,
        'echo "x=$X $(greet job)"; exec python3 -u -m http.server 0 --bind 127.0.0.1',
        timeout_s=1.5,
        on_timeout="detach",
    )
    assert (r.timed_out, r.exit_code, r.interrupted, r.session_restarted) == ("wall", None, False, False)
    assert r.detached is not None and r.cwd == f"{tmp_path}/sub"
    m = re.search(rb"port (\d+)", r.stdout)
    assert m is not None and r.stdout.startswith(b"x=kept hi-job\n"), r.stdout  # the session's state
    port = int(m.group(1))
    assert _ask(c, port) == b"200\n"  # still serving after the timeout
    # The session has its prompt back, in its directory, with its variables.
    nxt = c.shell_run(sid, 'pwd; echo "$X"', timeout_s=10)
    assert nxt.stdout == f"{tmp_path}/sub\nkept\n".encode() and nxt.exit_code == 0
    # A normal background process: listed, attached from offset 0 with no gap.
    listed = {p.id: p for p in c.process_list()}
    assert listed[r.detached].state == "running"
    collected = c.process_output(r.detached, follow=False)
    out, err, final = collected.stdout, collected.stderr, collected.status
    assert out.startswith(r.stdout) and final.stdout_offset == len(out) >= r.stdout_bytes
    assert b'"GET / HTTP/1.1" 200' in err  # what it logged after the hand-over is in its ring
    c.process_signal(r.detached, "TERM")
    w = c.process_wait(r.detached, timeout_s=10)
    assert w.state == "exited" and w.signal == 15, w


def test_contained_detached_job_leaves_the_session_and_kill_ends_all_of_it(contained: Guestd) -> None:
    """Workload user and a cgroup per run: the job's processes (a forked child included) move to
    a leaf of their own, so closing the session spares them and KILL of the process ends them all."""
    with contained.client() as c:
        sid = c.shell_create(cwd="/tmp").id
        r = c.shell_run(
            sid,
            "sleep 300 & echo child=$!; exec python3 -u -m http.server 0 --bind 127.0.0.1",
            timeout_s=1.5,
            on_timeout="detach",
        )
        assert r.detached is not None and r.timed_out == "wall"
        port = int(re.search(rb"port (\d+)", r.stdout).group(1))  # type: ignore[union-attr]
        child = int(re.search(rb"child=(\d+)", r.stdout).group(1))  # type: ignore[union-attr]
        c.shell_close(sid)
        assert _ask(c, port) == b"200\n"  # the session's end did not end the job
        assert c.exec(["kill", "-0", str(child)]).exit_code == 0
        c.process_signal(r.detached, "KILL")
        assert c.process_wait(r.detached, timeout_s=10).signal == 9
        gone = c.exec(f"for i in $(seq 100); do kill -0 {child} 2>/dev/null || exit 0; sleep 0.05; done; exit 1")
        assert gone.exit_code == 0  # the forked child went with its leaf


def test_shell_detach_output_is_continuous_from_byte_0(sh: tuple[Client, str]) -> None:
    c, sid = sh
    r = c.shell_run(sid, f"python3 -c {_q(TICKER)}", timeout_s=1.5, on_timeout="detach")
    assert r.detached is not None and r.timed_out == "wall"
    try:
        first = _numbers(r.stdout)
        assert first == list(range(len(first))) and len(first) > 0
        collected = c.process_output(r.detached, stdout_from=0, follow=False)
        out, err = collected.stdout, collected.stderr
        seen = _numbers(out)
        assert seen[: len(first)] == first and seen == list(range(len(seen)))  # no gap, no repeat
        assert err.startswith(r.stderr)
    finally:
        c.process_signal(r.detached, "KILL")
    assert c.process_wait(r.detached, timeout_s=10).signal == 9


def test_shell_detach_mode_command_that_ends_in_time(sh: tuple[Client, str]) -> None:
    c, sid = sh
    r = c.shell_run(sid, "echo out; echo err >&2; exit 3; echo never", timeout_s=10, on_timeout="detach")
    assert (r.exit_code, r.detached, r.timed_out, r.stdout, r.stderr) == (3, None, None, b"out\n", b"err\n")
    r = c.shell_run(sid, "cat; nosuchcmd", input=b"typed\n", timeout_s=10, on_timeout="detach")
    assert r.stdout == b"typed\n" and r.stderr == b"bash: line 1: nosuchcmd: command not found\n"
    assert r.exit_code == 127
    # What a detach-mode command changes stays in its subshell (PROTOCOL.md 10).
    r = c.shell_run(sid, "cd / && Y=1", timeout_s=10, on_timeout="detach")
    assert isinstance(r.cwd, str) and r.cwd != "/"
    assert c.shell_run(sid, 'echo "[$Y]"; pwd').stdout == f"[]\n{r.cwd}\n".encode()


def test_exec_timeout_detaches_with_continuous_output(client: Client) -> None:
    c = client
    r = c.exec(["python3", "-c", TICKER], timeout_s=1.5, on_timeout="detach")
    assert r.timed_out == "wall" and r.detached is not None and (r.exit_code, r.signal) == (None, None)
    try:
        first = _numbers(r.stdout)
        assert first == list(range(len(first))) and len(first) > 0
        collected = c.process_output(r.detached, follow=False)
        out, err = collected.stdout, collected.stderr
        seen = _numbers(out)
        assert seen[: len(first)] == first and seen == list(range(len(seen)))
        assert err.startswith(r.stderr) and len(err) >= len(r.stderr)
        assert {p.id: p.pid for p in c.process_list()}[r.detached] == r.pid
    finally:
        c.process_signal(r.detached, "TERM")
    assert c.process_wait(r.detached, timeout_s=10).signal == 15
    done = c.exec("echo quick", timeout_s=10, on_timeout="detach")
    assert (done.exit_code, done.detached, done.stdout) == (0, None, b"quick\n")


def test_detach_is_bounded_by_the_process_table(fresh_guestd: StartGuestd) -> None:
    g: Guestd = fresh_guestd("--max-processes", "1")
    with g.client() as c:
        p = c.process_start("sleep 30")
        with pytest.raises(GuestdError) as ei:
            c.exec("sleep 30", timeout_s=0.2, on_timeout="detach")
        assert ei.value.code == "limit" and ei.value.details["limit"] == "max_processes"
        s = c.shell_create()
        with pytest.raises(GuestdError) as ei:
            c.shell_run(s.id, "sleep 30", timeout_s=0.2, on_timeout="detach")
        assert ei.value.code == "limit"
        assert c.shell_run(s.id, "echo usable").stdout == b"usable\n"
        c.process_signal(p.id, "KILL")


def _q(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


# Interleaved writes to both streams, each line its own write: a terminal shows them in
# exactly this order.
INTERLEAVED = "for i in $(seq 1 200); do echo out$i; echo err$i >&2; done"
INTERLEAVED_BYTES = "".join(f"out{i}\nerr{i}\n" for i in range(1, 201)).encode()


def test_merge_stderr_is_the_order_a_terminal_shows(client: Client) -> None:
    c = client
    # The terminal's view: the same command on a pty (a terminal writes \r\n for \n).
    p = c.process_start(["bash", "-c", "stty -onlcr; " + INTERLEAVED], pty=True)
    c.process_wait(p.id, timeout_s=20)
    collected = c.process_output(p.id, follow=False)
    terminal = collected.stdout
    assert terminal == INTERLEAVED_BYTES
    r = c.exec(INTERLEAVED, merge_stderr=True, timeout_s=20)
    assert (r.stdout, r.stderr, r.stdout_bytes, r.stderr_bytes) == (terminal, b"", len(terminal), 0)
    unmerged = c.exec(INTERLEAVED, timeout_s=20)
    assert unmerged.stdout + unmerged.stderr != terminal and unmerged.stdout_bytes + unmerged.stderr_bytes == len(
        terminal
    )
    small = c.exec(INTERLEAVED, merge_stderr=True, max_output=100, timeout_s=20)
    assert small.stdout == terminal[-100:] and small.stdout_dropped == len(terminal) - 100
    q = c.process_start(INTERLEAVED, merge_stderr=True)
    c.process_wait(q.id, timeout_s=20)
    collected = c.process_output(q.id, follow=False)
    out, err, final = collected.stdout, collected.stderr, collected.status
    assert (out, err, final.stderr_offset) == (terminal, b"", 0)


def test_merge_stderr_in_a_session(sh: tuple[Client, str]) -> None:
    c, sid = sh
    r = c.shell_run(sid, INTERLEAVED + "; nosuchcmd", merge_stderr=True)
    tail = b"bash: line 1: nosuchcmd: command not found\n"
    assert (r.stdout, r.stderr, r.exit_code) == (INTERLEAVED_BYTES + tail, b"", 127)
    assert c.shell_run(sid, "echo back >&2").stderr == b"back\n"  # only that command was merged
    # Detach mode: both FIFO opens are one FIFO, so the job's output is merged too.
    r = c.shell_run(sid, INTERLEAVED, merge_stderr=True, timeout_s=20, on_timeout="detach")
    assert (r.stdout, r.stderr, r.detached) == (INTERLEAVED_BYTES, b"", None)
    r = c.shell_run(sid, "echo a; echo b >&2; sleep 30", merge_stderr=True, timeout_s=0.5, on_timeout="detach")
    assert r.detached is not None and r.stdout == b"a\nb\n"
    try:
        collected = c.process_output(r.detached, follow=False)
        out, err = collected.stdout, collected.stderr
        assert (out, err) == (b"a\nb\n", b"")
    finally:
        c.process_signal(r.detached, "KILL")


def test_check_syntax_reports_bash_message_and_runs_nothing(sh: tuple[Client, str], tmp_path: object) -> None:
    c, sid = sh
    for bad, words in (
        ("touch ran; echo )", "syntax error near unexpected token `)'"),
        ("touch ran\nif true; then echo x", "syntax error: unexpected end of file"),
    ):
        with pytest.raises(GuestdError) as ei:
            c.shell_run(sid, bad, check_syntax=True)
        e = ei.value
        assert e.code == "bad_request" and e.details["stage"] == "syntax", e
        assert words in e.details["message"] and "line" in e.details["message"]
        assert c.shell_run(sid, "ls ran 2>/dev/null || echo absent").stdout == b"absent\n"  # nothing ran
        plain = c.shell_run(sid, bad.replace("touch ran", "true"))  # without the check it runs, and fails
        assert plain.exit_code == 2 and b"syntax error" in plain.stderr
    ok = c.shell_run(sid, "shopt -s extglob; touch a.x b.y\nls !(*.x)", check_syntax=True)
    assert ok.stdout == b"b.y\n" and ok.exit_code == 0


def test_shell_stream_output_under_flow_control_and_typed_stdin(guestd: Guestd) -> None:
    """shell.run stream: everything in order within a small window (the command blocks on its
    pipe meanwhile, the session's state is there); stdin_stream: answers typed into `read -p`
    and a Python REPL while they run; detach keeps a streamed stdin for process.write."""

    async def go() -> None:
        c = await AsyncClient.connect(guestd.address, stream_window=64 * 1024)
        sid = (await c.shell_create()).id
        await c.shell_run(sid, "N=300000; cd /tmp")
        s = c.shell_stream(sid, 'seq 1 "$N"; pwd >&2')
        out, err = bytearray(), bytearray()
        async for name, data in s:
            (out if name == "stdout" else err).extend(data)
            await asyncio.sleep(0)  # a slow-ish consumer: credit must throttle the command
        r = await s.result()
        assert bytes(out) == "".join(f"{i}\n" for i in range(1, 300001)).encode() and bytes(err) == b"/tmp\n"
        assert (r.stdout, r.stdout_bytes, r.stdout_dropped, r.exit_code) == (b"", len(out), 0, 0)
        # A stalled stream holds its session, not guestd.
        s = c.shell_stream(sid, "yes | head -c 5000000")
        for _ in range(10):
            await c.ping()
        assert (await c.exec(["echo", "other"])).stdout == b"other\n"
        n = 0
        async for _, data in s:
            n += len(data)
        assert n == 5_000_000 and (await s.result()).exit_code == 0

        # read -p prompts only on a terminal (pty: true); the answer gets through either way.
        cmd = 'read -r -p "name? " who; echo "hello $who"; echo "more?"; read -r x; echo "$x!"'
        s = c.shell_stream(sid, cmd, stdin_stream=True)
        await s.write_stdin(b"ada\n")
        seen = bytearray()
        async for _, data in s:
            seen += data
            if seen.endswith(b"more?\n"):
                await s.write_stdin(b"second\n")
                await s.close_stdin()
        r = await s.result()
        assert bytes(seen) == b"hello ada\nmore?\nsecond!\n" and r.exit_code == 0

        s = c.shell_stream(sid, "python3 -i -q -u 2>&1", stdin_stream=True, merge_stderr=True)
        seen = bytearray()
        sent = 0
        async for _, data in s:
            seen += data
            if seen.count(b">>> ") > sent:
                sent += 1
                await s.write_stdin(b"6 * 7\n" if sent == 1 else b"exit()\n")
        r = await s.result()
        assert b"42\n" in seen and r.exit_code == 0

        s = c.shell_stream(sid, "echo ready; cat", stdin_stream=True, timeout_s=1.0, on_timeout="detach")
        async for _, _data in s:
            pass
        r = await s.result()
        assert r.detached is not None and r.timed_out == "wall"
        assert await c.process_write(r.detached, b"after detach\n") == 13
        await c.process_close_stdin(r.detached)
        w = await c.process_wait(r.detached, timeout_s=10)
        assert w.exit_code == 0
        collected = await c.process_output(r.detached, follow=False)
        out2 = collected.stdout
        assert out2 == b"ready\nafter detach\n"
        await c.shell_close(sid)
        await c.close()

    asyncio.run(go())


def test_guestctl_on_timeout_merge_and_check_syntax(guestd: Guestd) -> None:
    import json

    r = guestd.guestctl(
        "--json", "exec", "--timeout", "0.5", "--on-timeout", "detach", "--", "sh", "-c", "echo up; sleep 30"
    )
    obj = json.loads(r.stdout)
    assert r.returncode == 124 and obj["stdout"] == "up\n" and obj["detached"].startswith("p")
    assert guestd.guestctl("kill", obj["detached"], "KILL").returncode == 0
    assert guestd.guestctl("wait", obj["detached"]).returncode == 137
    s = guestd.guestctl("shell", "new").stdout.decode().strip()
    r = guestd.guestctl("shell", "run", s, "echo up; sleep 30", "--timeout", "0.5", "--on-timeout", "detach")
    assert r.returncode == 124 and r.stdout == b"up\n" and b"goes on as process p" in r.stderr
    pid = r.stderr.split(b"goes on as process ")[1].split()[0].decode()
    assert guestd.guestctl("kill", pid, "KILL").returncode == 0
    r = guestd.guestctl("shell", "run", s, "echo a; echo b >&2; echo c", "--merge-stderr")
    assert (r.returncode, r.stdout, r.stderr) == (0, b"a\nb\nc\n", b"")
    r = guestd.guestctl("shell", "run", s, "echo ran; fi", "--check-syntax")
    assert r.returncode != 0 and b"syntax error" in r.stderr and b"ran" not in r.stdout
    r = guestd.guestctl("exec", "--merge-stderr", "--", "sh", "-c", "echo x; echo y >&2")
    assert (r.stdout, r.stderr) == (b"x\ny\n", b"")
    assert guestd.guestctl("shell", "rm", s).returncode == 0


def test_shell_pty_in_session_state_with_expect_and_ctrl_c(guestd: Guestd, tmp_path: object) -> None:
    """shell.run pty: the command sees the session's unexported variable and function and a
    terminal on stdin/stdout; `read -p` prompts and takes a typed answer; a Python REPL
    answers, and Ctrl-C through the protocol interrupts the loop it runs while the REPL, the
    session's bash and its cwd stay; bad combinations are refused."""
    from guestd.client.expect import Expect, ExpectEOF

    async def go() -> None:
        c = await AsyncClient.connect(guestd.address)
        sid = (await c.shell_create(cwd=str(tmp_path))).id
        await c.shell_run(sid, 'secret=unexported; greet() { echo "hi $1 ($secret)"; }; cd /tmp')
        bash_pid = (await c.shell_list())[0].pid
        cmd = '[ -t 0 ] && [ -t 1 ] && echo tty-ok; read -r -p "name? " who; greet "$who"'
        async with Expect.start(c, sid, cmd, timeout_s=20) as e:
            m = await e.expect(rb"name\? ", timeout=10)
            assert m.group(0) == b"name? "  # the match stays valid after its bytes are consumed
            assert b"tty-ok" in e.before
            await e.sendline("ada")
            await e.expect(rb"hi ada \(unexported\)\r\n", timeout=10)
            r = await e.wait(timeout=10)
        assert r.exit_code == 0 and r.cwd == "/tmp" and not r.interrupted

        async with Expect.start(c, sid, "python3 -q -i", timeout_s=30) as e:
            await e.expect(b">>> ", timeout=10)
            await e.sendline("6 * 7")
            await e.expect(b"42\r\n>>> ", timeout=10)
            await e.sendline("while True: pass")
            await e.sendline("")
            await e.expect(rb"\.\.\. ", timeout=10)
            await e.interrupt()
            await e.expect(rb"KeyboardInterrupt\r\n>>> ", timeout=10)
            await e.sendline("print('still', 1 + 1)")
            await e.expect(b"still 2", timeout=10)
            await e.sendline("exit()")  # not ^D: readline may switch the terminal's mode around it
            r = await e.wait(timeout=10)
            with pytest.raises(ExpectEOF):
                await e.expect(b"never", timeout=5)
        assert r.exit_code == 0 and not r.interrupted and not r.session_restarted
        after = await c.shell_run(sid, 'echo "$PWD $secret"; greet again')
        assert after.stdout == b"/tmp unexported\nhi again (unexported)\n"
        assert (await c.shell_list())[0].pid == bash_pid  # the same bash throughout

        # Ctrl-C ends a foreground program that does not catch it: the command reports 130.
        async with Expect.start(c, sid, "echo go; sleep 61; echo not-reached", timeout_s=30) as e:
            await e.expect(b"go\r\n", timeout=10)
            # Until sleep has exec'd: a SIGINT between bash's fork and the exec is caught by
            # bash's own handler in the child and lost, as Ctrl-C in a terminal would be.
            wait = "i=0; until pgrep -fx 'sleep 61' >/dev/null; do [ $((i+=1)) -lt 500 ] || exit 1; sleep .01; done"
            assert (await c.exec(["sh", "-c", wait])).exit_code == 0
            await e.interrupt()
            r = await e.wait(timeout=10)
        assert r.exit_code == 130 and b"not-reached" not in r.stdout and not r.session_restarted
        # eof is ^D: the end of input for a read blocked at the start of a line.
        async with Expect.start(c, sid, "cat; echo cat-ended", timeout_s=20) as e:
            await e.sendline("abc")
            await e.expect(b"abc\r\nabc\r\n", timeout=10)  # the echo, then cat's copy
            await e.send_eof()
            await e.expect(b"cat-ended\r\n", timeout=10)
            assert (await e.wait(timeout=10)).exit_code == 0

        # A pager pages (keys from the terminal) and quits.
        async with Expect.start(c, sid, "seq 1 100 | less", timeout_s=20) as e:
            await e.expect(b"23\r\n", timeout=10)
            assert b"24\r\n" not in e.buffer + e.before  # one screen (24 rows: 23 lines and the prompt)
            await e.send(b" ")
            await e.expect(b"46\r\n", timeout=10)
            await e.send(b"q")
            assert (await e.wait(timeout=10)).exit_code == 0
        # A timeout ends a pty command as any other; the session goes on.
        async with Expect.start(c, sid, "sleep 60", timeout_s=1.0) as e:
            r = await e.wait(timeout=20)
        assert (r.timed_out, r.interrupted, r.exit_code, r.session_restarted) == ("wall", True, 130, False)
        assert (await c.shell_run(sid, "echo $secret")).stdout == b"unexported\n"
        for bad in ({"input": b"x"}, {"stdin_stream": True}, {"on_timeout": "detach", "timeout_s": 1.0}):
            with pytest.raises(GuestdError) as ei:
                await c._conn.request("shell.run", {"id": sid, "command": "true", "pty": True, **bad}, 10)
            assert ei.value.code == "bad_request"
        await c.shell_close(sid)
        await c.close()

    asyncio.run(go())


def test_shell_pty_git_add_p_through_expect(guestd: Guestd, tmp_path: object) -> None:
    """A real `git add -p` answered hunk by hunk: the first staged, the second not."""
    from guestd.client.expect import Expect

    async def go() -> None:
        c = await AsyncClient.connect(guestd.address)
        sid = (await c.shell_create(cwd=str(tmp_path))).id
        setup = (
            "export GIT_CONFIG_NOSYSTEM=1 HOME=$PWD GIT_PAGER=cat; git init -q r && cd r && "
            "git config user.email a@b && git config user.name a && "
            "seq 1 40 > f && git add f && git commit -qm one && "
            "sed -i -e 's/^2$/two/' -e 's/^38$/thirty-eight/' f"
        )
        assert (await c.shell_run(sid, setup)).exit_code == 0
        async with Expect.start(c, sid, "git add -p", timeout_s=30) as e:
            assert (await e.expect(rb"\x1b\[", timeout=10)) is not None  # a terminal: git colours
            await e.expect(rb"\(1/2\) Stage this hunk \[[^]]*\]\? ", timeout=10)
            assert re.search(rb"\+(\x1b\[[0-9;]*m)*two", e.before)
            await e.sendline("y")
            await e.expect(rb"\(2/2\) Stage this hunk \[[^]]*\]\? ", timeout=10)
            assert re.search(rb"\+(\x1b\[[0-9;]*m)*thirty-eight", e.before)
            await e.sendline("n")
            r = await e.wait(timeout=10)
        assert r.exit_code == 0
        staged = await c.shell_run(sid, "git diff --cached -U0 | grep '^[+-][^+-]'")
        assert staged.stdout == b"-2\n+two\n"
        unstaged = await c.shell_run(sid, "git diff -U0 | grep '^[+-][^+-]'")
        assert unstaged.stdout == b"-38\n+thirty-eight\n"
        await c.shell_close(sid)
        await c.close()

    asyncio.run(go())


def test_kept_runs_survive_their_connection_and_are_bounded(fresh_guestd: StartGuestd, tmp_path: object) -> None:
    """keep: a code.run of time.sleep(3); 42 goes on after its client disconnects and run.wait
    from a new connection gives 42; a kept shell.run whose request is cancelled is not
    interrupted; a result delivered normally carries run_id and run.get gives it again; at
    max_kept_runs with no result seen the next kept run is a typed limit error, and once one
    is seen it makes room; keep with stream is refused."""
    from guestd.client.runs import result_of, run_get, run_list, run_wait, start_kept
    from guestd.testing.local import limits_config

    g = fresh_guestd("--config", limits_config(str(tmp_path), max_kept_runs=3))

    async def go() -> None:
        c = await AsyncClient.connect(g.address)
        cell = await start_kept(c, "code.run", {"code": "import time; time.sleep(3); 42"})
        sid = (await c.shell_create(cwd=str(tmp_path))).id
        shell = await start_kept(c, "shell.run", {"id": sid, "command": "sleep 1; echo done; pwd"})
        await c.close()  # both requests go with the connection; the runs do not

        c = await AsyncClient.connect(g.address)
        running = {r.id: r for r in await run_list(c)}
        assert running[cell].op == "code.run" and running[cell].result is None
        rec = await run_wait(c, shell, timeout_s=20)
        assert rec.state == "done"
        r = result_of(rec)
        assert isinstance(r, ShellResult) and (r.exit_code, r.interrupted) == (0, False)
        assert r.stdout == f"done\n{tmp_path}\n".encode()
        rec = await run_wait(c, cell, timeout_s=30)
        code = result_of(rec)
        assert isinstance(code, CodeResult) and code.status == "ok" and code.text == "42"

        # Delivered normally: the result names its run, run.get gives it again.
        r = await c.shell_run(sid, "echo again", keep=True)
        assert r.run_id is not None and r.stdout == b"again\n"
        again = result_of(await run_get(c, r.run_id))
        assert isinstance(again, ShellResult) and again.stdout == b"again\n"

        # The cap (3): the shell and cell runs were seen (run.wait), "again" too; three
        # unseen ones fill it after evicting those, a fourth is refused.
        # They wait for a gate: one that ended before its request's cancel arrived would have
        # had its result delivered in the response (and could make room).
        gate = f"{tmp_path}/gate"
        wait = f"i=0; while [ ! -e {gate} ] && [ $i -lt 3000 ]; do sleep 0.01; i=$((i+1)); done; "
        unseen = [
            await start_kept(c, "shell.run", {"id": sid, "command": wait + f"echo {i}", "timeout_s": 60})
            for i in range(3)
        ]
        with pytest.raises(GuestdError) as ei:
            await start_kept(c, "shell.run", {"id": sid, "command": "echo four"})
        assert ei.value.code == "limit" and ei.value.details["limit"] == "max_kept_runs"
        open(gate, "w").close()
        with pytest.raises(GuestdError) as ei:
            await run_get(c, cell)  # made room for the unseen ones
        assert ei.value.code == "not_found"
        first = result_of(await run_wait(c, unseen[0], timeout_s=20))
        assert first.stdout == b"0\n"
        await start_kept(c, "shell.run", {"id": sid, "command": "echo four"})  # room again
        assert {r.id for r in await run_list(c)} >= set(unseen[1:])
        with pytest.raises(GuestdError) as ei:
            await c._conn.request("shell.run", {"id": sid, "command": "true", "keep": True, "stream": True}, 10)
        assert ei.value.code == "bad_request"
        await c.close()

    asyncio.run(go())


def test_spill_files_hold_exactly_the_dropped_bytes(fresh_guestd: StartGuestd, tmp_path: object) -> None:
    """spill: exec (head_tail) and shell.run (tail) keep a small reply while the files hold
    the full streams; the dropped range [gap_at, gap_at + dropped) read back from the file
    is exactly what the reply lacks; the per-stream cap stops a spill with a reason and a
    prefix of the stream; the spill directory is guestd's own (0700) and spill with stream
    is refused."""
    import os
    import stat

    from guestd.testing.local import limits_config

    g = fresh_guestd("--config", limits_config(str(tmp_path), max_spill_bytes=1_000_000))
    gen = "seq 1 120000; echo err-1 >&2; seq 5 9 >&2"
    full = "".join(f"{i}\n" for i in range(1, 120001)).encode()  # 763,895 bytes
    err_full = b"err-1\n5\n6\n7\n8\n9\n"

    async def go() -> None:
        c = await AsyncClient.connect(g.address)
        r = await c.exec(gen, max_output=1000, head_tail=True, spill=True)
        assert r.stdout_spill is not None and r.stderr_spill is not None
        assert (r.stdout_spill.bytes, r.stdout_spill.stopped) == (len(full), None)
        assert r.stdout_bytes == len(full) and r.stdout_dropped == len(full) - 1000 and r.stdout_gap_at == 500
        dropped = await c.read_file(r.stdout_spill.path, offset=r.stdout_gap_at, length=r.stdout_dropped)
        assert r.stdout[:500] + dropped + r.stdout[500:] == full
        assert await c.read_file(r.stderr_spill.path) == err_full == r.stderr
        d = os.path.dirname(r.stdout_spill.path)
        st = os.stat(d)
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
        assert stat.S_IMODE(os.stat(r.stdout_spill.path).st_mode) == 0o600

        sid = (await c.shell_create()).id
        s = await c.shell_run(sid, gen, max_output=2000, spill=True)
        assert s.stdout_spill is not None and s.stdout_dropped == len(full) - 2000
        head = await c.read_file(s.stdout_spill.path, offset=0, length=s.stdout_dropped)
        assert head + s.stdout == full and s.stdout_spill.bytes == len(full)

        # The cap: a prefix of the stream, and the reason.
        big = await c.shell_run(sid, "seq 1 300000", max_output=100, spill=True)
        assert big.stdout_spill is not None
        assert (big.stdout_spill.bytes, big.stdout_spill.stopped) == (1_000_000, "cap")
        everything = "".join(f"{i}\n" for i in range(1, 300001)).encode()
        got = await c.read_file(big.stdout_spill.path, offset=999_000, length=1000)
        assert got == everything[999_000:1_000_000] and big.stdout == everything[-100:]
        with pytest.raises(GuestdError) as ei:
            await c._conn.request("exec", {"shell": "true", "spill": True, "stream": True}, 10)
        assert ei.value.code == "bad_request"
        await c.close()

    asyncio.run(go())


def test_a_detached_command_keeps_spilling_what_it_prints_after_the_detach(guestd: Guestd, tmp_path: object) -> None:
    """spill + on_timeout detach (exec and shell.run): the files go with the command to the
    process table, which writes what it prints after the detach; process.wait names them whole.
    Before, the spill ended at the detach and the rest was only in the ring."""
    import os

    gate = f"{tmp_path}/go"
    # 300,000 bytes before the detach, then (once the test has seen the detach) 400,000 more.
    script = (
        f"head -c 300000 /dev/zero | tr '\\0' a; i=0; while [ ! -e {gate} ] && [ $i -lt 3000 ]; "
        "do sleep 0.01; i=$((i+1)); done; head -c 400000 /dev/zero | tr '\\0' b"
    )
    full = b"a" * 300_000 + b"b" * 400_000

    async def go() -> None:
        async with await AsyncClient.connect(guestd.address) as c:
            sid = (await c.shell_create()).id
            for run in ("exec", "shell"):
                if os.path.exists(gate):
                    os.unlink(gate)
                r: ExecResult | ShellResult
                if run == "exec":
                    r = await c.exec(script, timeout_s=1.0, on_timeout="detach", spill=True, max_output=1000)
                else:
                    r = await c.shell_run(sid, script, timeout_s=1.0, on_timeout="detach", spill=True, max_output=1000)
                assert r.detached is not None and r.stdout_spill is not None, run
                assert r.stdout_spill.bytes <= 300_000  # as it stood at the detach
                open(gate, "w").close()
                w = await c.process_wait(r.detached, timeout_s=30)
                assert w.exit_code == 0, (run, w)
                spill = w.stdout_spill
                assert spill is not None and spill.path == r.stdout_spill.path, (run, w)
                assert (spill.bytes, spill.stopped) == (len(full), None), (run, spill)
                assert await c.read_file(spill.path) == full, run

    asyncio.run(go())


def test_output_shaping_keeps_counts_exact_on_raw_bytes(guestd: Guestd) -> None:
    """strip_ansi and collapse_cr: colours, a title and cursor escapes go, progress redraws
    collapse to what a terminal leaves, while *_bytes / *_dropped count the raw bytes; with
    a cut, the gap stays between the shaped head and tail; unshaped output is unchanged."""
    raw = b"\x1b]0;title\x07\x1b[1;32mgreen\x1b[0m plain\r\n10%\r20%\r100% done\nabcdef\rXY\n\x1b[2K\rlast"
    shaped = b"green plain\n100% done\nXYcdef\nlast"
    cmd = "printf '%s' " + "'" + raw.decode().replace("'", "'\\''") + "'"

    async def go() -> None:
        c = await AsyncClient.connect(guestd.address)
        r = await c.exec(cmd, strip_ansi=True, collapse_cr=True)
        assert r.stdout == shaped and r.stdout_bytes == len(raw) and r.stdout_dropped == 0
        assert (await c.exec(cmd)).stdout == raw
        only_ansi = await c.exec(cmd, strip_ansi=True)
        assert only_ansi.stdout == b"green plain\r\n10%\r20%\r100% done\nabcdef\rXY\n\rlast"
        sid = (await c.shell_create()).id
        s = await c.shell_run(sid, cmd, strip_ansi=True, collapse_cr=True)
        assert s.stdout == shaped and s.stdout_bytes == len(raw)
        # A cut output: counts on raw bytes, the gap between the shaped head and tail.
        big = "for i in $(seq 1 2000); do printf '\\033[31m%05d\\033[0m\\r%05d\\n' $i $i; done"
        b = await c.exec(big, max_output=1000, head_tail=True, strip_ansi=True, collapse_cr=True)
        line = len("\x1b[31m00001\x1b[0m\r00001\n")
        assert b.stdout_bytes == 2000 * line and b.stdout_dropped == 2000 * line - 1000
        assert b.stdout_gap_at is not None
        head, tail = b.stdout[: b.stdout_gap_at], b.stdout[b.stdout_gap_at :]
        assert head.startswith(b"00001\n00002\n") and tail.endswith(b"01999\n02000\n")
        assert b"\x1b" not in b.stdout and b"\r" not in b.stdout
        await c.shell_close(sid)
        await c.close()

    asyncio.run(go())


def test_guestctl_pty_keep_runs_and_spill(guestd: Guestd) -> None:
    """guestctl shell run --pty (piped stdin typed into the terminal, the session's state
    there), --keep printing the run id first and `runs ls|get|wait`, exec --spill naming
    the file that holds the full output."""
    import json

    s = guestd.guestctl("shell", "new").stdout.decode().strip()
    assert guestd.guestctl("shell", "run", s, "where=session-state").returncode == 0
    cmd = '[ -t 0 ] && echo tty; read -r -p "name? " x; echo "got $x in $where"'
    r = guestd.guestctl("shell", "run", s, cmd, "--pty", stdin=b"ada\n")
    assert r.returncode == 0 and b"tty\r\n" in r.stdout and b"got ada in session-state\r\n" in r.stdout, r

    r = guestd.guestctl("shell", "run", s, "echo kept-out; exit 3", "--keep")
    assert r.returncode == 3 and r.stdout == b"kept-out\n"
    rid = r.stderr.split(b"kept as run ")[1].split()[0].decode()
    r = guestd.guestctl("runs", "get", rid)
    assert (r.returncode, r.stdout) == (3, b"kept-out\n")
    listed = json.loads(guestd.guestctl("--json", "runs", "ls").stdout)["runs"]
    assert [x["state"] for x in listed if x["id"] == rid] == ["done"]
    r = guestd.guestctl("--json", "runs", "wait", rid, "--timeout", "5")
    assert json.loads(r.stdout)["result"]["exit_code"] == 3
    assert guestd.guestctl("runs", "get", "r000000000000").returncode != 0
    r = guestd.guestctl("code", "run", "print('kept-cell'); 6 * 7", "--keep")
    assert (r.returncode, r.stdout) == (0, b"kept-cell\n42\n") and b"kept as run " in r.stderr, r

    r = guestd.guestctl("--json", "exec", "--spill", "--max-output", "10", "--", "seq", "1", "1000")
    obj = json.loads(r.stdout)
    full = "".join(f"{i}\n" for i in range(1, 1001)).encode()
    assert obj["stdout_spill"]["bytes"] == len(full) and obj["stdout_dropped"] == len(full) - 10
    with open(obj["stdout_spill"]["path"], "rb") as f:
        assert f.read() == full
    r = guestd.guestctl("exec", "--spill", "--max-output", "10", "--", "seq", "1", "1000")
    assert b"full stdout in " in r.stderr
    assert guestd.guestctl("shell", "rm", s).returncode == 0


def test_run_cancel_interrupts_a_kept_command_and_a_kept_cell(guestd: Guestd, tmp_path: object) -> None:
    """run.cancel: a kept `sleep 60` in a session and a kept `time.sleep(60)` cell end at once as
    failed/cancelled, the session (its cwd intact) and the context take their next run; an
    ended run is returned as it is; an unknown id is not_found; guestctl runs cancel."""
    from guestd.client.runs import run_cancel, start_kept

    async def go() -> None:
        async with await AsyncClient.connect(guestd.address) as c:
            sid = (await c.shell_create(cwd=str(tmp_path))).id
            shell = await start_kept(c, "shell.run", {"id": sid, "command": "sleep 60; echo never"})
            ctx = (await c.code_create()).id
            cell = await start_kept(c, "code.run", {"context": ctx, "code": "import time; time.sleep(60)"})
            for rid in (shell, cell):
                run = await run_cancel(c, rid, timeout_s=20)
                assert run.state == "failed" and run.error is not None and run.error["code"] == "cancelled", run
            after = await c.shell_run(sid, "pwd", timeout_s=20)
            assert after.stdout == f"{tmp_path}\n".encode()
            assert (await c.code_run("6 * 7", context=ctx, timeout_s=20)).text == "42"
            done = await start_kept(c, "shell.run", {"id": sid, "command": "echo kept"})
            await c.run_wait(done, timeout_s=20)
            again = await run_cancel(c, done)
            assert again.state == "done" and again.result is not None and again.result["stdout"] == b"kept\n"
            with pytest.raises(GuestdError) as ei:
                await run_cancel(c, "r000000000000")
            assert ei.value.code == "not_found"
            await c.shell_close(sid)

    asyncio.run(go())
    import os
    import subprocess

    from guestd.testing import REPO

    with guestd.client() as c:
        sid = c.shell_create().id
        proc = subprocess.Popen(
            guestd.guestctl_argv("shell", "run", sid, "sleep 60", "--keep"),
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": REPO},
        )
        assert proc.stderr is not None
        line = proc.stderr.readline().decode()
        rid = line.split("kept as run ")[1].split()[0]
        out = guestd.guestctl("runs", "cancel", rid, timeout=60)
        assert out.returncode == 0 and b"cancelled" in out.stderr, out.stderr  # the cancel succeeded (was 1)
        assert proc.wait(60) == 1  # the waiting guestctl sees the run end too
        proc.stderr.close()


def test_shell_pty_size_and_resize(guestd: Guestd) -> None:
    """shell.run pty on a rows x cols terminal; shell.resize changes it and the program gets
    SIGWINCH (the terminal is no controlling terminal: guestd sends it). Before: always 24x80."""
    from guestd.client.expect import Expect

    # SIGWINCH blocked before "ready", then waited for: none can come between a check and a wait.
    prog = (
        "import os, signal; signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGWINCH}); "
        "print('ready', tuple(os.get_terminal_size(0)), flush=True); signal.sigwait({signal.SIGWINCH}); "
        "print('winch', tuple(os.get_terminal_size(0)), flush=True)"
    )

    async def go() -> None:
        async with await AsyncClient.connect(guestd.address) as c:
            sid = (await c.shell_create()).id
            with pytest.raises(GuestdError) as ei:
                await c.shell_resize(sid, 30, 100)
            assert ei.value.code == "bad_request"  # no pty command runs
            async with Expect.start(c, sid, f'python3 -c "{prog}"', timeout_s=30, rows=40, cols=132) as e:
                await e.expect(rb"ready \(132, 40\)\r\n", timeout=10)
                await e.resize(50, 100)
                await e.expect(rb"winch \(100, 50\)\r\n", timeout=10)
                assert (await e.wait(timeout=10)).exit_code == 0
            with pytest.raises(GuestdError) as ei:
                await c.shell_resize("no-such-session", 30, 100)
            assert ei.value.code == "not_found"
            await c.shell_close(sid)

    asyncio.run(go())


def test_the_blocking_client_drives_expect_and_kept_runs(guestd: Guestd, tmp_path: object) -> None:
    """SyncExpect and runs_sync.start_kept: the async helpers' calls from the blocking Client,
    with the same results: a prompt answered in the session's state, a pattern not seen is a
    timeout, Ctrl-C ends the foreground program, the end is ExpectEOF; a kept run started from
    one blocking client is fetched from another."""
    from guestd.client.expect_sync import ExpectEOF, SyncExpect
    from guestd.client.runs_sync import result_of, start_kept

    with guestd.client() as c:
        sid = c.shell_create(cwd=str(tmp_path)).id
        c.shell_run(sid, "secret=unexported")
        with SyncExpect.start(c, sid, 'read -r -p "name? " who; echo "hi $who $secret"', timeout_s=20) as e:
            e.expect(rb"name\? ", timeout=10)
            e.sendline("ada")
            e.expect(rb"hi ada unexported\r\n", timeout=10)
            r = e.wait(timeout=10)
            with pytest.raises(ExpectEOF):
                e.expect(b"never", timeout=5)
        assert r.exit_code == 0 and not r.interrupted
        with SyncExpect.start(c, sid, "echo go; sleep 60; echo not-reached", timeout_s=30) as e:
            e.expect(b"go\r\n", timeout=10)
            with pytest.raises(GuestdError) as ei:
                e.expect(b"not-reached", timeout=0.5)
            assert ei.value.code == "timeout"
            e.interrupt()
            r = e.wait(timeout=10)
        assert r.exit_code == 130 and b"not-reached" not in r.stdout
        with SyncExpect.start(c, sid, "stty size; read -r x; stty size", timeout_s=20, rows=33, cols=99) as e:
            e.expect(b"33 99\r\n", timeout=10)
            e.resize(40, 120)
            e.sendline("")
            e.expect(b"40 120\r\n", timeout=10)
            assert e.wait(timeout=10).exit_code == 0
        rid = start_kept(c, "shell.run", {"id": sid, "command": "sleep 0.5; echo kept; pwd"})
    with guestd.client() as c2:  # the first connection is gone; the kept run is not
        done = result_of(c2.run_wait(rid, timeout_s=20))
        assert isinstance(done, ShellResult) and done.stdout == f"kept\n{tmp_path}\n".encode()


def test_expect_searches_new_output_with_an_overlap_and_finds_split_matches(guestd: Guestd) -> None:
    """expect searches each new output with the 64 KiB before it (not the whole buffer again):
    a match split across outputs after 200 KB of filler is found, with all of the filler as
    ``before``; past the 1 MiB buffer the oldest bytes are dropped (counted) and a match in
    the newest output is still found."""
    from guestd.client.expect import Expect

    async def go() -> None:
        async with await AsyncClient.connect(guestd.address) as c:
            sid = (await c.shell_create()).id
            cmd = "head -c 200000 /dev/zero | tr '\\0' x; printf MAR; sleep 0.3; printf KER; read -r x"
            async with Expect.start(c, sid, cmd, timeout_s=30) as e:
                await e.expect(b"MAR", timeout=10)  # consumed: the next pattern starts after it
                await e.expect(b"KER", timeout=10)
                await e.sendline("")
                await e.wait(timeout=10)
            async with Expect.start(c, sid, cmd, timeout_s=30) as e:
                await e.expect(b"x{1000}MARKER", timeout=10)
                assert len(e.before) == 200_000 - 1000
                await e.sendline("")
                await e.wait(timeout=10)
            big = "head -c 1600000 /dev/zero | tr '\\0' y; sleep 0.3; printf END; read -r x"
            async with Expect.start(c, sid, big, timeout_s=30) as e:
                await e.expect(b"yEND", timeout=20)
                assert e.dropped > 0 and len(e.before) + 1 + e.dropped <= 1_600_000
                await e.sendline("")
                await e.wait(timeout=10)
            await c.shell_close(sid)

    asyncio.run(go())
