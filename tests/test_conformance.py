"""The conformance kit (protocol/conformance/) both ways.

Server mode: every transcript against a real guestd (the runner plays the client). Client mode:
run.py plays the server's side of every transcript a client can produce, and guestd's own
AsyncClient, driven by the call in tests/conformance_calls/, must produce the transcript's
client frames and come out with its final frame. Coverage: every op of the schema in some
transcript, every transcript valid against the schema and with a driver (or a server test),
the README's table current. And the kit can fail: a wrong expectation, data beyond the
credit, oversize frames, a client that sends a wrong frame or grants no credit."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from guestd.client import AsyncClient, GuestdError
from guestd.testing import REPO, Guestd
from guestd.testing.rawwire import RawPeer
from guestd.wire.frames import Kind, encode_frame
from tests.conformance_calls import CallContext, ClientCall, load_calls

KIT = Path(REPO) / "protocol" / "conformance"
TRANSCRIPTS = sorted((KIT / "transcripts").glob("*.json"))

StartGuestd = Callable[..., Guestd]


def load_runner() -> ModuleType:
    """run.py is a standalone script (stdlib + msgpack), not part of the guestd package."""
    spec = importlib.util.spec_from_file_location("conformance_run", KIT / "run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


run = load_runner()
SCHEMA: dict[str, Any] = run.load_schema()
CALLS: dict[str, ClientCall] = load_calls()


def unix(g: Guestd) -> Callable[[], socket.socket]:
    connect: Callable[[], socket.socket] = run.connector(g.address)
    return connect


def is_server_test(doc: dict[str, Any]) -> bool:
    return str(doc.get("client_call", "")).startswith(run.SERVER_TEST)


# ------------------------------------------------------------------ server mode: a real guestd


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    raise TypeError(f"server_config value {v!r}: not a TOML scalar or list")


def guestd_config(doc: dict[str, Any], work: Path) -> str:
    """guestd.toml for a transcript: ``server_config`` (guestd's config file as a map: top-level
    keys, and tables as maps; ``${TMP}`` in a string is the work directory) with
    ``server_limits`` as its [limits]; the key ``token`` is the access token itself, written to
    a file that ``token_file`` names."""
    config: dict[str, Any] = json.loads(json.dumps(doc.get("server_config", {})).replace("${TMP}", str(work)))
    if doc.get("server_limits"):
        config["limits"] = {**config.get("limits", {}), **doc["server_limits"]}
    if "token" in config:
        token_file = work.parent / "token"
        token_file.write_text(config.pop("token"))
        config["token_file"] = str(token_file)
    top = [f"{k} = {toml_value(v)}\n" for k, v in config.items() if not isinstance(v, dict)]
    tables = [
        f"[{k}]\n" + "".join(f"{kk} = {toml_value(vv)}\n" for kk, vv in v.items())
        for k, v in config.items()
        if isinstance(v, dict)
    ]
    return "".join(top) + "".join(tables)


def server_for(doc: dict[str, Any], guestd: Guestd, fresh_guestd: StartGuestd, work: Path) -> Guestd:
    """The shared daemon, or a private one started with the transcript's limits and config."""
    if not doc.get("server_limits") and not doc.get("server_config"):
        return guestd
    cfg = work.parent / "guestd.toml"
    cfg.write_text(guestd_config(doc, work))
    return fresh_guestd("--config", str(cfg))


def param(path: Path) -> Any:
    with open(path) as f:
        xfail = json.load(f).get("xfail")
    marks = [pytest.mark.xfail(reason=xfail, strict=True)] if xfail else []
    return pytest.param(path, id=path.stem, marks=marks)


@pytest.mark.parametrize("path", [param(p) for p in TRANSCRIPTS])
def test_transcript(path: Path, guestd: Guestd, fresh_guestd: StartGuestd, tmp_path: Path) -> None:
    doc = run.load(path)
    work = tmp_path / "work"
    work.mkdir()
    g = server_for(doc, guestd, fresh_guestd, work)
    result = run.run_transcript(path, unix(g), str(work), configured=True)
    # A transcript marked xfail reports "xfail" when it fails (the mark expects that) and
    # "xpass" once guestd is fixed, which the strict mark turns into a failure.
    assert result.status in ("pass", "xpass"), result.message


