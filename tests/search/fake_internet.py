"""A stand-in for the internet in the web fetcher's tests (a resolver and socket stub: DNS answers
and public hosts cannot exist here). Names resolve to what a test scripts, one answer per lookup
(DNS rebinding: public first, then 127.0.0.1); a socket connects to 127.0.0.1 only, any other
address is unreachable, so nothing leaves the machine. A "public" address can be routed to a local
server's port, the peer then reported as that public address (a NAT the fetcher cannot see through),
or routed without disguise (the connection reached another host than the one it asked for)."""

from __future__ import annotations

import errno
import ipaddress
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


class FakeInternet:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.answers: dict[str, list[list[str]]] = {}   # name -> successive answers; the last one repeats
        self.delays: dict[str, float] = {}               # name -> seconds its lookup hangs
        self.lookups: list[str] = []
        self.connects: list[tuple[str, int]] = []
        self.routes: dict[tuple[str, int], tuple[int, bool]] = {}   # (public ip, port) -> (local port, disguised)
        real_getaddrinfo, real_connect = socket.getaddrinfo, socket.socket.connect
        real_getpeername = socket.socket.getpeername

        def getaddrinfo(host, port, *args, **kwargs):
            self.lookups.append(host)
            if host in self.delays:
                time.sleep(self.delays[host])
            if host in self.answers:
                queue = self.answers[host]
                ips = queue.pop(0) if len(queue) > 1 else queue[0]
                return [(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM, 6, "",
                         (ip, port, 0, 0) if ":" in ip else (ip, port)) for ip in ips]
            if host.rstrip(".") == "localhost":
                return real_getaddrinfo("localhost", port, *args, **kwargs)   # /etc/hosts: no DNS
            if _numeric(host):
                return real_getaddrinfo(host, port, *args, **kwargs)
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known (fake internet)")

        def connect(sock, address):
            host, port = address[0], address[1]
            self.connects.append((host, port))
            if (host, port) in self.routes:
                return real_connect(sock, ("127.0.0.1", self.routes[host, port][0]))
            if host != "127.0.0.1":
                raise OSError(errno.ENETUNREACH, "Network is unreachable (tests stay on 127.0.0.1)")
            return real_connect(sock, address)

        def getpeername(sock):
            peer = real_getpeername(sock)
            for (public, port), (local, disguised) in self.routes.items():
                if disguised and peer[:2] == ("127.0.0.1", local):
                    return (public, port)
            return peer

        monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
        monkeypatch.setattr(socket.socket, "connect", connect)
        monkeypatch.setattr(socket.socket, "getpeername", getpeername)


def _numeric(host: str) -> bool:
    try:
        socket.inet_aton(host)   # also 2130706433, 0x7f.1, 127.1: forms the resolver reads as IPv4
        return True
    except OSError:
        pass
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


@contextmanager
def local_site(handle: Callable[[BaseHTTPRequestHandler], tuple[int, dict[str, str], bytes]],
               tls: ssl.SSLContext | None = None) -> Iterator[tuple[int, list[dict]]]:
    """A server on 127.0.0.1 (HTTPS with `tls`) answering every GET and POST with `handle(request) ->
    (status, headers, body)`; yields (port, the requests it saw: path and headers)."""
    seen: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            seen.append({"path": self.path, "headers": dict(self.headers)})
            status, headers, body = handle(self)
            self.send_response(status)
            for name, value in {"Content-Length": str(len(body)), **headers}.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        do_POST = do_GET  # noqa: N815

        def log_message(self, *args) -> None:
            pass

    class Server(ThreadingHTTPServer):
        def get_request(self):
            conn, address = super().get_request()
            if tls is not None:   # the handshake in the handler's thread (a failed one ends that thread only)
                conn = tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
            return conn, address

        def finish_request(self, request, client_address):
            try:
                if tls is not None:
                    request.do_handshake()
                super().finish_request(request, client_address)
            except (ssl.SSLError, OSError):
                pass

    server = Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1], seen
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def dripping_server(head: bytes, body: bytes, byte_every: float) -> Iterator[int]:
    """A raw server on 127.0.0.1 that reads the request, sends `head` at once, then `body` a byte every
    `byte_every` seconds; yields its port."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    stop = threading.Event()

    def serve() -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            conn.recv(65536)
            try:
                conn.sendall(head)
                for byte in body:
                    if stop.is_set():
                        return
                    conn.sendall(bytes([byte]))
                    time.sleep(byte_every)
            except OSError:
                return

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        listener.close()
