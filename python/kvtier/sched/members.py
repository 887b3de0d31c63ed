"""Enum members as module constants, for the code that reads them per request.

:mod:`kvtier.sim.compiled` compiles this module with the simulator's hot modules: a ``Final`` name
of a compiled module is a C static wherever compiled code reads it, where ``Phase.RUNNING`` calls
through Python 3.11's ``EnumType.__getattr__`` hook on every read (~850 instructions; 3.8% of a
``composed`` replay's, by callgrind). They are the enums' own members (``RUNNING is
Phase.RUNNING``), so interpreted code may use either spelling.
"""

from __future__ import annotations

from typing import Final

from kvtier.sched.base import LoadMode, Phase
from kvtier.tiers import Tier

WAITING: Final = Phase.WAITING
FETCHING: Final = Phase.FETCHING
RUNNING: Final = Phase.RUNNING
SWAPPED: Final = Phase.SWAPPED

DEVICE: Final = Tier.DEVICE
HOST: Final = Tier.HOST
SSD: Final = Tier.SSD
REMOTE: Final = Tier.REMOTE

SYNC: Final = LoadMode.SYNC
ASYNC: Final = LoadMode.ASYNC
LAYERWISE: Final = LoadMode.LAYERWISE
