"""Throw-away Redis/Valkey servers on loopback, for tests and benchmarks (not part of the product).

- :class:`LocalRedis`: one ``redis-server`` (or ``valkey-server``) on a free 127.0.0.1 port, no
  persistence, optionally with a password, cluster mode or TLS; started and stopped by pid.
- :class:`LocalCluster`: three (or more) cluster-mode servers formed into a Redis Cluster.
- :func:`free_port`: a free port outside the kernel's ephemeral range (and, for a cluster node,
  its bus port too), so no outgoing connection takes it before the server binds it.
- :func:`command`: one command over a fresh connection, for fixtures (plant or damage values,
  ``DBSIZE``, ``CLUSTER INFO``); never for serving.

Every wait is bounded (:data:`SERVER_START_TIMEOUT_S`, :data:`CLUSTER_FORM_TIMEOUT_S`,
:data:`START_ATTEMPTS`). Moved here from ``kvtier.remote`` (issue 18): the remote tier itself is
``kvtier.remote``; see ``docs/remote.md``.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import ssl
import subprocess
import time
from pathlib import Path
from typing import Any

#: jemalloc settings for a server that serves multi-MiB values (``LocalRedis(malloc_conf=...)``).
#: redis-server copies each GET reply into a freshly allocated buffer; with jemalloc's default
#: ``muzzy_decay_ms:0`` the freed buffer's pages go back to the kernel at once, so the next 4 MiB
#: reply faults in and zeroes 1024 new pages (measured with ``perf``: ~40% of the server's time
#: per 4 MiB GET). ``muzzy_decay_ms:-1`` keeps them (they are ``MADV_FREE``, so the kernel can
#: still reclaim them under memory pressure). docs/remote.md recommends it for deployments.
LARGE_VALUE_MALLOC_CONF = "muzzy_decay_ms:-1"

#: How long to wait for a started server to answer, and for a cluster to form (bounded loops).
SERVER_START_TIMEOUT_S = 10.0
CLUSTER_FORM_TIMEOUT_S = 20.0


def server_binaries() -> tuple[str, str]:
    """(server, cli) paths: ``valkey-server``/``valkey-cli`` when installed, else ``redis-*``.

    Raises :class:`RuntimeError` naming the package to install when neither is there.
    """
    for server, cli in (("valkey-server", "valkey-cli"), ("redis-server", "redis-cli")):
        s, c = shutil.which(server), shutil.which(cli)
        if s and c:
            return s, c
    raise RuntimeError(
        "neither valkey-server nor redis-server is installed; expected the Debian package "
        "(apt-get install -y redis-server), which `make test` installs"
    )


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


EPHEMERAL_DEFAULT = (32768, 60999)  # Linux's default, when /proc cannot be read
START_ATTEMPTS = 5  # a first start that loses its port to another process is retried on new ports


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (``ip_local_port_range``).

    A port in it can be taken by any outgoing connection on the machine at any moment, so a port
    checked free now and bound later must lie outside it."""
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return EPHEMERAL_DEFAULT
    return lo, hi


def _candidate_ranges(offset: int) -> list[range]:
    """Ports p with p and p + offset outside the ephemeral range, in 1024..65535."""
    lo, hi = ephemeral_range()
    top = 65535 - offset
    spans = [(1024, min(lo - 1 - offset, top)), (max(hi + 1, 1024), top)]
    return [range(a, b + 1) for a, b in spans if b >= a]