def test_the_config_a_transcript_names_is_guestds_config_file(tmp_path: Path) -> None:
    work = tmp_path / "work"
    doc = {
        "server_limits": {"max_inflight": 2},
        "server_config": {"token": "t0k", "workspace": "${TMP}", "ports": {"reverse": True}},
    }
    text = guestd_config(doc, work)
    assert f'workspace = "{work}"' in text and "[ports]\nreverse = true\n" in text
    assert "[limits]\nmax_inflight = 2\n" in text and (tmp_path / "token").read_text() == "t0k"


def test_a_transcript_needing_a_config_is_skipped_unless_the_server_has_it(guestd: Guestd) -> None:
    doc = run.load(KIT / "transcripts" / "ping.json")
    doc["server_config"] = {"token": "x"}
    result = run.run_transcript(doc, unix(guestd))
    assert result.status == "skip" and "configured with" in result.message


# ------------------------------------------------------------------ client mode: the fake server


def client_hello(doc: dict[str, Any]) -> dict[str, Any]:
    for step in doc["steps"]:
        for frame in step.get("send", []):
            if frame["kind"] == "hello":
                return dict(frame.get("body", {}))
    return {}


def final_frame(doc: dict[str, Any]) -> dict[str, Any]:
    """The last frame the transcript expects from the server: what the client's call ends with."""
    frames: list[dict[str, Any]] = [f for step in doc["steps"] for f in step.get("expect", [])]
    return frames[-1]


class FakeServer:
    """run.py's fake server for one transcript, in a thread, on a Unix socket in ``tmp``."""

    def __init__(self, doc: dict[str, Any], tmp: Path, work: Path, timeout: float = 10.0) -> None:
        self.address = f"unix:{tmp / 'fake.sock'}"
        listener = run.listen_unix(self.address)
        self.result: Any = None
        self.thread = threading.Thread(
            target=lambda: setattr(self, "result", run.serve_transcript(doc, listener, str(work), timeout, SCHEMA)),
            daemon=True,
        )
        self.thread.start()

    def finish(self) -> Any:
        self.thread.join(30)
        assert not self.thread.is_alive(), "the fake server did not finish"
        return self.result


async def drive(doc: dict[str, Any], address: str, call: ClientCall, work: Path) -> object:
    hello = client_hello(doc)
    options = {k: hello[k] for k in ("max_frame", "stream_window", "token") if k in hello}
    async with await AsyncClient.connect(address, connect_timeout=10.0, **options) as client:
        return await asyncio.wait_for(call(client, CallContext(tmp=str(work))), 30)


def replay_client(doc: dict[str, Any], call: ClientCall, tmp: Path) -> tuple[Any, object]:
    """(the fake server's result, the call's outcome: what it returned or raised)."""
    work = tmp / "work"
    work.mkdir(exist_ok=True)
    server = FakeServer(doc, tmp, work)
    outcome: object
    try:
        outcome = asyncio.run(drive(doc, server.address, call, work))
    except Exception as exc:  # the outcome is checked against the transcript
        outcome = exc
    return server.finish(), outcome


# Where guestd's own client departs from a transcript (the fix is in guestd/, not here).
CLIENT_XFAIL: dict[str, str] = {}  # transcript stem -> why guestd's client fails it today


def client_param(path: Path) -> Any:
    why = CLIENT_XFAIL.get(path.stem)
    return pytest.param(path, id=path.stem, marks=[pytest.mark.xfail(reason=why, strict=True)] if why else [])


DRIVEN = [client_param(p) for p in TRANSCRIPTS if p.stem in CALLS]


@pytest.mark.parametrize("path", DRIVEN)
def test_client_mode(path: Path, tmp_path: Path) -> None:
    doc = run.load(path)
    result, outcome = replay_client(doc, CALLS[path.stem], tmp_path)
    assert result.status == "pass", f"the fake server: {result.message}\nthe call: {outcome!r}"
    final = final_frame(doc)
    if final["kind"] == "error":
        assert isinstance(outcome, GuestdError), f"expected error {final['body']['code']}, the call gave {outcome!r}"
        assert outcome.code == final["body"]["code"]
    else:
        assert not isinstance(outcome, BaseException), f"the call raised {outcome!r}; the transcript ends in {final}"


