"""A cluster's shape: engines grouped by node, and the NICs between them (DualPath §4, §6.1).

:meth:`Topology.from_config` builds it from a :class:`SimConfig`'s ``prefill_engines`` /
``decode_engines`` (GPUs, one engine per GPU, §4) and the hardware profile: ``gpus_per_node`` packs
the GPUs into nodes, each node is one engine group (all prefill or all decode engines, §6.1).

Resources, per node and per GPU (hardware profile numbers):

- one **storage NIC** per node (``storage_nic_bytes_per_s`` x GPUs per node; 400 Gbps on DualPath's
  testbed, §7.2) in front of a **disk read queue** (:meth:`Node.read`): reads wait FIFO and at most
  :data:`READ_WINDOW` run at once; the queue's length in tokens is what engines report (``q``).
- one **compute NIC** per GPU (``compute_nic_bytes_per_s`` per direction): every byte in or out of a
  GPU crosses it (§5.2, CNIC-assisted H2D/D2H).

Links are :class:`~kvtier.sim.resources.Link`\\ s, strictly prioritised (traffic classes, §5.1).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.errors import ConfigError
from kvtier.sched.placement import Role
from kvtier.sim.config import SimConfig
from kvtier.sim.core import EventLoop
from kvtier.sim.hardware import HardwareProfile
from kvtier.sim.resources import Direction, Link, Transfer

READ_WINDOW = 1  # storage reads in flight per storage NIC: FIFO at the NIC's rate; the rest queue


@dataclass(eq=False)
class Node:
    """One node: its storage NIC and the disk read queue in front of it."""

    index: int
    snic: Link
    reads: deque[tuple[int, int, int, int, Callable[[], None]]] = field(default_factory=deque)
    reads_in_flight: int = 0
    read_queue_tokens: int = 0  # queued + in flight (the §6.1 ``q``)

    def read(self, tokens: int, nbytes: int, segment: int, priority: int, landed: Callable[[], None]) -> None:
        """Queues a storage read of ``tokens`` (``nbytes``, in objects of ``segment`` bytes) into
        the node's buffer; ``landed()`` when it is in."""
        self.read_queue_tokens += tokens
        self.reads.append((tokens, nbytes, segment, priority, landed))
        self._next_read()

    def _next_read(self) -> None:
        while self.reads and self.reads_in_flight < READ_WINDOW:
            tokens, nbytes, segment, priority, landed = self.reads.popleft()
            self.reads_in_flight += 1

            def done(_t: Transfer, tokens: int = tokens, landed: Callable[[], None] = landed) -> None:
                self.reads_in_flight -= 1
                self.read_queue_tokens -= tokens
                landed()
                self._next_read()

            self.snic.submit(nbytes, Direction.IN, done, segment, priority)


@dataclass(eq=False)
class EngineSlot:
    """One engine (one GPU): its id, its node and its compute NIC."""

    engine_id: int
    node: Node
    cnic: Link


@dataclass(eq=False)
class Group:
    """The engines of one node, all of one role."""

    index: int  # within its role
    role: Role
    engines: list[EngineSlot]


@dataclass(eq=False)
class Topology:
    groups: dict[Role, list[Group]]
    links: dict[str, Link]
    gpus_per_node: int

    @classmethod
    def from_config(cls, config: SimConfig, hw: HardwareProfile, loop: EventLoop) -> Topology:
        if not config.disaggregated:
            raise ConfigError("a node-group cluster needs `prefill_engines` and `decode_engines` (GPUs)")
        g = hw.gpus_per_node
        for what, n in (
            ("prefill_engines", config.prefill_engines),
            ("decode_engines", config.decode_engines),
        ):
            if n % g:
                raise ConfigError(f"`{what}` is {n}; expected a multiple of {g} GPUs per node")
        snic_bw = hw.storage_nic_bytes_per_s * g
        cnic_bw = hw.compute_nic_bytes_per_s
        if snic_bw <= 0 or cnic_bw <= 0:
            raise ConfigError(f"a node-group cluster needs storage and compute NICs; {hw.name!r} lacks one")
        links: dict[str, Link] = {}
        groups: dict[Role, list[Group]] = {}
        node_index = 0
        for role, prefix, gpus in (
            (Role.PREFILL, "p", config.prefill_engines),
            (Role.DECODE, "d", config.decode_engines),
        ):
            groups[role] = []
            for n in range(gpus // g):
                name = f"{prefix}{n}"
                node = Node(node_index, Link(loop, f"{name}.snic", snic_bw, snic_bw))
                node_index += 1
                links[node.snic.name] = node.snic
                engines = []
                for i in range(g):
                    cnic = Link(loop, f"{name}.gpu{i}.cnic", cnic_bw, cnic_bw)
                    links[cnic.name] = cnic
                    engines.append(EngineSlot(len(links), node, cnic))  # ids as links are made
                groups[role].append(Group(n, role, engines))
        return cls(groups, links, g)

    def engines(self, role: Role) -> list[EngineSlot]:
        return [e for group in self.groups[role] for e in group.engines]

    def storage_nics(self) -> list[Link]:
        """One per node, prefill nodes first."""
        return [
            group.engines[0].node.snic for role in (Role.PREFILL, Role.DECODE) for group in self.groups[role]
        ]