def free_port(cluster: bool = False) -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, outside the ephemeral range (so no
    outgoing connection takes it before the server binds it). With ``cluster``, its cluster bus
    port (+10000) is free and outside that range too."""
    offset = 10000 if cluster else 0
    ranges = _candidate_ranges(offset)
    if not ranges:  # an ephemeral range covering nearly everything: take any port, rely on retries
        ranges = [range(1024, 65536 - offset)]
    rng = random.Random()
    total = sum(len(r) for r in ranges)
    for _ in range(1000):  # bounded: a busy machine still has free ports there
        i = rng.randrange(total)
        for r in ranges:
            if i < len(r):
                port = r[i]
                break
            i -= len(r)
        if _bindable(port) and (not cluster or _bindable(port + offset)):
            return port
    kind = "port pair (p, p + 10000)" if cluster else "port"
    raise RuntimeError(f"no free {kind} outside the ephemeral range {ephemeral_range()} on 127.0.0.1")


def command(
    port: int,
    *args: bytes | str,
    password: str | None = None,
    timeout_s: float = 2.0,
    tls_ca_file: str | None = None,
    tls_client: tuple[str, str] | None = None,
) -> Any:
    """Sends one command to a loopback server and returns its reply (str, int, bytes, list,
    or a :class:`RuntimeError` instance for an error reply). For fixtures, not for serving."""
    parts = [a.encode() if isinstance(a, str) else a for a in args]
    raw = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    if tls_ca_file is not None:
        context = ssl.create_default_context(cafile=tls_ca_file)
        if tls_client is not None:
            context.load_cert_chain(*tls_client)
        raw = context.wrap_socket(raw, server_hostname="127.0.0.1")
    with raw as s:
        f = s.makefile("rb")
        if password is not None:
            s.sendall(_encode([b"AUTH", password.encode()]))
            _read(f)
        s.sendall(_encode(parts))
        return _read(f)


def _encode(parts: list[bytes]) -> bytes:
    out = [b"*%d\r\n" % len(parts)]
    for p in parts:
        out.append(b"$%d\r\n%s\r\n" % (len(p), p))
    return b"".join(out)


def _read(f: Any) -> Any:
    line: bytes = f.readline()
    if not line.endswith(b"\r\n"):
        raise ConnectionError("server closed the connection")
    kind, rest = line[:1], line[1:-2]
    if kind == b"+":
        return rest.decode()
    if kind == b"-":
        return RuntimeError(rest.decode())
    if kind == b":":
        return int(rest)
    if kind == b"$":
        n = int(rest)
        if n < 0:
            return None
        data: bytes = f.read(n + 2)[:-2]
        return data
    if kind == b"*":
        n = int(rest)
        return None if n < 0 else [_read(f) for _ in range(n)]
    raise ConnectionError(f"unexpected reply {line[:40]!r}")


class _PortTaken(RuntimeError):
    """A server exited at start because another process holds its port or bus port."""


class LocalRedis:
    """A ``redis-server`` (or ``valkey-server``) on a free 127.0.0.1 port, no persistence, stopped
    by pid. ``password`` sets ``requirepass``; ``cluster`` enables cluster mode; ``tls`` =
    (CA file, server certificate, server key) serves TLS only (``rediss://``) on the port;
    ``tls_client`` = (certificate, key) makes clients present a certificate the CA signed (mutual
    TLS); the fixture's own commands use that one. ``malloc_conf`` is passed to the server as
    ``MALLOC_CONF`` (jemalloc's settings; see :data:`LARGE_VALUE_MALLOC_CONF`)."""

    def __init__(
        self,
        workdir: str | Path,
        password: str | None = None,
        cluster: bool = False,
        tls: tuple[str, str, str] | None = None,
        tls_client: tuple[str, str] | None = None,
        malloc_conf: str | None = None,
    ) -> None:
        self.server, self.cli = server_binaries()
        self.malloc_conf = malloc_conf
        self.password = password
        self.cluster = cluster
        self.tls = tls
        self.tls_client = tls_client
        self._root = Path(workdir)
        self._pick_port()
        self.started_once = False
        self.port_retries = 0  # first starts that lost their port and moved to a new one
        self.proc: subprocess.Popen[bytes] | None = None

    def _pick_port(self) -> None:
        self.port = free_port(self.cluster)
        self.workdir = self._root / f"redis-{self.port}"
        self.workdir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        auth = "" if self.password is None else f":{self.password}@"
        return f"{self._scheme}://{auth}127.0.0.1:{self.port}"

    @property
    def _scheme(self) -> str:
        return "redis" if self.tls is None else "rediss"

    @property
    def plain_url(self) -> str:
        """The URL without credentials."""
        return f"{self._scheme}://127.0.0.1:{self.port}"

    def start(self) -> LocalRedis:
        """Starts the server. A first start whose port (or cluster bus port) was taken after it was
        picked moves to new ports, up to ``START_ATTEMPTS`` times; a restart keeps its port (clients
        hold the URL), so a taken port is an error then."""
        for attempt in range(START_ATTEMPTS):
            try:
                self._start_once()
            except _PortTaken as e:
                if self.started_once or attempt == START_ATTEMPTS - 1:
                    raise RuntimeError(str(e)) from None
                self.port_retries += 1
                self._pick_port()
                continue
            self.started_once = True
            return self
        raise AssertionError("unreachable")

    def _start_once(self) -> None:
        args = [
            self.server,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ]
        args += ["--dir", str(self.workdir), "--daemonize", "no", "--logfile", str(self.workdir / "log")]
        if self.password is not None:
            args += ["--requirepass", self.password]
        if self.tls is not None:
            ca, cert, key = self.tls
            args[2] = "0"  # no plain-text port
            args += ["--tls-port", str(self.port), "--tls-cert-file", cert, "--tls-key-file", key]
            args += [
                "--tls-ca-cert-file",
                ca,
                "--tls-auth-clients",
                "no" if self.tls_client is None else "yes",
            ]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", str(self.workdir / "nodes.conf")]
            args += ["--cluster-node-timeout", "2000", "--cluster-require-full-coverage", "no"]
            args += ["--cluster-allow-reads-when-down", "yes"]
        env = None if self.malloc_conf is None else {**os.environ, "MALLOC_CONF": self.malloc_conf}
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.proc = None
                log = (self.workdir / "log").read_text(errors="replace")[-2000:]
                error = _PortTaken if "Address already in use" in log else RuntimeError
                raise error(f"{self.server} on port {self.port} exited at start:\n{log}")
            try:
                if self.command("PING") == "PONG":
                    return
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(
            f"{self.server} on port {self.port} did not answer PING in {SERVER_START_TIMEOUT_S} s"
        )

    def command(self, *args: bytes | str) -> Any:
        ca = None if self.tls is None else self.tls[0]
        return command(self.port, *args, password=self.password, tls_ca_file=ca, tls_client=self.tls_client)

    def kill(self) -> None:
        """SIGKILL (a crash): nothing is saved."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
            self.proc = None

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class LocalCluster:
    """Three (or ``masters``) cluster-mode servers on loopback, formed with
    ``redis-cli --cluster create ... --cluster-replicas 0``; stopped by pid."""

    def __init__(self, workdir: str | Path, masters: int = 3) -> None:
        self.nodes = [LocalRedis(workdir, cluster=True) for _ in range(masters)]

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    def start(self) -> LocalCluster:
        try:
            for n in self.nodes:
                n.start()
            addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
            cli = self.nodes[0].cli
            subprocess.run(
                [cli, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                timeout=CLUSTER_FORM_TIMEOUT_S,
            )
            deadline = time.monotonic() + CLUSTER_FORM_TIMEOUT_S
            while time.monotonic() < deadline:
                infos = [n.command("CLUSTER", "INFO") for n in self.nodes]
                if all(isinstance(i, bytes) and b"cluster_state:ok" in i for i in infos):
                    return self
                time.sleep(0.1)
            raise RuntimeError(
                f"cluster on {addrs} did not reach cluster_state:ok in {CLUSTER_FORM_TIMEOUT_S} s"
            )
        except BaseException:
            self.stop()
            raise

    def node_for(self, name: bytes) -> LocalRedis:
        """The master serving key ``name``."""
        slot = self.nodes[0].command("CLUSTER", "KEYSLOT", name)
        for n in self.nodes:
            for start, end, master, *_ in n.command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    port = int(master[1])
                    return next(x for x in self.nodes if x.port == port)
        raise RuntimeError(f"no master serves slot {slot}")

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
