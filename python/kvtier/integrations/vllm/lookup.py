"""How vLLM's scheduler asks the workers' stores for the longest cached prefix.

The scheduler-side connector decides how many tokens to load before any worker sees the request,
but the KV lives in the workers' stores (their DRAM tier is private to the worker process, and an
SSD pool is opened by one process). So the worker that owns a store answers lookups:

- in the same process (vLLM's single-process mode), through a process-wide registry: a call;
- in another process (vLLM's default multiprocess mode, TP > 1), over a Unix socket in a private
  (0700) per-user directory, named from vLLM's engine id and the TP rank.

A request carries token ids and the request's key extra (salt, LoRA); the worker hashes them in
its own namespace (model, layout, rank) and answers the number of consecutive cached blocks. With
TP > 1 the scheduler asks every rank and takes the smallest answer. A worker that does not answer
in time, or an error, is a miss (0 blocks), never an exception in vLLM's scheduler. The same
channel carries vLLM's connector reset (`reset_prefix_cache(reset_connector=True)`, after a weight
update): each worker clears its store.

Frame: request `<II` (token count, extra length), tokens as `<u4`, extra; reply `<i` (blocks, or
-1 when the worker failed). A clear is a request of `CLEAR` tokens and no extra; its reply is the
blocks dropped, or -1.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import struct
import tempfile
import threading
from pathlib import Path
from typing import Protocol

import numpy as np
import numpy.typing as npt

log = logging.getLogger("kvtier.vllm")

REQUEST = struct.Struct("<II")
REPLY = struct.Struct("<i")
MAX_TOKENS = 1 << 24  # a frame claiming more is refused, not allocated
CLEAR = 0xFFFF_FFFF  # the token count of a clear request
CLEAR_TIMEOUT_S = 300.0  # a clear walks every tier (a shared Redis: every key); a lookup must not


class Endpoint(Protocol):
    """What a worker serves (`worker.WorkerSide`)."""

    def lookup(self, tokens: npt.NDArray[np.uint32], extra: bytes) -> int:
        """Consecutive cached blocks of `tokens` (whole blocks) with key extra `extra`."""
        ...

    def clear(self) -> int:
        """Drops every block of the worker's store; returns how many."""
        ...


_registry: dict[str, Endpoint] = {}
_registry_lock = threading.Lock()


def channel(engine_id: str, rank: int) -> str:
    return f"{engine_id}/{rank}"


def socket_path(engine_id: str, rank: int) -> Path:
    """The worker's socket: in a 0700 directory of this user, named by a hash of the engine id."""
    d = Path(tempfile.gettempdir()) / f"kvtier-vllm-{os.getuid()}"
    d.mkdir(mode=0o700, exist_ok=True)
    st = d.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{d} is not a private directory of this user (mode {oct(st.st_mode & 0o777)})")
    digest = hashlib.sha256(engine_id.encode()).hexdigest()[:24]
    return d / f"{digest}-{rank}.sock"


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed the lookup channel")
        buf += chunk
    return bytes(buf)


