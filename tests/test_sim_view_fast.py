"""The simulator's fast RequestView constructor builds what the dataclass builds."""

from __future__ import annotations

import dataclasses

import pytest

from kvtier.sched.base import Phase, RequestView
from kvtier.sim.request import Request
from kvtier.sim.state import SimRequest
from kvtier.sim.view import _view
from kvtier.tiers import PerTier


def test_fast_view_equals_the_dataclass_field_for_field() -> None:
    args = (7, 1.5, Phase.SWAPPED, 1000, 512, 3, PerTier(512, 0, 256, 0), 128, 64, (1, 2, 3))
    r = SimRequest(
        Request(7, 1.5, 1000, 8, (1, 2, 3)), Phase.SWAPPED, computed_tokens=512, generated_tokens=3
    )
    fast, slow = _view(r, PerTier(512, 0, 256, 0), 128, 64), RequestView(*args)
    assert fast == slow and hash(fast) == hash(slow)
    assert dataclasses.astuple(fast) == args
    assert fast.loadable_tokens == 256 and fast.remaining_prefill_tokens == 488
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.generated_tokens = 4  # type: ignore[misc]
    assert fast != RequestView(*args[:5], 4, *args[6:])
