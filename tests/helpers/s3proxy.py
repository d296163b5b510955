"""A fault-injecting HTTP proxy between an S3 client and the test server (tests/helpers/s3server.py).

It understands just enough HTTP/1.1 (request and response framing: Content-Length, chunked, no
body for HEAD / 1xx / 204 / 304) to count requests across keep-alive connections and to act on a
chosen one. Every request gets a number in arrival order (``proxy.log``: (number, method, path));
``proxy.rule(n, method, path)`` picks what happens to it:

  * ``None``: forwarded, the answer returned;
  * ``"stall"``: never forwarded, never answered, the connection left open and silent (a stopped
    server, a hung gateway, a black-holing middlebox);
  * ``"reset"``: never forwarded, the connection reset (RST);
  * ``"lose_answer"``: forwarded, the server acts, then the connection is reset instead of the
    answer being returned;
  * ``"act_then_stall"``: forwarded, the server acts, the answer is never returned and the
    connection stays silent;
  * ``("delay", seconds)``: forwarded after a pause.
  * ``("cut", nbytes)``: forwarded, the server acts, then the answer is sent without its
    Content-Length (``Connection: close``) and only its first ``nbytes`` of body, and the
    connection is closed cleanly: a body cut short that the client cannot tell from a whole one
    by its framing (a proxy or gateway that closes early).
  * ``("flip", offset)``: forwarded, the answer returned with one bit of its body flipped at
    ``offset`` (or its last byte): bytes changed in transit, the stored object intact.
  * ``("long", nbytes)``: forwarded, the answer returned as ``200 OK`` with ``nbytes`` more bytes
    of body than the server sent (Content-Length matching, no Content-Range): a gateway or cache
    that ignored a ranged GET's Range header.

Real sockets, a real server: the client stack (s3fs / aiobotocore / aiohttp) sees exactly what it
would see from a real faulty network.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from typing import Callable

__all__ = ["FaultProxy"]

Rule = Callable[[int, str, str], object]


def _read_until(sock: socket.socket, buf: bytearray, marker: bytes) -> int:
    while True:
        i = buf.find(marker)
        if i >= 0:
            return i
        chunk = sock.recv(65536)
        if not chunk:
            raise EOFError
        buf += chunk


def _read_exact(sock: socket.socket, buf: bytearray, n: int) -> bytes:
    while len(buf) < n:
        chunk = sock.recv(max(65536, n - len(buf)))
        if not chunk:
            raise EOFError
        buf += chunk
    out = bytes(buf[:n])
    del buf[:n]
    return out


def _read_message(sock: socket.socket, buf: bytearray, *, request_method: str | None = None) -> tuple[bytes, str, dict]:
    """One HTTP message (start line + headers + body) from ``sock``: (raw bytes, start line, headers)."""
    end = _read_until(sock, buf, b"\r\n\r\n")
    head = bytes(buf[:end + 4])
    del buf[:end + 4]
    lines = head[:-4].decode("latin-1").split("\r\n")
    start = lines[0]
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    body = b""
    no_body = False
    if request_method is None and headers.get("expect", "").lower() == "100-continue":
        # The client waits for "100 Continue" before it sends the body: say it here, and forward
        # the request without the header (the server then sends no interim answer of its own).
        sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        head = b"\r\n".join(line for line in head.split(b"\r\n") if not line.lower().startswith(b"expect:"))
    if request_method is not None:  # a response
        status = int(start.split()[1])
        no_body = request_method == "HEAD" or status in (204, 304) or 100 <= status < 200
    if no_body:
        pass
    elif "chunked" in headers.get("transfer-encoding", "").lower():
        parts = []
        while True:
            i = _read_until(sock, buf, b"\r\n")
            size_line = bytes(buf[:i + 2])
            del buf[:i + 2]
            parts.append(size_line)
            size = int(size_line.split(b";")[0].strip(), 16)
            if size == 0:
                # trailers until an empty line
                while True:
                    j = _read_until(sock, buf, b"\r\n")
                    line = bytes(buf[:j + 2])
                    del buf[:j + 2]
                    parts.append(line)
                    if line == b"\r\n":
                        break
                break
            parts.append(_read_exact(sock, buf, size + 2))
        body = b"".join(parts)
    elif "content-length" in headers:
        body = _read_exact(sock, buf, int(headers["content-length"]))
    return head + body, start, headers


def _reset(sock: socket.socket) -> None:
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


class FaultProxy:
    """Listens on 127.0.0.1 and forwards to ``upstream`` (host, port); see the module docstring."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.rule: Rule = lambda n, method, path: None
        self.log: list[tuple[int, str, str]] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._socks: set[socket.socket] = set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, name="s3proxy-accept", daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def reset_log(self) -> None:
        with self._lock:
            self.log.clear()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._socks.add(client)
            threading.Thread(target=self._serve, args=(client,), name="s3proxy-conn", daemon=True).start()

    def _hold(self, client: socket.socket) -> None:
        """Keep the connection open and silent until the client gives up or the proxy closes."""
        client.settimeout(0.2)
        while not self._closed.is_set():
            try:
                if not client.recv(65536):
                    return
            except socket.timeout:
                continue
            except OSError:
                return

    def _serve(self, client: socket.socket) -> None:
        upstream = None
        cbuf, ubuf = bytearray(), bytearray()
        try:
            while not self._closed.is_set():
                try:
                    raw, start, headers = _read_message(client, cbuf)
                except (EOFError, OSError, ValueError):
                    return
                method, path = start.split()[0], start.split()[1]
                with self._lock:
                    n = len(self.log)
                    self.log.append((n, method, path))
                action = self.rule(n, method, path)
                if action == "stall":
                    self._hold(client)
                    return
                if action == "reset":
                    _reset(client)
                    return
                if isinstance(action, tuple) and action[0] == "delay":
                    time.sleep(action[1])
                if upstream is None:
                    upstream = socket.create_connection(self.upstream)
                    with self._lock:
                        self._socks.add(upstream)
                upstream.sendall(raw)
                while True:  # skip interim 1xx answers
                    resp, status_line, _ = _read_message(upstream, ubuf, request_method=method)
                    if not 100 <= int(status_line.split()[1]) < 200:
                        break
                    client.sendall(resp)
                if action == "lose_answer":
                    _reset(client)
                    return
                if action == "act_then_stall":
                    self._hold(client)
                    return
                if isinstance(action, tuple) and action[0] == "cut":
                    head, _, body = resp.partition(b"\r\n\r\n")
                    lines = [ln for ln in head.split(b"\r\n")
                             if not ln.lower().startswith((b"content-length:", b"connection:"))]
                    client.sendall(b"\r\n".join(lines + [b"Connection: close"]) + b"\r\n\r\n" + body[:action[1]])
                    client.shutdown(socket.SHUT_WR)
                    return
                if isinstance(action, tuple) and action[0] == "long":
                    head, _, body = resp.partition(b"\r\n\r\n")
                    lines = head.split(b"\r\n")
                    status = lines[0].replace(b" 206 Partial Content", b" 200 OK")
                    rest = [ln for ln in lines[1:] if not ln.lower().startswith((b"content-length:", b"content-range:"))]
                    body += b"\x00" * action[1]
                    resp = b"\r\n".join([status, *rest, b"Content-Length: %d" % len(body)]) + b"\r\n\r\n" + body
                if isinstance(action, tuple) and action[0] == "flip":
                    head, _, body = resp.partition(b"\r\n\r\n")
                    if body:
                        body = bytearray(body)
                        body[min(action[1], len(body) - 1)] ^= 0x01
                        resp = head + b"\r\n\r\n" + bytes(body)
                client.sendall(resp)
        except (EOFError, OSError):
            return
        finally:
            for s in (client, upstream):
                if s is not None:
                    try:
                        s.close()
                    except OSError:
                        pass

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            try:
                s.close()
            except OSError:
                pass

    def __enter__(self) -> "FaultProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
