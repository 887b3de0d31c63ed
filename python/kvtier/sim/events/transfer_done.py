"""A transfer's last byte lands: the link charges progress, drops it from its pool, re-shares the
bandwidth among the transfers left, and runs the transfer's callback (which may start a step,
land a load, or place offloaded blocks in a lower tier)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.sim.resources import Link, Transfer


def complete(link: Link, transfer: Transfer) -> None:
    link.advance()
    transfer.event = None
    link.pool_of(transfer).active.remove(transfer)
    transfer.remaining_s = 0.0
    link.reschedule()
    link.finish(transfer)
