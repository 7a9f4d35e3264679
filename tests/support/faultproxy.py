"""A TCP proxy that loses replies: the request reaches the exporter and is processed,
then the connection is cut (or the reply held past the client's deadline) before the
client sees the answer. The client must retry, and the exporter must count it once.

What counts as a reply: over HTTP/1.1 (``h2=False``) anything the server sends; over
HTTP/2 (gRPC) a chunk holding the start of a HEADERS frame on a request stream (the
server's SETTINGS, PING and WINDOW_UPDATE frames pass untouched). Each reply is cut
with probability ``cut`` or delayed by ``delay`` seconds with probability ``hold``.
"""

from __future__ import annotations

import contextlib
import random
import select
import socket
import threading
import time
from collections import Counter


class FaultProxy:
    def __init__(self, target_port: int, cut: float = 0.0, hold: float = 0.0,
                 delay: float = 0.0, h2: bool = True, seed: int = 0):
        self.target = ("127.0.0.1", target_port)
        self.cut, self.hold, self.delay, self.h2 = cut, hold, delay, h2
        self.rng = random.Random(seed)
        self.faults: Counter = Counter()  # cut, held
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._listener.close()
        self._thread.join(5)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            threading.Thread(target=self._pump, args=(client, server), daemon=True).start()

    def _decide(self) -> str:
        with self._lock:
            x = self.rng.random()
            fault = "cut" if x < self.cut else "held" if x < self.cut + self.hold else ""
            if fault:
                self.faults[fault] += 1
            return fault

    def _pump(self, client: socket.socket, server: socket.socket) -> None:
        frames = _Frames()
        try:
            while not self._stop.is_set():
                ready, _, _ = select.select([client, server], [], [], 0.5)
                for s in ready:
                    data = s.recv(1 << 16)
                    if not data:
                        return
                    if s is client:
                        server.sendall(data)
                        continue
                    reply = frames.response_headers(data) if self.h2 else True
                    fault = self._decide() if reply else ""
                    if fault == "cut":
                        return  # the reply is lost with the connection
                    if fault == "held":
                        time.sleep(self.delay)
                    client.sendall(data)
        except OSError:
            return
        finally:
            for s in (client, server):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()


HEADERS = 0x1


class _Frames:
    """Follows the HTTP/2 frames of one direction across chunks (9-byte headers)."""

    def __init__(self):
        self._skip = 0  # payload bytes of the current frame still to come
        self._partial = b""

    def response_headers(self, chunk: bytes) -> bool:
        """True if a HEADERS frame on a stream (not 0) starts in this chunk."""
        found = False
        data, i = self._partial + chunk, 0
        self._partial = b""
        while True:
            if self._skip:
                step = min(self._skip, len(data) - i)
                self._skip -= step
                i += step
                if self._skip:
                    return found
            if len(data) - i < 9:
                self._partial = data[i:]
                return found
            length = int.from_bytes(data[i:i + 3], "big")
            kind = data[i + 3]
            stream = int.from_bytes(data[i + 5:i + 9], "big") & 0x7FFFFFFF
            found |= kind == HEADERS and stream != 0
            i += 9
            self._skip = length
