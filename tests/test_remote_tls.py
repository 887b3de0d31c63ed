"""The remote tier over TLS (``rediss://``) against a loopback redis-server serving TLS only, with
a throw-away CA made by ``openssl``: round trip, mutual TLS, and certificate problems as clear
errors at start."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import kvtier
from kvtier.errors import ConfigError
from kvtier.testing.redis import LocalRedis

GEOMETRY = kvtier.Geometry(2, 2, 8, "fp16", 4)
TOKENS = np.arange(64, dtype=np.uint32)

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_ca(d: Path, name: str) -> tuple[str, str]:
    key, crt = d / f"{name}.key", d / f"{name}.crt"
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(crt),
        "-days", "2", "-subj", f"/CN={name}",
    )  # fmt: skip
    return str(crt), str(key)


def make_cert(d: Path, name: str, ca: tuple[str, str], san: str) -> tuple[str, str]:
    key, csr, crt, ext = (d / f"{name}.{x}" for x in ("key", "csr", "crt", "ext"))
    ext.write_text(f"subjectAltName={san}\n")
    _openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}"
    )
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", ca[0], "-CAkey", ca[1], "-CAcreateserial",
        "-out", str(crt), "-days", "2", "-extfile", str(ext),
    )  # fmt: skip
    return str(crt), str(key)


@pytest.fixture
def certs(tmp_path: Path) -> dict[str, str]:
    d = tmp_path / "certs"
    d.mkdir()
    ca = make_ca(d, "ca")
    other_ca = make_ca(d, "other-ca")
    server = make_cert(d, "server", ca, "IP:127.0.0.1,DNS:localhost")
    client = make_cert(d, "client", ca, "DNS:kvtier-client")
    return {
        "ca": ca[0],
        "other_ca": other_ca[0],
        "server_crt": server[0],
        "server_key": server[1],
        "client_crt": client[0],
        "client_key": client[1],
    }


@pytest.fixture
def tls_server(tmp_path: Path, certs: dict[str, str]) -> Iterator[LocalRedis]:
    with LocalRedis(tmp_path, tls=(certs["ca"], certs["server_crt"], certs["server_key"])) as server:
        yield server


def config(url: str, **remote: object) -> kvtier.StoreConfig:
    """A store on ``url``; ``remote`` are further keys of its remote section (``tls_ca_file``, ...)."""
    return kvtier.StoreConfig(
        geometry=GEOMETRY,
        model_id="tls-test",
        dram=kvtier.DramConfig(capacity_bytes=64 * 4096),
        remote={"urls": url, **remote},
    )


def test_round_trip_over_tls(tls_server: LocalRedis, certs: dict[str, str]) -> None:
    assert tls_server.url.startswith("rediss://")
    writer = kvtier.Store(config(tls_server.url, tls_ca_file=certs["ca"]))
    keys = writer.namespace.block_keys(TOKENS)
    data = np.random.default_rng(0).integers(0, 256, (len(keys), GEOMETRY.block_bytes), dtype=np.uint8)
    assert writer.put(keys, data).stored == len(keys)
    assert tls_server.command("DBSIZE") == len(keys)
    reader = kvtier.Store(config(tls_server.url, tls_ca_file=certs["ca"]))
    with reader.lease(keys) as lease:
        out = np.zeros_like(data)
        assert lease.tiers == ("remote",) * len(keys)
        assert reader.load(lease, out).loaded_blocks == len(keys)
    assert np.array_equal(out, data)


def test_untrusted_certificate_is_an_error_at_start(tls_server: LocalRedis, certs: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="TLS handshake failed"):
        kvtier.Store(config(tls_server.url, tls_ca_file=certs["other_ca"]))
    with pytest.raises(ConfigError, match="TLS handshake failed"):
        kvtier.Store(config(tls_server.url))  # built-in public roots do not include the test CA
    with pytest.raises(ConfigError, match="TLS handshake failed"):
        kvtier.Store(config(tls_server.url, tls_ca_file=certs["ca"], tls_server_name="wrong.example"))


def test_mutual_tls(tmp_path: Path, certs: dict[str, str]) -> None:
    files = (certs["ca"], certs["server_crt"], certs["server_key"])
    with LocalRedis(
        tmp_path / "mtls", tls=files, tls_client=(certs["client_crt"], certs["client_key"])
    ) as server:
        c = config(
            server.url,
            tls_ca_file=certs["ca"],
            tls_cert_file=certs["client_crt"],
            tls_key_file=certs["client_key"],
        )
        store = kvtier.Store(c)
        keys = store.namespace.block_keys(TOKENS)
        assert store.put(keys, np.zeros((len(keys), GEOMETRY.block_bytes), dtype=np.uint8)).stored == len(
            keys
        )
        assert store.stats().remote_written == len(keys)


def test_tls_settings_errors(tmp_path: Path, certs: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="rediss"):
        kvtier.Store(config("redis://127.0.0.1:1", tls_ca_file=certs["ca"]))
    with pytest.raises(ConfigError, match="cannot be read"):
        kvtier.Store(config("rediss://127.0.0.1:1", tls_ca_file=str(tmp_path / "missing.pem")))
    with pytest.raises(ConfigError, match="go together"):
        kvtier.Store(config("rediss://127.0.0.1:1", tls_cert_file=certs["client_crt"]))
