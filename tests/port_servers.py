"""Servers the port tests run inside the guest (``python port_servers.py MODE PORT [DIR]``).

- ``http``: HTTP/1.1 on 127.0.0.1: GET serves files from DIR, POST echoes its body back;
  ``/ws`` upgrades to a WebSocket that echoes every message (RFC 6455, no extensions).
- ``echo``: every byte back; after the peer's eof, ``bye`` and eof.
- ``halfclose``: sends ``go`` and shuts its write side at once, then counts what it still
  receives until eof and writes the count to DIR/count.
- ``reset``: on each connection, reads a line and closes with RST (SO_LINGER 0).
- ``watchreset``: reads until the connection ends and writes ``eof`` or ``reset`` to DIR/how.
- ``flood``: sends bytes without end; ``sink``: accepts and never reads.
- ``full``: listens with a backlog of 0 and never accepts; once its own connection fills the
  queue, every further connect hangs (its SYNs are dropped). Writes DIR/full when so.
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import os
import socket
import socketserver
import struct
import sys
import threading

WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455 section 1.3


def ws_accept(key: str) -> str:
    return base64.b64encode(hashlib.sha1(key.encode() + WS_GUID).digest()).decode()


def ws_read_frame(rfile: object) -> tuple[int, bytes] | None:
    read = rfile.read  # type: ignore[attr-defined]
    head = read(2)
    if len(head) < 2:
        return None
    opcode, n = head[0] & 0x0F, head[1] & 0x7F
    masked = head[1] & 0x80
    if n == 126:
        n = struct.unpack("!H", read(2))[0]
    elif n == 127:
        n = struct.unpack("!Q", read(8))[0]
    mask = read(4) if masked else b""
    data = bytearray(read(n))
    if mask:
        for i in range(len(data)):
            data[i] ^= mask[i % 4]
    return opcode, bytes(data)


def ws_frame(opcode: int, data: bytes, mask: bytes = b"") -> bytes:
    n = len(data)
    head = bytes([0x80 | opcode])
    bit = 0x80 if mask else 0
    if n < 126:
        head += bytes([bit | n])
    elif n < 1 << 16:
        head += bytes([bit | 126]) + struct.pack("!H", n)
    else:
        head += bytes([bit | 127]) + struct.pack("!Q", n)
    if mask:
        data = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
    return head + mask + data


class Handler(http.server.SimpleHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path != "/ws":
            super().do_GET()
            return
        self.send_response(101)
        self.send_header("Upgrade", "websocket")
        self.send_header("Connection", "Upgrade")
        self.send_header("Sec-WebSocket-Accept", ws_accept(self.headers["Sec-WebSocket-Key"]))
        self.end_headers()
        self.wfile.flush()
        while (frame := ws_read_frame(self.rfile)) is not None:
            opcode, data = frame
            if opcode == 8:
                self.wfile.write(ws_frame(8, data))
                break
            self.wfile.write(ws_frame(opcode, data))
            self.wfile.flush()
        self.close_connection = True


def serve_http(port: int, directory: str) -> None:
    os.chdir(directory)
    http.server.ThreadingHTTPServer.request_queue_size = 256
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    server.serve_forever()


def serve_raw(mode: str, port: int, directory: str) -> None:
    class Raw(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            s: socket.socket = self.request
            if mode == "echo":
                while data := s.recv(1 << 20):
                    s.sendall(data)
                s.sendall(b"bye")
                s.shutdown(socket.SHUT_WR)
            elif mode == "halfclose":
                s.sendall(b"go")
                s.shutdown(socket.SHUT_WR)
                n = 0
                while data := s.recv(1 << 20):
                    n += len(data)
                with open(os.path.join(directory, "count.tmp"), "w") as f:
                    f.write(str(n))
                os.rename(os.path.join(directory, "count.tmp"), os.path.join(directory, "count"))
            elif mode == "reset":
                s.makefile("rb").readline()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()  # RST now (socketserver's own shutdown would send FIN first)
            elif mode == "watchreset":
                try:
                    while s.recv(1 << 16):
                        pass
                    how = "eof"
                except ConnectionResetError:
                    how = "reset"
                with open(os.path.join(directory, "how.tmp"), "w") as f:
                    f.write(how)
                os.rename(os.path.join(directory, "how.tmp"), os.path.join(directory, "how"))
            elif mode == "flood":
                block = b"f" * (1 << 20)
                try:
                    while True:
                        s.sendall(block)
                except OSError:
                    pass
            elif mode == "sink":
                threading.Event().wait()

    class Server(socketserver.ThreadingTCPServer):
        allow_reuse_address = True
        daemon_threads = True
        request_queue_size = 256  # 100 streams connect at once (the default 5 drops and resets)

    Server(("127.0.0.1", port), Raw).serve_forever()


def serve_full(port: int, directory: str) -> None:
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen(0)
    filler = socket.create_connection(("127.0.0.1", port))  # queued, never accepted: the queue is full
    with open(os.path.join(directory, "full.tmp"), "w") as f:
        f.write("full")
    os.rename(os.path.join(directory, "full.tmp"), os.path.join(directory, "full"))
    threading.Event().wait()
    filler.close()


if __name__ == "__main__":
    mode, port_text = sys.argv[1], sys.argv[2]
    where = sys.argv[3] if len(sys.argv) > 3 else "."
    if mode == "http":
        serve_http(int(port_text), where)
    elif mode == "full":
        serve_full(int(port_text), where)
    else:
        serve_raw(mode, int(port_text), where)
