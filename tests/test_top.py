"""`kvtier top` (kvtier.top): the real CLI reads a real store's metrics endpoint while the store
serves traffic, and shows its tiers, hit rate and bandwidth."""

from __future__ import annotations

import contextlib
import http.server
import io
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier import DramConfig, SsdConfig, Store, StoreConfig, layout, top
from kvtier.cli import main
from kvtier.errors import KvtierError
from kvtier.geometry import Geometry
from kvtier.metrics import namespace_label
from kvtier.testing.redis import free_port
from kvtier.testing.traffic import store_traffic
from kvtier.transfer import TransferEngine

GEOMETRY = Geometry(num_layers=2, num_kv_heads=2, head_dim=64, dtype="fp16", block_tokens=16)


def test_top_once_shows_tiers_hit_rate_and_bandwidth_of_a_busy_store(tmp_path: Path) -> None:
    (tmp_path / "ssd").mkdir()
    store = None
    for _ in range(5):  # the picked port may be taken before the store binds it
        port = free_port()
        try:
            store = Store(
                StoreConfig(
                    geometry=GEOMETRY, model_id="top", dram=DramConfig(capacity_bytes="4MiB"),
                    ssd=SsdConfig(directory=str(tmp_path / "ssd"), capacity_bytes="16MiB", write_through=True,
                                  probe_bytes=0),
                    metrics_port=port,
                )
            )  # fmt: skip
            break
        except Exception as e:
            if "cannot serve metrics" not in str(e):
                raise
    assert store is not None
    stop = threading.Event()
    engine, pool = TransferEngine(store), layout.alloc_pool(GEOMETRY, 4)
    worker = threading.Thread(target=store_traffic, args=(store, engine, pool, stop))
    worker.start()
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        proc = subprocess.run(
            [sys.executable, "-m", "kvtier.cli", "top", url, "--once", "--interval", "1"],
            capture_output=True, text=True, timeout=60, env={"COLUMNS": "160", "PATH": "/usr/bin:/bin"},
        )  # fmt: skip
    finally:
        stop.set()
        worker.join()
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    ns = namespace_label(store)
    assert "kvtier stores" in text and ns in text, text
    dram = next(line for line in text.splitlines() if ns in line and "dram" in line)
    cells = [c.strip() for c in dram.split("│")[1:-1]]
    assert cells[:2] == [ns, "dram"], cells
    # Each round leases 4 stored blocks (hits) and looks up 4 others (misses); a scrape may cut a
    # round in two, so the rate over the second is 50% give or take a round.
    assert cells[4].endswith("%") and 40 <= int(cells[4][:-1]) <= 60, cells
    assert cells[5].endswith("/s") and not cells[5].startswith("0 B"), cells  # put bandwidth
    assert cells[6].endswith("/s") and not cells[6].startswith("0 B"), cells  # loaded bandwidth
    assert "SSD devices" in text and "ssd" in text
    assert "transfer engines" in text, text
    for stage in ("read", "scatter"):
        row = next(line for line in text.splitlines() if ns in line and f" {stage} " in line and "/s" in line)
        cells = [c.strip() for c in row.split("│")[1:-1]]
        assert cells[1] == stage and int(cells[2]) >= 1 and not cells[4].startswith("0 B"), cells


def test_top_names_the_url_it_cannot_read() -> None:
    url = f"http://127.0.0.1:{free_port()}/metrics"
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "top", url, "--once", "--interval", "0.1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert url in proc.stderr and "metrics_port" in proc.stderr


@contextlib.contextmanager
def http_server(body: bytes | list[bytes | None]) -> Iterator[str]:
    """A loopback HTTP server answering every GET with `body` (a list: with its first item as it is
    then, None answering 503); yields its base URL."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            answer = body[0] if isinstance(body, list) else body
            if answer is None:
                self.send_error(503, "restarting")
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: object) -> None:
            pass

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler) as server:
        thread = threading.Thread(target=server.serve_forever)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}"
        finally:
            server.shutdown()
            thread.join()


@contextlib.contextmanager
def tcp_server(reply: bytes) -> Iterator[str]:
    """A loopback TCP server that answers one connection with `reply` (not HTTP) and closes it."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()

        def answer() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.recv(4096)
                conn.sendall(reply)

        thread = threading.Thread(target=answer)
        thread.start()
        try:
            yield f"http://127.0.0.1:{listener.getsockname()[1]}"
        finally:
            thread.join(timeout=10)


