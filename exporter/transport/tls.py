"""TLS and mutual TLS on every port, from PEM files that are reloaded when they change.

``--tls-cert-file`` / ``--tls-key-file`` turn TLS on for all four ports;
``--tls-client-ca-file`` adds mutual TLS: ingest (phasewatch gRPC, OTLP/gRPC,
OTLP/HTTP) then requires a client certificate signed by that CA, and the HTTP port
requires one for ``/api/v1/`` while ``/metrics`` and the probes stay reachable
without (Prometheus may present one; the kubelet cannot).

The handshake is done here, in Python's ``ssl`` (OpenSSL), for every port, so that a
refused handshake is counted with its reason in
``phasewatch_auth_refused_total{receiver,reason}`` (``no_client_certificate``,
``bad_certificate``, ``tls_handshake``, ``handshake_timeout``): the HTTP servers wrap
each accepted connection; the gRPC receivers sit behind a small TLS front that
relays the decrypted stream to the gRPC server on a private Unix socket (ALPN
``h2``). The files are checked at most once a second; new connections get the new
certificates, a set that fails to load is logged, counted in
``phasewatch_tls_reloads_total{result="error"}`` and the previous one kept.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from phasewatch.selfstats import SelfStats

log = logging.getLogger(__name__)
CHECK_SECONDS = 1.0
HANDSHAKE_SECONDS = 10.0
CHUNK = 1 << 16


@dataclass(frozen=True)
class ClientTls:
    """A client's side: the CA that signed the exporter's certificate (empty: the
    system's), and this client's certificate and key for mutual TLS."""

    ca: str = ""
    cert: str = ""
    key: str = ""

    def __post_init__(self):
        if bool(self.cert) != bool(self.key):
            raise ValueError("a client certificate needs its key (--exporter-tls-cert and "
                             "--exporter-tls-key)")

    @property
    def enabled(self) -> bool:
        return bool(self.ca or self.cert)

    def ssl_context(self) -> ssl.SSLContext:
        """For urllib / http.client: verifies the server, presents the certificate."""
        ctx = ssl.create_default_context(cafile=self.ca or None)
        if self.cert:
            ctx.load_cert_chain(self.cert, self.key)
        return ctx

    def grpc_credentials(self):
        """gRPC channel credentials: the CA to trust (empty: the system's) and, for
        mutual TLS, this client's certificate and key."""
        import grpc

        def read(path: str) -> bytes | None:
            if not path:
                return None
            with open(path, "rb") as f:
                return f.read()

        return grpc.ssl_channel_credentials(read(self.ca), read(self.key), read(self.cert))


class TlsFiles:
    """The certificate, key and optional client CA, as server contexts kept current."""

    def __init__(self, cert_file: str, key_file: str, client_ca_file: str = "",
                 stats: SelfStats | None = None):
        if not cert_file or not key_file:
            raise ValueError("TLS needs both --tls-cert-file and --tls-key-file")
        self.files = tuple(f for f in (cert_file, key_file, client_ca_file) if f)
        self.cert_file, self.key_file, self.client_ca_file = cert_file, key_file, client_ca_file
        self._stats = stats or SelfStats()
        self._lock = threading.Lock()
        self._checked = 0.0
        self._stamp = self._stamps()
        self._contexts: dict[tuple, ssl.SSLContext] = {}
        self._build(("h2",), "require")  # fails at start on unusable files

    @property
    def mutual(self) -> bool:
        return bool(self.client_ca_file)

    def _stamps(self) -> tuple:
        out = []
        for f in self.files:
            try:
                st = os.stat(f)
            except OSError as e:
                raise ValueError(f"cannot read TLS file {f}: {e.strerror}") from None
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        return tuple(out)

    def _build(self, alpn: tuple[str, ...], client: str) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(self.cert_file, self.key_file)
            if self.client_ca_file and client != "none":
                ctx.load_verify_locations(self.client_ca_file)
                ctx.verify_mode = ssl.CERT_REQUIRED if client == "require" else ssl.CERT_OPTIONAL
        except (ssl.SSLError, OSError) as e:
            raise ValueError(f"cannot load TLS certificate {self.cert_file} / key "
                             f"{self.key_file} / client CA {self.client_ca_file or '-'}: "
                             f"{e}") from None
        ctx.set_alpn_protocols(list(alpn))
        return ctx

    def context(self, alpn: tuple[str, ...], client: str) -> ssl.SSLContext:
        """The current context for ``alpn`` and client-certificate policy (``require``,
        ``optional``, ``none``), rebuilt when the files changed."""
        key = (alpn, client)
        with self._lock:
            now = time.monotonic()
            if now - self._checked >= CHECK_SECONDS:
                self._checked = now
                self._reload()
            ctx = self._contexts.get(key)
            if ctx is None:
                ctx = self._contexts[key] = self._build(alpn, client)
            return ctx

    def _reload(self) -> None:
        try:
            stamp = self._stamps()
            if stamp == self._stamp:
                return
            # rebuild what is in use (or one context, to check the files, if none is)
            keys = list(self._contexts) or [(("h2",), "require")]
            fresh = {key: self._build(*key) for key in keys}
        except ValueError as e:  # half-written files, a key not matching: keep the old
            self._stats.inc("phasewatch_tls_reloads_total", result="error")
            log.error("TLS files changed but cannot be loaded; keeping the previous ones: %s", e)
            return
        self._contexts, self._stamp = fresh, stamp
        self._stats.inc("phasewatch_tls_reloads_total", result="ok")
        log.info("TLS certificates reloaded from %s", ", ".join(self.files))

    def accept(self, sock: socket.socket, receiver: str, alpn: tuple[str, ...],
               client: str) -> ssl.SSLSocket | None:
        """Handshake on an accepted connection; None (closed, counted) if it fails."""
        try:
            tls = self.context(alpn, client).wrap_socket(sock, server_side=True,
                                                         do_handshake_on_connect=False)
            tls.settimeout(HANDSHAKE_SECONDS)
            tls.do_handshake()
            tls.settimeout(None)
            return tls
        except (ssl.SSLError, OSError, ValueError) as e:
            reason = refusal_reason(e)
            self._stats.inc("phasewatch_auth_refused_total", receiver=receiver, reason=reason)
            log.debug("%s: TLS handshake refused (%s): %s", receiver, reason, e)
            with contextlib.suppress(OSError):
                sock.close()
            return None


def refusal_reason(e: Exception) -> str:
    text = f"{getattr(e, 'reason', '')} {e}".upper()
    if isinstance(e, (socket.timeout, TimeoutError)):
        return "handshake_timeout"
    if "PEER DID NOT RETURN A CERTIFICATE" in text or "CERTIFICATE_REQUIRED" in text or (
            "NO_CERTIFICATE" in text):
        return "no_client_certificate"
    if "CERTIFICATE" in text or "UNKNOWN_CA" in text or "VERIFY" in text:
        return "bad_certificate"
    return "tls_handshake"


class TlsFront:
    """A TLS listener for a gRPC receiver: each connection's handshake is done (and a
    refusal counted) here, then its decrypted bytes are relayed to the gRPC server on
    a private Unix socket, one thread per connection, at most ``max_connections``."""

    def __init__(self, tls: TlsFiles, host: str, port: int, backend: str, receiver: str,
                 max_connections: int, on_busy: Callable[[], None]):
        self._tls, self._backend, self._receiver = tls, backend, receiver
        self._slots = threading.BoundedSemaphore(max_connections)
        self._on_busy = on_busy
        self._listener = socket.create_server((host, port), reuse_port=False)
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name=f"pw-tls-{receiver}",
                                        daemon=True)

    def start(self) -> TlsFront:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._thread.join(2)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                self._on_busy()
                sock.close()
                continue
            threading.Thread(target=self._serve, args=(sock,), daemon=True,
                             name=f"pw-tls-{self._receiver}-conn").start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            tls = self._tls.accept(sock, self._receiver, ("h2",),
                                   "require" if self._tls.mutual else "none")
            if tls is None:
                return
            backend = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                backend.connect(self._backend)
                relay(tls, backend)  # ends when either side closes, after the gRPC drain
            finally:
                for s in (tls, backend):
                    with contextlib.suppress(OSError):
                        s.close()
        finally:
            self._slots.release()


def relay(tls: ssl.SSLSocket, plain: socket.socket) -> None:
    """Copy both ways between a TLS socket and a plain one until either side closes.
    One thread: an OpenSSL connection must not be read and written concurrently."""
    tls.setblocking(False)
    plain.setblocking(False)
    up = down = b""  # client -> server and server -> client bytes not yet written
    try:
        while True:
            if not up and tls.pending():  # decrypted bytes already buffered in OpenSSL
                readable = [tls]
            else:
                rlist = ([tls] if not up else []) + ([plain] if not down else [])
                wlist = ([plain] if up else []) + ([tls] if down else [])
                readable, _, _ = select.select(rlist, wlist, [], 30.0)
            if tls in readable:
                try:
                    up = tls.recv(CHUNK)
                    if not up:
                        return
                except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                    pass
            if plain in readable:
                down = plain.recv(CHUNK)
                if not down:
                    return
            if up:
                with contextlib.suppress(BlockingIOError):
                    up = up[plain.send(up):]
            if down:
                with contextlib.suppress(ssl.SSLWantReadError, ssl.SSLWantWriteError,
                                         BlockingIOError):
                    down = down[tls.send(down):]
    except (OSError, ssl.SSLError):  # a reset or a TLS alert on either side: done
        return
