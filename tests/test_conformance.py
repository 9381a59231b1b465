"""The conformance kit (protocol/conformance/) against a real guestd: every transcript passes,
and the runner fails on a wrong expectation, on data beyond the credit and on oversize frames."""

from __future__ import annotations

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

from guestd.testing import REPO, Guestd
from guestd.testing.rawwire import RawPeer
from guestd.wire.frames import Kind, encode_frame

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


def unix(g: Guestd) -> Callable[[], socket.socket]:
    connect: Callable[[], socket.socket] = run.connector(g.address)
    return connect


def server_for(doc: dict[str, Any], guestd: Guestd, fresh_guestd: StartGuestd, tmp: Path) -> Guestd:
    """The shared daemon, or a private one started with the transcript's server_limits."""
    limits = doc.get("server_limits")
    if not limits:
        return guestd
    cfg = tmp / "guestd.toml"
    cfg.write_text("[limits]\n" + "".join(f"{k} = {v!r}\n" for k, v in limits.items()))
    return fresh_guestd("--config", str(cfg))


def param(path: Path) -> Any:
    with open(path) as f:
        xfail = json.load(f).get("xfail")
    marks = [pytest.mark.xfail(reason=xfail, strict=True)] if xfail else []
    return pytest.param(path, id=path.stem, marks=marks)


@pytest.mark.parametrize("path", [param(p) for p in TRANSCRIPTS])
def test_transcript(path: Path, guestd: Guestd, fresh_guestd: StartGuestd, tmp_path: Path) -> None:
    g = server_for(run.load(path), guestd, fresh_guestd, tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    result = run.run_transcript(path, unix(g), str(work))
    # A transcript marked xfail reports "xfail" when it fails (the mark expects that) and
    # "xpass" once guestd is fixed, which the strict mark turns into a failure.
    assert result.status in ("pass", "xpass"), result.message


def test_every_transcript_is_described_and_listed_in_the_readme() -> None:
    readme = (KIT / "README.md").read_text()
    assert len(TRANSCRIPTS) >= 15
    for path in TRANSCRIPTS:
        doc = run.load(path)
        assert doc["about"] and doc["spec"] and doc["client_call"] and doc["steps"], path.name
        assert f"| `{path.stem}` |" in readme, f"{path.name} is missing from the README's table"


# ------------------------------------------------------------------ the kit can fail


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


def fake_server(events: list[bytes]) -> Callable[[], socket.socket]:
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


def test_the_fake_server_passes_when_it_keeps_the_rules() -> None:
    result = run.run_transcript(STREAM, fake_server([b"a" * 40000, b"b" * 25536]), timeout=5)
    assert result.status == "pass", result.message


def test_data_beyond_the_credit_fails() -> None:
    result = run.run_transcript(STREAM, fake_server([b"a" * 40000, b"b" * 25537]), timeout=5)
    assert result.status == "fail" and "25537 data bytes for id 1 beyond the credit 25536" in result.message


def test_a_frame_above_the_negotiated_max_frame_fails() -> None:
    result = run.run_transcript(STREAM, fake_server([b"a" * 65530]), timeout=5)
    assert result.status == "fail" and "we accept 65536" in result.message


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
