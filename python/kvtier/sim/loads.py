"""Loads of cached KV in the simulated engine (one seam of :mod:`kvtier.sim.engine`): the paths a
load takes (:class:`LoadPaths`, with the load-time estimates offered to policies) and a policy's
load orders on the engine's requests (:class:`LoadOrders`).

A load brings the blocks right after a request's device prefix, each from the fastest tier holding
it, into device blocks reserved for it before it starts. It rides on a prefill chunk (sync or
layerwise: the step ends once it landed, see :mod:`kvtier.sim.events.step_end`), or runs on its own
while the request waits in the fetching queue (async); a prefetch brings a waiting request's SSD and
remote blocks up into host memory only. Loaded blocks land in the prefix index, locked for their
request, unless it was preempted meanwhile (its ``epoch`` moved on): they are then cached, unlocked.

Blocks below host cross two or more stages — the SSD or remote link, the decoder of a compressed
fetch (the engine's fetch path, data-plane config: ``EngineConfig.fetch``), the host link — modelled as a pipeline (Unified KV pooling §IV, ShadowServe §4.2): every
stage runs concurrently on its own resource, so the slowest sets the time, and concurrent fetches
share each stage. With a device pool (:mod:`kvtier.sim.pool`) every block read from host memory or
staged through it also crosses the pool device holding the host tier (``host_store_link``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

from kvtier.radix import HiRadixTree
from kvtier.sched.base import LoadMode, LoadOrder
from kvtier.sched.fetch_path import PLAIN_FETCH, FetchPath
from kvtier.sched.load_path import PLAIN_LOAD, LoadPath
from kvtier.sched.members import ASYNC, DEVICE, FETCHING, HOST, LAYERWISE, REMOTE, RUNNING, SSD
from kvtier.sim.core import EventKind, EventLoop
from kvtier.sim.cost import CostModel, engine_kv_bytes_per_token
from kvtier.sim.events.step_end import Step
from kvtier.sim.owner import SeamOwner
from kvtier.sim.resources import Direction, Link, StripedLink, Transfer
from kvtier.sim.state import SimRequest
from kvtier.sim.tiers import LowerTiers
from kvtier.tiers import Tier


class LoadPaths:
    def __init__(
        self,
        loop: EventLoop,
        name: str,
        host_link: Link,
        host_store_link: Link | StripedLink | None,
        tiers: LowerTiers,
        block_tokens: int,
        cost: CostModel,
        fetch: FetchPath = PLAIN_FETCH,
        load: LoadPath = PLAIN_LOAD,
        tp: int = 1,
    ) -> None:
        self._loop = loop
        self._name = name
        self._host_link = host_link
        self._host_store_link = host_store_link
        self._tiers = tiers
        self._block_tokens = block_tokens
        # The engine's tp GPUs load their parts of each block side by side (links tp wide, a
        # decoder stage each): the bytes are all of theirs, a decoder's duty one GPU's part.
        self._tp = tp
        self._gpu_kv_bytes_per_token = cost.kv_bytes_per_token
        self._kv_bytes_per_token = engine_kv_bytes_per_token(cost, tp)
        self._num_layers = cost.num_layers
        self._block_bytes = block_tokens * self._kv_bytes_per_token
        self.interference: list[float] = []  # compute slowdowns of the loads running now
        self._decoders: dict[float, Link] = {}
        self._fetch = fetch  # the path of compressed loads (the sim config's `fetch` section)
        self._load = load  # the copies over the host link (the sim config's `load` section)

    def start(self, load: LoadOrder, blocks: list[tuple[int, Tier]], done: Callable[[], None]) -> None:
        """Moves ``blocks`` to the device (or host, for a prefetch), each from its tier; ``done``
        runs when all have landed."""
        by_tier: dict[Tier, int] = {}
        for _, tier in blocks:
            by_tier[tier] = by_tier.get(tier, 0) + 1
        segment = self.segment_bytes(load)
        to_device = load.target is DEVICE
        bb = self._block_bytes
        fetch = self._fetch if load.compressed else PLAIN_FETCH
        ratio = fetch.compression_ratio
        decoder = fetch.decoder_bytes_per_s()
        legs: list[tuple[Link | StripedLink, int, int]] = []
        for tier, count in by_tier.items():
            raw = count * bb
            packed = max(1, int(raw / ratio))
            if tier in (SSD, REMOTE) and tier in self._tiers:
                legs.append((self._tiers.link(tier), packed, bb))
                if decoder is not None:
                    legs.append((self._decoder(decoder), raw, bb))
            if to_device:
                host_bytes = packed if fetch.decode_on_device else raw
                legs.append((self._host_link, host_bytes, segment))
        if self._host_store_link is not None and blocks:  # read from, or staged through, host memory
            staged = max(1, int(len(blocks) * bb / ratio))
            legs.append((self._host_store_link, staged, bb))
        if not legs:
            self._loop.after(0.0, EventKind.TRANSFER_DONE, done)
            return
        pending = [len(legs)]
        slowdown = self.slowdown(load, blocks)
        if slowdown > 0:
            self.interference.append(slowdown)

        def leg_done(_t: Transfer) -> None:
            pending[0] -= 1
            if pending[0] == 0:
                if slowdown > 0:
                    self.interference.remove(slowdown)
                done()

        for link, nbytes, seg in legs:
            link.submit(nbytes, Direction.IN, leg_done, seg, load.priority)

    def _decoder(self, bytes_per_s: float) -> Link:
        """The engine's decompression stage (SmartNIC or host cores; each GPU's, ``tp`` side by side),
        one per throughput setting."""
        link = self._decoders.get(bytes_per_s)
        if link is None:
            rate = bytes_per_s * self._tp
            link = Link(self._loop, f"{self._name}.decoder", rate, rate)
            self._decoders[bytes_per_s] = link
        return link

    def slowdown(self, load: LoadOrder, blocks: list[tuple[int, Tier]]) -> float:
        """How much ``load`` of ``blocks`` slows the model's compute while it runs: its load path's
        copies (to the device only), or a compressed fetch's decoder, whichever is more."""
        decoder = self._fetch_interference(load, blocks) if load.compressed else 0.0
        if load.target is not DEVICE:
            return decoder
        return max(decoder, self._load.slowdown(load.mode))

    def _fetch_interference(self, load: LoadOrder, blocks: list[tuple[int, Tier]]) -> float:
        """The fetch path's slowdown of a compressed fetch of ``load.tokens``: its ``interference``,
        scaled where the path says by the decoder's duty cycle over the fetch from the slowest
        tier the blocks come from (on idle links, as the policies' estimates)."""
        tier = max((t for _, t in blocks), default=HOST)
        return self._fetch.fetch_interference(
            self._gpu_kv_bytes_per_token,
            load.tokens,
            lambda: self.estimate_s(load.tokens, tier, ASYNC),
        )

    def segment_bytes(self, load: LoadOrder) -> int:
        """Bytes per copy over the host link, on the engine's load path: a page (or the load's
        tokens) of one layer's K or V, one layer of a block (layerwise), or whole blocks."""
        per_token_layer = self._kv_bytes_per_token / self._num_layers
        segment_tokens = self._load.segment_tokens(load.mode, load.tokens)
        if segment_tokens is not None:  # per layer, K and V separately
            return max(1, int(segment_tokens * per_token_layer / 2))
        if load.mode is LAYERWISE:  # one layer of one block
            return max(1, int(self._block_tokens * per_token_layer))
        return self._block_bytes

    def estimate_s(self, tokens: int, tier: Tier, mode: LoadMode) -> float:
        """The policy's estimate of loading ``tokens`` from ``tier`` on idle links."""
        nbytes = math.ceil(tokens / self._block_tokens) * self._block_bytes
        order = LoadOrder(-1, tokens, mode)
        seconds = self._host_link.work_s(nbytes, self.segment_bytes(order), Direction.IN)
        if tier in (SSD, REMOTE) and tier in self._tiers:
            seconds = max(seconds, self._tiers.link(tier).work_s(nbytes, self._block_bytes, Direction.IN))
        if self._host_store_link is not None and tier is not DEVICE:
            seconds = max(seconds, self._host_store_link.work_s(nbytes, self._block_bytes, Direction.IN))
        return seconds


