"""The workload side of bench/relay.py: loopback servers in one process, one thread per connection.

Prints one JSON line with their ports: ``sink`` (reads to eof, answers the byte count),
``source`` (sends N bytes, then eof), ``accept`` (accepts and closes), ``reply`` (reads one
request, answers ``ok``, closes), ``http`` (HTTP/1.0, a 1 KiB page).
"""

from __future__ import annotations

import http.server
import json
import socket
import sys
import threading

BLOCK = 1 << 20


def listener() -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    s.listen(1024)
    return s


def serve(sock: socket.socket, handle: object) -> None:
    def loop() -> None:
        while True:
            conn, _ = sock.accept()
            threading.Thread(target=handle, args=(conn,), daemon=True).start()  # type: ignore[arg-type]

    threading.Thread(target=loop, daemon=True).start()


def serve_accept_only(sock: socket.socket) -> None:
    """Accept and close in the accept loop itself. A thread per connection (as the other
    servers have) costs ~50 us of CPU on the servers' CPU for each connect: guestd shares that
    CPU, so its connect paid for the server's thread start, which the floor (a connect from
    the client's CPU) never does."""

    def loop() -> None:
        while True:
            conn, _ = sock.accept()
            conn.close()

    threading.Thread(target=loop, daemon=True).start()


def serve_reply(sock: socket.socket) -> None:
    """Read one request (whatever the first read brings), answer ``ok`` and close, in the
    accept loop itself (as serve_accept_only, for the same reason): a connect and a first
    exchange, as an HTTP/1.0 GET or a health check makes."""

    def loop() -> None:
        while True:
            conn, _ = sock.accept()
            with conn:
                if conn.recv(65536):
                    conn.sendall(b"ok")

    threading.Thread(target=loop, daemon=True).start()


def sink(conn: socket.socket) -> None:
    with conn:
        n = 0
        while chunk := conn.recv(BLOCK):
            n += len(chunk)
        conn.sendall(str(n).encode())


def make_source(nbytes: int) -> object:
    block = b"d" * BLOCK

    def source(conn: socket.socket) -> None:
        with conn:
            for _ in range(nbytes // BLOCK):
                conn.sendall(block)

    return source


class Page(http.server.BaseHTTPRequestHandler):
    body = b"x" * 1024

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def main() -> None:
    nbytes = int(sys.argv[1])
    ports = {}
    for name, handler in (("sink", sink), ("source", make_source(nbytes))):
        s = listener()
        serve(s, handler)
        ports[name] = s.getsockname()[1]
    s = listener()
    serve_accept_only(s)
    ports["accept"] = s.getsockname()[1]
    s = listener()
    serve_reply(s)
    ports["reply"] = s.getsockname()[1]
    http.server.ThreadingHTTPServer.request_queue_size = 1024
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    web.daemon_threads = True
    ports["http"] = web.server_address[1]
    threading.Thread(target=web.serve_forever, daemon=True).start()
    print(json.dumps(ports), flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
