"""Snapshot prepare/restore on the host (privileged steps simulated: this machine's clock and
CRNG are never touched). The real clone test, with two restored VMs, is in tests/qemu."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Iterator

import pytest

from guestd.client import AsyncClient, Client, GuestdError
from guestd.testing import Guestd, scratch_guestd


@pytest.fixture(scope="module")
def sg() -> Iterator[Guestd]:
    with scratch_guestd("guestd-snap-", "--simulate-privileged", "--code-pool", "0") as g:
        yield g


def test_prepare_reports_running_work_and_is_idempotent(sg: Guestd) -> None:
    with sg.client() as c:
        p = c.process_start(["sleep", "30"])
        first = c.snapshot_prepare()
        second = c.snapshot_prepare()
        for rep in (first, second):
            assert rep.synced and rep.writes_settled and not rep.quiesced
            assert p.id in rep.running["processes"]
        c.process_signal(p.id, "KILL")


def test_restore_reseeds_sets_identity_and_records_privileged_steps(sg: Guestd) -> None:
    with sg.client() as c:
        ctx = c.code_create().id
        sid = c.shell_create().id
        before_host = socket.gethostname()
        gen = c.info().raw["snapshot"]["generation"] + 1
        stale_clock = time.time_ns() - 3_600 * 10**9  # the host says: an hour later than the guest thinks
        rep = c.restore(
            generation=gen,
            entropy=b"A" * 32,
            time_ns=time.time_ns() + 3_600 * 10**9,
            sandbox_id="sbx-1",
            hostname="clone-1",
            env={"SANDBOX": "one"},
            nonce="n1",
        )
        assert rep.generation == gen and not rep.replayed
        assert rep.crng == "simulated" and rep.clock == "simulated" and rep.clock_skew_s < -3000
        assert any(a.startswith("RNDADDENTROPY") and "RNDRESEEDCRNG" in a for a in rep.actions)
        assert any(a.startswith("clock_settime") for a in rep.actions)
        assert any("sethostname('clone-1')" in a for a in rep.actions)
        assert any(a.startswith("/etc/machine-id") for a in rep.actions)
        assert rep.contexts_reseeded == [ctx] and rep.shells_reseeded == [sid]
        assert sorted(rep.identity) == ["env", "hostname", "sandbox_id"]
        assert socket.gethostname() == before_host  # simulated: this machine is untouched
        assert c.exec("echo $SANDBOX").stdout == b"one\n"  # env for future execs
        info = c.info().raw["snapshot"]
        assert info["generation"] == gen and info["sandbox_id"] == "sbx-1" and info["instance_id"] == rep.instance_id
        _ = stale_clock


def _prng_outputs(c: Client, ctx: str, sid: str) -> tuple[str | None, bytes]:
    r = c.code_run("import random; random.random()", context=ctx)
    return r.text, c.shell_run(sid, "echo $RANDOM").stdout


def test_same_entropy_same_prngs_different_entropy_different(sg: Guestd) -> None:
    # Re-seeding is what makes clones diverge: prove it is deterministic in the entropy.
    with sg.client() as c:
        ctx = c.code_create().id
        sid = c.shell_create().id
        outs = []
        for ent in (b"x" * 32, b"x" * 32, b"y" * 32):
            c.restore(entropy=ent)
            outs.append(_prng_outputs(c, ctx, sid))
        assert outs[0] == outs[1]
        assert outs[0][0] != outs[2][0] and outs[0][1] != outs[2][1]


def test_replays_and_stale_generations(sg: Guestd) -> None:
    with sg.client() as c:
        gen = c.info().raw["snapshot"]["generation"] + 1
        first = c.restore(generation=gen, nonce="same-nonce")
        again = c.restore(generation=gen, nonce="same-nonce")
        assert again.replayed and again.instance_id == first.instance_id
        with pytest.raises(GuestdError) as ei:
            c.restore(generation=gen)  # a new nonce, but not a newer generation
        assert ei.value.code == "stale"
        with pytest.raises(GuestdError) as ei:
            c.restore(entropy=b"short")
        assert ei.value.code == "bad_request"


def test_restore_drops_old_connections_and_requests_wait_for_it(sg: Guestd) -> None:
    async def go() -> None:
        old = await AsyncClient.connect(sg.address)
        busy = await AsyncClient.connect(sg.address)
        ctx = (await busy.code_create()).id
        running = asyncio.ensure_future(busy.code_run("import time; time.sleep(1.0); 'done'", context=ctx))
        await asyncio.sleep(0.3)
        me = await AsyncClient.connect(sg.address)
        rep = await me.restore(entropy=os.urandom(32))
        assert rep.connections_dropped >= 2
        assert ctx in rep.contexts_reseeded  # busy in a sleep: re-seeded at once (the side channel)
        with pytest.raises(GuestdError):
            await old.ping()  # from before the snapshot: gone
        with pytest.raises(GuestdError):
            await running
        assert await me.ping() > 0
        c2 = await AsyncClient.connect(sg.address)
        r = await c2.code_run("import random; random.random()", context=ctx, timeout_s=30)
        assert r.status == "ok"
        await c2.close()
        await me.close()

    asyncio.run(go())


def test_quiesce_holds_new_work_until_restore(sg: Guestd) -> None:
    async def go() -> None:
        c = await AsyncClient.connect(sg.address)
        rep = await c.snapshot_prepare(quiesce=True)
        assert rep.quiesced
        held = asyncio.ensure_future(c.exec(["echo", "after"]))
        await asyncio.sleep(0.3)
        assert not held.done()  # waits
        assert await c.ping() > 0  # health checks still answer
        await c.snapshot_resume()
        assert (await asyncio.wait_for(held, 10)).stdout == b"after\n"
        await c.snapshot_prepare(quiesce=True)
        held = asyncio.ensure_future(c.exec(["echo", "again"]))
        await asyncio.sleep(0.2)
        await c.restore()  # a restore also releases the hold (and keeps the connection it came on)
        assert (await asyncio.wait_for(held, 10)).stdout == b"again\n"
        await c.close()

    asyncio.run(go())


def test_handshake_clock_fallback_flags_a_suspected_restore(sg: Guestd) -> None:
    from guestd.testing.rawwire import RawPeer
    from guestd.wire.frames import Kind

    p = RawPeer(sg.raw_socket())
    p.send(Kind.HELLO, 0, {"versions": [1], "time_ns": time.time_ns() + 120 * 10**9})
    assert p.recv()[0] == Kind.HELLO
    with sg.client() as c:
        assert c.info().raw["snapshot"]["suspected_restore"]
        c.restore()
        assert not c.info().raw["snapshot"]["suspected_restore"]


def test_guestctl_snapshot_and_restore(sg: Guestd) -> None:
    import json
    import subprocess
    import sys

    from guestd.testing import REPO

    def gc(*args: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [sys.executable, "-m", "guestd.cli", "--connect", sg.address, "--json", *args],
            capture_output=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": REPO},
        )

    assert json.loads(gc("snapshot", "prepare").stdout)["synced"]
    rep = json.loads(gc("restore", "--id", "cli-box", "--hostname", "h1", "--entropy-hex", "ab" * 32).stdout)
    assert rep["identity"] == ["sandbox_id", "hostname"] and rep["crng"] == "simulated"


@pytest.mark.parametrize(
    "identity, field",
    [
        ({"sandbox_id": "sbx-half", "env": {"A=B": "x"}}, "identity.env.A=B"),  # before: half applied, internal
        ({"sandbox_id": "sbx-half", "env": {"NUL\0": "x"}}, "identity.env.NUL\0"),
        ({"sandbox_id": "sbx-half", "env": {"OK": "x\0y"}}, "identity.env.OK"),
        ({"sandbox_id": "sbx-half", "hostname": "bad host/name"}, "identity.hostname"),
        ({"sandbox_id": 7}, "identity.sandbox_id"),
        ({"sandbox_id": "sbx-half", "colour": "red"}, "identity.colour"),
    ],
)
def test_a_restore_with_bad_input_applies_nothing(sg: Guestd, identity: dict[str, object], field: str) -> None:
    with sg.client() as c:
        before = c.info().raw["snapshot"]
        args = {
            "generation": before["generation"] + 1,
            "nonce": os.urandom(8).hex(),
            "time_ns": time.time_ns(),
            "entropy": os.urandom(32),
            "identity": identity,
        }
        with pytest.raises(GuestdError) as ei:
            c.call("snapshot.restore", args)
        assert ei.value.code == "bad_request" and ei.value.details["field"] == field, ei.value
        assert c.info().raw["snapshot"] == before  # instance id, sandbox id, generation: unchanged
        assert c.ping() > 0  # this connection was not dropped
        with pytest.raises(GuestdError) as ei:
            c.call("snapshot.restore", {**args, "identity": None, "time_ns": -1})
        assert ei.value.code == "bad_request" and ei.value.details["field"] == "time_ns"
        assert c.info().raw["snapshot"] == before


def test_a_retry_during_the_restore_gets_the_first_report(sg: Guestd) -> None:
    async def go() -> None:
        c = await AsyncClient.connect(sg.address)
        sid = (await c.shell_create()).id  # re-seeding it keeps the first restore running a while
        gen = (await c.info()).raw["snapshot"]["generation"] + 1
        first, retry = await asyncio.gather(
            c.restore(generation=gen, nonce="retried", entropy=b"R" * 32),
            c.restore(generation=gen, nonce="retried", entropy=b"R" * 32),
        )  # before: the retry was 'stale'
        assert (first.replayed, retry.replayed) == (False, True)
        assert retry.instance_id == first.instance_id and sid in retry.shells_reseeded
        await c.shell_close(sid)
        await c.close()

    asyncio.run(go())


def test_a_kept_cell_running_across_a_restore_finishes_and_is_fetchable_after(sg: Guestd) -> None:
    """Issue 16: a ``keep`` code.run in flight when the VM is snapshotted; the restore drops every
    connection (here: the client closes its own) and re-seeds the contexts; the cell finishes
    and its result is fetched by run id on a new connection."""
    from guestd.client.results import CodeResult
    from guestd.client.runs import result_of, run_list, run_wait, start_kept

    async def go() -> None:
        c = await AsyncClient.connect(sg.address)
        ctx = (await c.code_create()).id
        run = await start_kept(c, "code.run", {"context": ctx, "code": "import time; time.sleep(2); 6 * 7"})
        prep = await c.snapshot_prepare()
        assert prep.synced
        await c.close()  # the connection goes with the snapshot

        c = await AsyncClient.connect(sg.address)
        gen = (await c.info()).raw["snapshot"]["generation"] + 1
        rep = await c.restore(generation=gen, entropy=b"K" * 32, nonce=f"kept-{gen}")
        assert rep.generation == gen
        assert ctx in rep.contexts_reseeded  # busy with the cell (a sleep): re-seeded at once all the same
        assert {r.id: r.state for r in await run_list(c)}[run] == "running"
        code = result_of(await run_wait(c, run, timeout_s=60))
        assert isinstance(code, CodeResult) and code.status == "ok" and code.text == "42"
        await c.close()

    asyncio.run(go())