def wrong_call(name: str) -> ClientCall:
    async def call(client: AsyncClient, ctx: CallContext) -> object:
        return await getattr(client, name)()

    return call


def test_the_fake_server_fails_a_client_that_sends_another_request(tmp_path: Path) -> None:
    result, outcome = replay_client(run.load(KIT / "transcripts" / "ping.json"), wrong_call("info"), tmp_path)
    assert result.status == "fail" and "matches none the transcript waits for" in result.message
    assert '"op": "info"' in result.message and "body.op" in result.message
    assert isinstance(outcome, Exception)  # the fake server hung up on it


def test_the_fake_server_fails_a_client_that_grants_no_credit(tmp_path: Path) -> None:
    doc = run.load(KIT / "transcripts" / "exec_stream_credit.json")
    server = FakeServer(doc, tmp_path, tmp_path, timeout=1.0)
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(server.address.removeprefix("unix:"))
        peer = RawPeer(s)
        peer.hello(max_frame=65536, stream_window=65536)
        peer.request(1, "exec", {"argv": ["head", "-c", "300000", "/dev/zero"], "stream": True})
        got = 0
        while got < 65536:  # read what the credit allows, never granting more
            _, _, body = peer.recv()
            got += len(body.get("data", b""))
        result = server.finish()
    assert result.status == "fail", result.message
    assert "234464 data bytes not sent: the client's credit is 0" in result.message
    assert "no window frame" in result.message


def test_the_fake_server_fails_a_client_that_sends_beyond_the_credit(tmp_path: Path) -> None:
    doc = run.load(KIT / "transcripts" / "upload_download.json")
    server = FakeServer(doc, tmp_path, tmp_path, timeout=2.0)
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(server.address.removeprefix("unix:"))
        peer = RawPeer(s)
        peer.hello(max_frame=65536, stream_window=65536)
        peer.request(1, "file.upload", {"path": f"{tmp_path}/upload_download.bin"})
        peer.send(Kind.INPUT, 1, {"data": b"h" * 65537})
        result = server.finish()
    assert result.status == "fail" and "1 input bytes for id 1 beyond the credit" in result.message


def test_the_fake_server_fails_a_frame_above_its_max_frame(tmp_path: Path) -> None:
    doc = run.load(KIT / "transcripts" / "ping.json")
    server = FakeServer(doc, tmp_path, tmp_path, timeout=2.0)
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(server.address.removeprefix("unix:"))
        peer = RawPeer(s)
        peer.hello()
        try:
            peer.request(1, "ping", {"pad": b"\0" * 4194304})
        except OSError:
            pass  # the fake server hung up as soon as it read the header
        result = server.finish()
    assert result.status == "fail" and "limits.max_frame is 4194304" in result.message


def test_the_fake_server_completes_the_frames_it_builds() -> None:
    # A transcript lists only what it checks; a typed client decodes whole replies, so every
    # required field the transcript leaves out gets its type-default (records too).
    serve = run.Serve({"steps": []}, socket.socket(socket.AF_UNIX), "/t", 1.0, SCHEMA)
    stat = serve.server_body(Kind.RESPONSE, {"type": "file", "uid": {"$any": "int"}}, "file.stat")
    assert stat == {"type": "file", "uid": 1, "size": 0, "mode": 0, "gid": 0, "mtime_ns": 0}
    listing = serve.server_body(Kind.RESPONSE, {"entries": [{"name": "a"}]}, "file.list")
    assert listing["entries"] == [{"name": "a", "type": "file", "size": 0, "mode": 0, "mtime_ns": 0}]
    error = serve.server_body(Kind.ERROR, {"code": "not_found"}, None)
    assert error["code"] == "not_found" and isinstance(error["message"], str)
    serve.sock.close()


# ------------------------------------------------------------------ coverage


def test_every_op_of_the_schema_is_requested_by_some_transcript() -> None:
    requested = {
        f["body"].get("op")
        for p in TRANSCRIPTS
        for step in run.load(p)["steps"]
        for f in step.get("send", [])
        if f["kind"] == "request" and isinstance(f.get("body"), dict) and not f.get("invalid")
    }
    missing = sorted(set(SCHEMA["ops"]) - requested)
    assert not missing, f"ops of the schema no transcript requests: {missing}"


