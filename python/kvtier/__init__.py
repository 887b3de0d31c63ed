"""kvtier: a hierarchical, distributed KV-cache layer for LLM serving.

Public API::

    from kvtier import Geometry, StoreConfig, Store, KvtierError
    from kvtier import keys, layout
"""

from kvtier import errors, keys, layout, objects
from kvtier._core import __version__
from kvtier.config import DramConfig, RemoteConfig, SsdConfig, StoreConfig
from kvtier.errors import KvtierError
from kvtier.geometry import ExtraGroup, Geometry
from kvtier.keys import BlockKeys, Namespace, block_keys
from kvtier.store import Lease, LoadReport, Lookup, PutReport, Store, StoreStats, TierWrites
from kvtier.transfer import DuplexEngine, TransferConfig, TransferEngine

__all__ = [
    "BlockKeys",
    "DramConfig",
    "DuplexEngine",
    "ExtraGroup",
    "Geometry",
    "KvtierError",
    "Lease",
    "LoadReport",
    "Lookup",
    "Namespace",
    "PutReport",
    "RemoteConfig",
    "SsdConfig",
    "Store",
    "StoreConfig",
    "StoreStats",
    "TierWrites",
    "TransferConfig",
    "TransferEngine",
    "__version__",
    "block_keys",
    "errors",
    "keys",
    "layout",
    "objects",
]
