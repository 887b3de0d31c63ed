"""Exceptions raised by the reference engine. Every one is a :class:`kvtier.KvtierError`."""

from __future__ import annotations

from kvtier.errors import KvtierError


class EngineError(KvtierError):
    """Base class of the engine's errors."""


class ModelNotInstalledError(EngineError, ImportError):
    """The package that ships the model's weights is not installed; the message says how to install it."""


class ModelFormatError(EngineError, ValueError):
    """The weights file is not a model this engine can run (architecture, shapes, tensor types)."""


class EngineInputError(EngineError, ValueError):
    """Bad input to the model or a KV cache: token ids, positions, lengths, block tables."""