@pytest.mark.parametrize("path", TRANSCRIPTS, ids=[p.stem for p in TRANSCRIPTS])
def test_transcript_frames_validate_against_the_schema(path: Path) -> None:
    errors = run.check_transcript(run.load(path), SCHEMA)
    assert not errors, "\n".join(errors)


def test_every_transcript_has_a_client_driver_or_is_a_server_test() -> None:
    docs = [run.load(p) for p in TRANSCRIPTS]
    missing = sorted(d["name"] for d in docs if d["name"] not in CALLS and not is_server_test(d))
    assert not missing, f"transcripts with neither a driver in tests/conformance_calls/ nor '(a server test': {missing}"
    stray = sorted(set(CALLS) - {d["name"] for d in docs})
    assert not stray, f"drivers for transcripts that do not exist: {stray}"


def test_every_transcript_is_described_and_the_readme_table_is_current() -> None:
    docs = [run.load(p) for p in TRANSCRIPTS]
    assert len(docs) >= 15
    for doc in docs:
        assert doc.get("about") and doc.get("spec") and doc.get("client_call") and doc.get("steps"), doc["name"]
        assert doc.get("summary") and "\n" not in doc["summary"], f"{doc['name']}: a one-line summary"
    readme = (KIT / "README.md").read_text()
    assert run.with_table(readme, run.readme_table(docs)) == readme, (
        "README.md's transcript table is stale: run python protocol/conformance/run.py --readme"
    )


# ------------------------------------------------------------------ the kit can fail (server mode)


def test_a_wrong_expectation_fails_with_the_step_and_both_frames(guestd: Guestd) -> None:
    doc = run.load(KIT / "transcripts" / "exec_capture.json")
    expected = next(s for s in doc["steps"] if "expect" in s and s["expect"][0]["id"] == 1)
    expected["expect"][0]["body"]["exit_code"] = 4
    result = run.run_transcript(doc, unix(guestd))
    assert result.status == "fail"
    assert "body.exit_code: expected 4, got 3" in result.message
    assert '"exit_code": 4' in result.message and '"exit_code": 3' in result.message  # expected and received


def test_a_wrong_stream_total_fails(guestd: Guestd) -> None:
    doc = run.load(KIT / "transcripts" / "download_small_frames.json")
    collect = next(s["collect"] for s in doc["steps"] if "collect" in s)
    collect["total"]["$times"] += 1
    result = run.run_transcript(doc, unix(guestd))
    assert result.status == "fail" and "collected 200000 bytes" in result.message


def test_a_missing_reply_fails_within_the_step_timeout(guestd: Guestd) -> None:
    doc = run.load(KIT / "transcripts" / "ping.json")
    doc["steps"].append({"expect": [{"kind": "response", "id": 9, "body": {}}], "timeout_s": 0.3})
    result = run.run_transcript(doc, unix(guestd))
    assert result.status == "fail" and "no answer within the timeout" in result.message


def scripted_server(events: list[bytes]) -> Callable[[], socket.socket]:
    """A scripted server on a socketpair: hello with a 64 KiB max_frame and window, then ``events``."""
    ours, theirs = socket.socketpair()

    def serve() -> None:
        peer = RawPeer(ours)
        try:
            peer.recv()
            peer.send(Kind.HELLO, 0, {"version": 1, "max_frame": 65536, "stream_window": 65536, "limits": {}})
            peer.recv()
            for data in events:
                peer.send(Kind.EVENT, 1, {"ev": "stdout", "data": data})
            peer.send(Kind.RESPONSE, 1, {"exit_code": 0})
        except (OSError, EOFError):
            pass  # the runner gave up on us: that is what the test wants
        finally:
            ours.close()

    threading.Thread(target=serve, daemon=True).start()
    return lambda: theirs


STREAM = {
    "about": "",
    "steps": [
        {"send": [{"kind": "hello", "id": 0, "body": {"versions": [1], "max_frame": 65536, "stream_window": 65536}}]},
        {"expect": [{"kind": "hello", "id": 0, "body": {"version": 1}}]},
        {"send": [{"kind": "request", "id": 1, "body": {"op": "exec", "args": {"argv": ["x"], "stream": True}}}]},
        {"collect": {"id": 1, "ev": "stdout"}},
        {"expect": [{"kind": "response", "id": 1, "body": {"exit_code": 0}}]},
    ],
}