def top_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    rc = main(["top", *args])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize(
    "url", ["localhost", "127.0.0.1:9464/metrics", "file:///etc/hostname", "http://[::1", "http:///metrics"]
)
def test_top_refuses_a_url_that_is_no_http_url(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = top_cli(capsys, url, "--once", "--interval", "0.1")
    assert rc == 2 and f"metrics URL {url!r} is not an http(s) URL with a host" in err, err


@pytest.mark.parametrize("interval", ["0", "-1", "nan", "inf", "1e300"])
def test_top_refuses_an_interval_it_cannot_sleep(interval: str, capsys: pytest.CaptureFixture[str]) -> None:
    with http_server(b"kvtier_x 1\n") as base:  # a live endpoint: it would scrape, then sleep
        rc, err = top_cli(capsys, f"{base}/metrics", "--once", "--interval", interval)
    assert rc == 2 and f"--interval is {float(interval)}; expected seconds in (0, 3600]" in err, err


@pytest.mark.parametrize("body", [b"<html>not metrics</html>\n", b"\xff\xfe\x00", b'kvtier_x{a="1"} many\n'])
def test_top_names_an_endpoint_that_does_not_answer_with_metrics(
    body: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    with http_server(body) as base:
        rc, err = top_cli(capsys, f"{base}/metrics", "--once", "--interval", "0.1")
    assert rc == 2 and f"{base}/metrics did not answer with Prometheus metrics" in err, err


def test_top_names_a_server_that_does_not_speak_http(capsys: pytest.CaptureFixture[str]) -> None:
    with tcp_server(b"-ERR unknown command\r\n") as base:  # a Redis port, say
        rc, err = top_cli(capsys, f"{base}/metrics", "--once", "--interval", "0.1")
    assert rc == 2 and f"cannot read metrics from {base}/metrics" in err, err


def test_top_stops_reading_an_answer_past_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(top, "SCRAPE_BYTES_MAX", 1024)
    with http_server(b"kvtier_x 1\n" * 1000) as base, pytest.raises(KvtierError, match="over 1024 bytes"):
        top.scrape(f"{base}/metrics")


def test_a_counter_that_went_back_was_reset_and_counts_whole() -> None:
    old = {("kvtier_store_put_bytes_total", (("namespace", "a"),)): 1000.0}
    new = {("kvtier_store_put_bytes_total", (("namespace", "a"),)): 300.0}
    assert top._rate(new, old, "kvtier_store_put_bytes_total", 2.0, "namespace") == {("a",): 150.0}
    assert top._rate(old, new, "kvtier_store_put_bytes_total", 2.0, "namespace") == {("a",): 350.0}


def test_the_live_view_keeps_its_tables_while_a_scrape_fails_and_resumes_after() -> None:
    # A store restarting, or a blip, used to end `kvtier top` with the scrape's error.
    from rich.console import Console

    def shown(view: list[object]) -> str:
        console = Console(width=200, record=True, file=io.StringIO())
        for part in view:
            console.print(part)
        return console.export_text()

    counter = "# TYPE kvtier_store_put_bytes_total counter\n"
    line = 'kvtier_store_put_bytes_total{namespace="ns",tier="dram"} %d\n'
    body: list[bytes | None] = [f"{counter}{line % 0}".encode()]  # None: the endpoint fails
    with http_server(body) as base:
        url = f"{base}/metrics"
        view = top.LiveView(url, 0.5, top.scrape(url), time.monotonic())
        body[0] = f"{counter}{line % 2**20}".encode()
        before = shown(view.refresh())
        body[0] = None
        failed = shown(view.refresh())
        body[0] = f"{counter}{line % (3 * 2**20)}".encode()
        after = shown(view.refresh())
    assert "kvtier stores" in before and "ns" in before, before
    assert before.strip() in failed, failed  # the last tables stay
    assert url in failed and "503" in failed and "retrying every 0.5 s" in failed, failed
    assert "kvtier stores" in after and url not in after, after
