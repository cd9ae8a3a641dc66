"""Misbehaving HTTP servers on 127.0.0.1 for the canary's hardening tests.

`raw_server(respond)` answers every request with the bytes `respond(method, path)` yields, written as
they come (a generator may never end: an endless body). `blackhole()` is an address whose TCP connect
never completes: a listening socket that never accepts, with its accept queue already full, so the
kernel drops further SYNs and the client's connect waits for its own deadline.
"""

from __future__ import annotations

import gzip
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress

Respond = Callable[[str, str], Iterable[bytes]]


def response_head(status: int, headers: dict[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {status} X"] + [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def gzip_bomb(decoded_bytes: int) -> bytes:
    """A gzip member of `decoded_bytes` zeros: ~1000x smaller on the wire than decoded."""
    return gzip.compress(b"\0" * decoded_bytes, compresslevel=9)


def endless(chunk: bytes = b"x" * 65536) -> Iterator[bytes]:
    """A chunked body that never ends (each item one HTTP chunk)."""
    while True:
        yield f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"


def _read_request(connection: socket.socket) -> tuple[str, str] | None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = connection.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    while len(rest) < length:
        chunk = connection.recv(65536)
        if not chunk:
            return None
        rest += chunk
    return method, path


@contextmanager
def raw_server(respond: Respond) -> Iterator[str]:
    """Serve on a random port; yields the base URL. One thread per connection, one request each."""
    server = socket.create_server(("127.0.0.1", 0))
    stopping = threading.Event()

    def handle(connection: socket.socket) -> None:
        with connection, suppress(OSError):
            request = _read_request(connection)
            if request is None:
                return
            for piece in respond(*request):
                if stopping.is_set():
                    return
                connection.sendall(piece)

    def accept() -> None:
        while not stopping.is_set():
            try:
                connection, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=handle, args=(connection,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        stopping.set()
        with suppress(OSError):
            server.shutdown(socket.SHUT_RDWR)  # wakes the accept(): close() alone leaves it blocked
        server.close()
        thread.join(timeout=5)


@contextmanager
def blackhole() -> Iterator[str]:
    """A base URL whose TCP connect never completes (until the client gives up)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    try:
        # backlog 0 admits one finished connection; the ones after it wait in SYN retransmission.
        for _ in range(3):
            filler = socket.socket()
            filler.setblocking(False)
            with suppress(BlockingIOError):
                filler.connect(("127.0.0.1", port))
            fillers.append(filler)
        time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        for filler in fillers:
            filler.close()
        listener.close()
