"""Hardening (issue 15, defect 10): a codec payload's header is untrusted. A decoded length no
KV block can have (2^40, 2^64 - 1) is a :class:`kvtier.errors.KvtierError` naming it, raised
before anything is allocated for it: not a MemoryError, not a bare ValueError."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier import codec
from kvtier.errors import KvtierError


@pytest.mark.parametrize("claim", [2**40, 2**64 - 1, 2**30 + 1])
@pytest.mark.parametrize("name", ["lossless"])
def test_defect10_a_header_claiming_an_absurd_length_is_refused(name: str, claim: int) -> None:
    block = np.arange(4096, dtype=np.uint16).view(np.uint8)
    payload = bytearray(codec.encode(block, name))
    payload[8:16] = claim.to_bytes(8, "little")
    for call in (lambda: codec.decoded_len(payload, name), lambda: codec.decode(payload, name)):
        with pytest.raises(KvtierError, match="decoded length") as info:
            call()
        assert not isinstance(info.value, MemoryError)
        assert str(claim) in str(info.value)