class LookupServer:
    """Serves lookups for one worker: registered in-process and on its Unix socket."""

    def __init__(self, engine_id: str, rank: int, endpoint: Endpoint) -> None:
        self.name = channel(engine_id, rank)
        self.endpoint = endpoint
        self.path = socket_path(engine_id, rank)
        with _registry_lock:
            _registry[self.name] = endpoint
        self.path.unlink(missing_ok=True)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(self.path))
        os.chmod(self.path, 0o600)
        self.sock.listen(16)
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self.thread = threading.Thread(target=self._serve, name="kvtier-lookup", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self._conns_lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            self._serve_conn(conn)
        finally:
            with self._conns_lock:
                self._conns.discard(conn)
            conn.close()

    def _serve_conn(self, conn: socket.socket) -> None:
        while not self._closed:
            try:
                n_tokens, n_extra = REQUEST.unpack(_recv_exact(conn, REQUEST.size))
            except (ConnectionError, OSError):
                return
            if n_tokens == CLEAR and n_extra == 0:
                if not self._reply(conn, self._clear()):
                    return
                continue
            if n_tokens > MAX_TOKENS or n_extra > 1 << 16:
                log.error("kvtier lookup: refused a frame of %d tokens, %d extra bytes", n_tokens, n_extra)
                return
            try:
                tokens = np.frombuffer(_recv_exact(conn, 4 * n_tokens), dtype="<u4").astype(np.uint32)
                extra = _recv_exact(conn, n_extra)
            except (ConnectionError, OSError):
                return
            if self._closed:
                return
            try:
                hit = int(self.endpoint.lookup(tokens, extra))
            except Exception:
                log.exception("kvtier lookup failed; answering a miss")
                hit = -1
            if not self._reply(conn, hit):
                return

    @staticmethod
    def _reply(conn: socket.socket, value: int) -> bool:
        try:
            conn.sendall(REPLY.pack(value))
        except OSError:
            return False
        return True

    def _clear(self) -> int:
        try:
            return int(self.endpoint.clear())
        except Exception:
            log.exception("kvtier: clearing the worker's store failed")
            return -1

    def close(self) -> None:
        """Stops answering: the registry entry, the listening socket and every open connection
        (a client then sees the worker gone and answers misses)."""
        with self._conns_lock:
            self._closed = True
            conns = list(self._conns)
        with _registry_lock:
            _registry.pop(self.name, None)
        for conn in conns:
            with contextlib.suppress(OSError):  # already closed by the peer
                conn.shutdown(socket.SHUT_RDWR)
        try:
            self.sock.close()
        finally:
            self.path.unlink(missing_ok=True)


class LookupClient:
    """The scheduler's view of one rank's store: in-process when the worker is here, else a socket."""

    def __init__(self, engine_id: str, rank: int, timeout_s: float) -> None:
        self.engine_id, self.rank, self.timeout_s = engine_id, rank, timeout_s
        self.name = channel(engine_id, rank)
        self._sock: socket.socket | None = None
        self.failures = 0
        self.local_calls = 0  # answered in this process (single-process vLLM)
        self.socket_calls = 0  # answered by a worker process

    def _connect(self) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout_s)
        try:
            s.connect(str(socket_path(self.engine_id, self.rank)))
        except OSError:
            s.close()
            raise
        return s

    def lookup(self, tokens: npt.NDArray[np.uint32], extra: bytes) -> int:
        """Cached blocks of `tokens` (whole blocks) on this rank; 0 on any failure."""
        with _registry_lock:
            local = _registry.get(self.name)
        if local is not None:
            self.local_calls += 1
            try:
                return max(0, int(local.lookup(tokens, extra)))
            except Exception:
                log.exception("kvtier lookup failed; treating it as a miss")
                self.failures += 1
                return 0
        for attempt in (0, 1):  # one reconnect: the worker may have restarted its socket
            try:
                if self._sock is None:
                    self._sock = self._connect()
                data = np.ascontiguousarray(tokens, dtype="<u4").tobytes()
                self._sock.sendall(REQUEST.pack(len(tokens), len(extra)) + data + extra)
                (hit,) = REPLY.unpack(_recv_exact(self._sock, REPLY.size))
                self.socket_calls += 1
                return max(0, int(hit))
            except (OSError, ConnectionError) as e:
                if self._sock is not None:
                    self._sock.close()
                    self._sock = None
                if attempt == 1:
                    self.failures += 1
                    log.warning("kvtier lookup on rank %d failed (%s); treating it as a miss", self.rank, e)
        return 0

    def clear(self) -> bool:
        """Asks this rank's worker to clear its store; False (logged) if it could not, or did not
        answer within `CLEAR_TIMEOUT_S`."""
        with _registry_lock:
            local = _registry.get(self.name)
        try:
            if local is not None:
                dropped = int(local.clear())
            else:
                if self._sock is None:
                    self._sock = self._connect()
                self._sock.settimeout(CLEAR_TIMEOUT_S)
                try:
                    self._sock.sendall(REQUEST.pack(CLEAR, 0))
                    (dropped,) = REPLY.unpack(_recv_exact(self._sock, REPLY.size))
                finally:
                    self._sock.settimeout(self.timeout_s)
        except Exception as e:
            log.error("kvtier: clearing rank %d's store failed (%s)", self.rank, e)
            self.close()  # the reply may still come: this connection is out of step now
            return False
        if dropped < 0:
            log.error("kvtier: rank %d could not clear its store (its log says why)", self.rank)
            return False
        log.info("kvtier: rank %d dropped %d blocks", self.rank, dropped)
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