def test_the_scripted_server_passes_when_it_keeps_the_rules() -> None:
    result = run.run_transcript(STREAM, scripted_server([b"a" * 40000, b"b" * 25536]), timeout=5)
    assert result.status == "pass", result.message


def test_data_beyond_the_credit_fails() -> None:
    result = run.run_transcript(STREAM, scripted_server([b"a" * 40000, b"b" * 25537]), timeout=5)
    assert result.status == "fail" and "25537 data bytes for id 1 beyond the credit 25536" in result.message


def test_a_frame_above_the_negotiated_max_frame_fails() -> None:
    result = run.run_transcript(STREAM, scripted_server([b"a" * 65530]), timeout=5)
    assert result.status == "fail" and "we accept 65536" in result.message


def test_the_schema_check_finds_wrong_types_and_unknown_fields() -> None:
    doc = run.load(KIT / "transcripts" / "files_write_read_stat.json")
    request = doc["steps"][2]["send"][0]
    request["body"]["args"]["data"] = "hello"  # bin written as str
    request["body"]["args"]["colour"] = "red"  # no such field
    doc["steps"][3]["expect"][0]["body"]["size"] = {"$any": "str"}  # size is uint
    doc["steps"][5]["expect"][3]["body"]["code"] = "no_such_code"
    errors = "\n".join(run.check_transcript(doc, SCHEMA))
    assert "file.write args.data" in errors and "is not bin" in errors
    assert "args.colour: no such field" in errors
    assert 'file.write result.size: {"$any": "str"} cannot be uint' in errors
    assert "code 'no_such_code' is not a known error code" in errors
    request["invalid"] = True  # deliberately malformed: exempt
    assert "args.data" not in "\n".join(run.check_transcript(doc, SCHEMA))


# ------------------------------------------------------------------ the command line


def test_the_command_line_exits_0_when_all_pass_and_1_otherwise(
    guestd: Guestd, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ping = KIT / "transcripts" / "ping.json"
    assert run.main([guestd.address, str(ping), "--tmp", str(tmp_path)]) == 0
    doc = run.load(ping)
    doc["steps"][-1]["expect"][0]["body"]["t_ns"] = {"$any": "str"}
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps(doc))
    assert run.main([guestd.address, str(ping), str(wrong)]) == 1
    out = capsys.readouterr().out
    assert "PASS   ping" in out and "FAIL   wrong" in out and "body.t_ns" in out
    assert run.main(["--check", str(ping)]) == 0


def test_the_serve_command_line_takes_a_client(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sock = tmp_path / "fake.sock"
    ping = KIT / "transcripts" / "ping.json"
    codes: list[int] = []
    serving = threading.Thread(target=lambda: codes.append(run.main(["--serve", f"unix:{sock}", str(ping)])))
    serving.start()
    for _ in range(1000):  # until it listens
        if sock.exists():
            break
        serving.join(0.01)

    async def ping_once() -> None:
        async with await AsyncClient.connect(f"unix:{sock}") as client:
            await client.ping()

    asyncio.run(ping_once())
    serving.join(30)
    assert codes == [0] and "PASS   ping" in capsys.readouterr().out


def test_an_already_connected_fd_serves_one_transcript(guestd: Guestd) -> None:
    s = guestd.raw_socket()
    connect = run.connector(f"fd:{os.dup(s.fileno())}")
    s.close()
    assert run.run_transcript(KIT / "transcripts" / "ping.json", connect).status == "pass"
    with pytest.raises(SystemExit):
        connect()


def test_frames_the_runner_sends_are_the_ones_guestd_encodes() -> None:
    # The runner has its own encoder (no guestd import); it must agree with guestd's byte for byte.
    replay = run.Replay({"steps": []}, socket.socket(socket.AF_UNIX), "/t", 1.0)
    args = {"path": "${TMP}/a", "data": {"$bin": "00ff"}}
    spec = {"kind": "request", "id": 7, "body": {"op": "file.write", "args": args}}
    body = {"op": "file.write", "args": {"path": "/t/a", "data": b"\x00\xff"}}
    assert replay.encode(spec) == encode_frame(Kind.REQUEST, 7, body)
    replay.sock.close()