class LoadOwner(SeamOwner, Protocol):
    """What load orders read and call of the engine that owns them."""

    reserved_blocks: int  # device blocks set aside for loads in flight, all requests together
    tree: HiRadixTree
    fetching: dict[int, SimRequest]

    def admit(self, r: SimRequest) -> None: ...
    def extend_lock(self, r: SimRequest, end: int) -> None: ...


class LoadOrders:
    def __init__(self, owner: LoadOwner, paths: LoadPaths, block_tokens: int) -> None:
        self._owner = owner
        self._paths = paths
        self._block_tokens = block_tokens

    def _loadable_blocks(self, r: SimRequest, tokens: int) -> list[tuple[int, Tier]]:
        """The blocks right after the device prefix that hold ``tokens`` cached tokens, with tiers."""
        m = self._owner.tree.match(r.keys)
        start = r.locked_blocks
        blocks = math.ceil(tokens / self._block_tokens)
        picked = [(r.keys[i], m.tiers[i]) for i in range(start, min(start + blocks, len(m.tiers)))]
        return [(k, t) for k, t in picked if t is not DEVICE] if picked else []

    def plan_step_load(self, step: Step, r: SimRequest, load: LoadOrder) -> int:
        """Adds a load that rides on ``r``'s prefill chunk to ``step``; the tokens it brings."""
        tokens = min(load.tokens, r.prompt_tokens - 1 - r.computed_tokens)
        blocks = self._loadable_blocks(r, tokens)
        if not blocks:
            return 0
        tokens = min(tokens, len(blocks) * self._block_tokens)
        if not self._reserve(r, len(blocks)):
            return 0
        step.add_load(r, load, blocks, tokens)
        return tokens

    def _reserve(self, r: SimRequest, blocks: int) -> bool:
        if not self._owner.make_room(blocks):
            return False
        r.reserved_blocks += blocks
        self._owner.reserved_blocks += blocks
        return True

    def prefetch(self, r: SimRequest, load: LoadOrder) -> None:
        """Brings a waiting request's SSD/remote blocks up into host memory (no device blocks)."""
        owner = self._owner
        if r.prefetching:  # one is in flight already
            return
        m = owner.tree.match(r.keys)
        limit = min(len(m.tiers), math.ceil(load.tokens / self._block_tokens) + m.prefix_in(HOST))
        blocks = [(r.keys[i], m.tiers[i]) for i in range(limit) if m.tiers[i] in (SSD, REMOTE)]
        if not blocks or HOST not in owner.lower_tiers:
            return
        r.prefetching = True
        path = r.keys[:limit]

        def landed() -> None:
            r.prefetching = False
            owner.lower_tiers.place(path, HOST)
            owner.kick()

        self._paths.start(load, blocks, landed)

    def land(self, r: SimRequest, start_block: int, blocks: list[tuple[int, Tier]], epoch: int) -> bool:
        """Loaded blocks become device-resident, locked for ``r``; their reservation is released.

        Returns False if ``r`` was preempted meanwhile: the blocks are then cached, unlocked.
        """
        owner = self._owner
        end = start_block + len(blocks)
        path = r.keys[:end]
        if epoch != r.epoch:  # preempted meanwhile: its reservation is gone; the bytes are dropped
            return False
        assert r.locked_blocks == start_block, "a request's lock grew while its load was in flight"
        owner.tree.insert(path, DEVICE, owner.loop.now_s)
        owner.extend_lock(r, end)
        r.reserved_blocks -= len(blocks)
        owner.reserved_blocks -= len(blocks)
        for _, tier in blocks:
            r.hit_tokens[tier] += self._block_tokens
        return True

    def fetch(self, r: SimRequest, load: LoadOrder) -> None:
        """An asynchronous fetch: the request leaves the batch until its prefix has landed."""
        owner = self._owner
        if not r.admitted:
            owner.admit(r)
        tokens = min(load.tokens, r.prompt_tokens - 1 - r.computed_tokens)
        blocks = self._loadable_blocks(r, tokens)
        if not blocks or not self._reserve(r, len(blocks)):
            return
        owner.running.remove(r)
        r.phase = FETCHING
        owner.fetching[r.req_id] = r
        start, epoch = r.locked_blocks, r.epoch
        tokens = min(tokens, len(blocks) * self._block_tokens)

        def landed() -> None:
            if not self.land(r, start, blocks, epoch):
                return
            r.computed_tokens = min(r.computed_tokens + tokens, r.prompt_tokens - 1)
            del owner.fetching[r.req_id]
            r.phase = RUNNING
            owner.running.append(r)
            owner.kick()

        self._paths.start(load, blocks, landed)
