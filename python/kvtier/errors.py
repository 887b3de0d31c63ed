"""Exceptions raised by kvtier. Every one is a :class:`KvtierError`.

A cache miss is never an exception: it is a normal result (``Lookup.hit_blocks == 0``). Errors are
for misuse (wrong shapes, wrong geometry, bad config) and failures the caller must see. Messages
name the wrong value and the expected one. The Rust extension raises these same classes.
"""

from __future__ import annotations

from collections.abc import Iterable


class KvtierError(Exception):
    """Base class of every kvtier error."""


class ConfigError(KvtierError, ValueError):
    """A configuration value or key is wrong."""


class GeometryError(KvtierError, ValueError):
    """A KV geometry cannot describe a cache (zero sizes, unknown dtype, too large)."""


class KeyHashError(KvtierError, ValueError):
    """Bad input to block-key hashing (token ids out of range, zero block size)."""


class LayoutError(KvtierError, ValueError):
    """Bad buffers or block tables given to gather/scatter."""


class BufferError(LayoutError):
    """A buffer has the wrong size, dtype, shape, contiguity or writability."""


class NamespaceError(KvtierError, ValueError):
    """Keys or objects belong to another namespace (model, geometry, tenant, rank) than the store."""


class LeaseError(KvtierError):
    """A lease is unknown, expired, exhausted or asked for more blocks than it holds."""


class ObjectFormatError(KvtierError, ValueError):
    """Bytes are not a valid kvtier object (magic, version, length or checksum)."""


class StoreError(KvtierError):
    """A store operation failed for a reason the caller must see."""


class IntegrityError(KvtierError):
    """An internal invariant does not hold (found by ``check_integrity``)."""


class SimError(KvtierError, ValueError):
    """A simulation cannot run as configured (e.g. a tier too small to hold one request)."""


class TraceError(KvtierError, ValueError):
    """A trace file is missing or malformed; the message names the file and line."""


def shown(value: object, limit: int = 64) -> str:
    """``repr(value)`` for an error message, shortened past ``limit`` characters; a huge int is
    described by its size (messages echo user values, which may be enormous)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 4 * limit:
        return f"an int of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def did_you_mean(names: Iterable[object], known: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` naming the known name closest to each misspelt one of ``names``
    that has one (difflib's ratio >= 0.6), for an unknown-name message; ``""`` where none is close."""
    import difflib  # only when a message is built: `import kvtier` stays light

    known = list(known)
    close = [
        match[0]
        for name in names
        if isinstance(name, str) and (match := difflib.get_close_matches(name, known, n=1))
    ]
    return f" (did you mean {', '.join(map(repr, close))}?)" if close else ""


def os_error_message(e: OSError) -> str:
    """``<path>: <reason>`` for an OSError (the path the user named, and why it failed)."""
    if e.strerror is None:
        return str(e)
    paths = [str(p) for p in (e.filename, e.filename2) if p is not None]
    return f"{' -> '.join(paths)}: {e.strerror}" if paths else e.strerror
