"""A tuple of request views that says what changed since the tuple shown before it (issue 20).

A simulator keeps its swapped requests' views across steps and builds the tuple it shows anew only
when one of them changed; a policy that keeps state per shown request (RotaSched's rotary set,
:class:`~kvtier.sched.lvf.RotarySet`) would otherwise find out what changed by comparing the new
tuple with the last one, a pass over every swapped request (hundreds, on an overloaded engine) at
every step where one swap landed. A producer that knows what changed says so: ``base`` is the tuple
it built before this one, ``added`` the views of this one that are not in ``base`` and ``removed``
those of ``base`` that are not in this one, both by object (a view never changes; a request's new
state is a new view), each once.

Only the last link is kept (a producer drops a tuple's ``base`` once it builds the next one, so
that the tuples do not chain up), and a consumer reads the changes only where ``base`` is the very
tuple it saw last: a view it did not see (a decode fast-forward's) breaks the link, and it compares
the tuples instead. A plain tuple says nothing; either is a ``Sequence[RequestView]`` to every other
reader.
"""

from __future__ import annotations

from kvtier.sched.base import RequestView


class ShownViews(tuple[RequestView, ...]):
    """Views in a producer's order, with what changed since ``base`` (see the module doc)."""

    base: ShownViews | None = None  # the tuple built before this one (dropped once a newer one is)
    added: tuple[RequestView, ...] = ()  # in this one, not in ``base``
    removed: tuple[RequestView, ...] = ()  # in ``base``, not in this one
