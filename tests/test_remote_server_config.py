"""The loopback server's allocator settings reach the server (issue 19: 4 MiB GETs on redis-server
fault in a fresh reply buffer each time unless jemalloc keeps freed pages)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.testing.redis import LARGE_VALUE_MALLOC_CONF, LocalRedis


def malloc_stats(server: LocalRedis) -> str:
    stats = server.command("MEMORY", "MALLOC-STATS")
    text = stats.decode() if isinstance(stats, bytes) else str(stats)
    if "opt.muzzy_decay_ms" not in text:
        pytest.skip(f"{server.server} does not report jemalloc's options")
    return text


def test_malloc_conf_is_passed_to_the_server_only_when_asked(tmp_path: Path) -> None:
    assert LARGE_VALUE_MALLOC_CONF == "muzzy_decay_ms:-1"
    with LocalRedis(tmp_path, malloc_conf=LARGE_VALUE_MALLOC_CONF) as server:
        assert "opt.muzzy_decay_ms: -1" in malloc_stats(server)
    with LocalRedis(tmp_path) as server:
        assert "opt.muzzy_decay_ms: -1" not in malloc_stats(server)
