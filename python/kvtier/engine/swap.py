"""Host slots for swapped-out requests' KV in the reference engine (:class:`HostSwap`), copied by a
:class:`kvtier.transfer.DuplexEngine` (SuperInfer's DuplexKV §4.3.2).

The slots are ``BlockFirst`` objects in one host array. A step's swap-outs and swap-ins are one
batched transfer per direction, the two running at once, finished before the step's forward pass
(:meth:`HostSwap.end_step`); a swap-in into blocks a swap-out of the same step just freed waits for
that copy's read (the DuplexEngine's ordering). KV is append-only, so a swapped-in request's full
blocks stay synced with their slots: those slots are kept, and its next swap-out copies only the
blocks written since. Eager rotation copies running requests' newly full blocks to free slots in
the background while a step computes, so that a swap-out moves only the dirty tail.

Every slot is in exactly one place: held by a swapped request, kept by a running one, free, or being
read by this step's swap-ins (:meth:`HostSwap.check_integrity`).
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence

import numpy as np

from kvtier.engine.errors import EngineError
from kvtier.engine.request import EngineRequest
from kvtier.geometry import Geometry
from kvtier.sched.base import Phase
from kvtier.transfer import DuplexEngine


class HostSwap:
    def __init__(self, geometry: Geometry, pool: np.ndarray, num_slots: int) -> None:
        self.num_slots = num_slots
        self.geometry = geometry
        self.swapped: dict[int, list[int]] = {}  # req_id -> the host slots holding its blocks
        self.duplex: DuplexEngine | None = None
        if num_slots:
            self.host_slots = np.zeros((num_slots, geometry.block_bytes), dtype=np.uint8)
            steps = max(num_slots, 1 << 16)  # a step may move every slot each way
            self.duplex = DuplexEngine(geometry, pool, self.host_slots, step_blocks_max=steps)
        self._free = list(range(num_slots))[::-1]
        self._to_free: list[int] = []  # read by this step's swap-ins: free after the transfer
        # Blocks marked written or queued for copy-out in this step's swap-outs (or its rotations).
        self._step_out_blocks: set[int] = set()
        # req_id -> host slots still holding a swapped-in running request's first full blocks.
        self._synced: dict[int, list[int]] = {}
        self._rotating = False  # eager rotations submitted and not yet waited for

    def used_blocks(self) -> int:
        """Host slots held by swapped-out requests (slots kept by running ones are reclaimable)."""
        return sum(len(slots) for slots in self.swapped.values())

    def forget(self, req_id: int) -> None:
        """``req_id`` leaves the device: the slots it kept synced are free again."""
        self._free.extend(self._synced.pop(req_id, []))

    def copy_out(self, r: EngineRequest) -> int | None:
        """Queues a copy of the running ``r``'s blocks into host slots, which it then holds;
        returns the blocks copied (a block still synced with its slot moves nothing), or None if the
        slots cannot take it (the caller preempts it by recompute instead)."""
        held = -(-r.num_computed // self.geometry.block_tokens)
        synced = self._synced.pop(r.req_id, [])  # slots of r.table[:len(synced)], full since swap-in
        need = held - len(synced)
        if self.duplex is not None and need > len(self._free):
            self._drop_synced()  # others' reservations go before a recompute
        if self.duplex is None or need > len(self._free):
            self._free.extend(synced)
            return None
        slots = synced + [self._free.pop() for _ in range(need)]
        copied = 0
        try:
            for i, (block, slot) in enumerate(zip(r.table[:held], slots, strict=True)):
                if i >= len(synced) and block not in self._step_out_blocks:
                    # Written by the forward passes since any copy of it (the engine does not report
                    # each write): its host copy, if any, is stale. Once per step: a prefix block
                    # two swapped requests share is marked once, each gets its own copy.
                    self.duplex.write(block)
                    self._step_out_blocks.add(block)
                if self.duplex.swap_out(block, slot):
                    self._step_out_blocks.add(block)
                    copied += 1
        except Exception:
            self._free.extend(reversed(slots))  # the engine's own bug: keep the accounting
            raise
        self.swapped[r.req_id] = slots
        return copied

    def copy_in(self, r: EngineRequest, blocks: Sequence[int]) -> None:
        """Queues the copy of the swapped ``r``'s slots into device ``blocks`` (one per slot)."""
        slots = self.swapped.pop(r.req_id)
        assert self.duplex is not None  # a request is swapped only with host slots
        for slot, block in zip(slots, blocks, strict=True):
            self.duplex.swap_in(slot, block)
        # The full blocks stay synced with their slots (kept for the next swap-out); the partial
        # tail block will change, so its slot is freed once the copy has read it.
        full = r.num_computed // self.geometry.block_tokens
        self._synced[r.req_id] = slots[:full]
        self._to_free.extend(slots[full:])

    def end_step(self) -> None:
        """Submits the step's swap-outs and swap-ins (one batched transfer each, run at once) and
        waits for both: the forward pass reads swapped-in blocks and may write freed ones."""
        if self.duplex is None:
            return
        out, into = self.duplex.submit_step()
        if out is not None or into is not None:
            self.duplex.wait_all()
        self._free.extend(reversed(self._to_free))
        self._to_free.clear()
        self._step_out_blocks.clear()

    def rotate(self, running: Sequence[EngineRequest], loading: Container[int]) -> int:
        """Eager rotation: queues a background copy of every running request's full blocks that no
        host slot holds yet, into free slots, and submits them without waiting: they run during the
        step's forward pass, which only reads full blocks (it writes the tail block and new ones).
        Requests in ``loading`` are skipped (their blocks are still being written). Waited for at
        the next step's start (:meth:`rotations_done`). Returns the blocks rotated."""
        if self.duplex is None:
            return 0
        rotated = 0
        for r in running:
            if r.req_id in loading:
                continue
            kept = self._synced.setdefault(r.req_id, [])
            for block in r.table[len(kept) : r.num_computed // self.geometry.block_tokens]:
                if not self._free:
                    break
                if block not in self._step_out_blocks:  # a shared prefix block: marked once
                    self.duplex.write(block)  # holds KV the duplex engine has not seen copied
                    self._step_out_blocks.add(block)
                slot = self._free.pop()
                self.duplex.rotate(block, slot)
                kept.append(slot)
                rotated += 1
        self._step_out_blocks.clear()
        if rotated:
            self.duplex.submit_step()
            self._rotating = True
        return rotated

    def rotations_done(self) -> None:
        """Waits for the previous step's rotations: blocks may be freed, reused or swapped now."""
        if self._rotating:
            assert self.duplex is not None
            self.duplex.wait_all()
            self._rotating = False

    def _drop_synced(self) -> None:
        """Frees every running request's kept slots (their next swap-out copies everything): a
        swap-out that needs the room comes first. A reused slot's old blocks stop being synced
        (the DuplexEngine marks them dirty when the slot is written)."""
        for slots in self._synced.values():
            self._free.extend(slots)
        self._synced.clear()

    def check_integrity(self, requests: Mapping[int, EngineRequest]) -> None:
        """Raises :class:`EngineError` unless every slot is in exactly one place."""
        held = [slot for slots in self.swapped.values() for slot in slots]
        kept = [slot for slots in self._synced.values() for slot in slots]
        slots = held + kept + self._free + self._to_free
        if sorted(slots) != list(range(self.num_slots)):
            raise EngineError(
                f"host slots: {len(held)} held by swapped requests, {len(kept)} kept by running ones, "
                f"{len(self._free)} free, {len(self._to_free)} being read; expected each "
                f"of {self.num_slots} once"
            )
        for rid, kept_slots in self._synced.items():
            keeper = requests.get(rid)
            if keeper is None or keeper.phase is not Phase.RUNNING or len(kept_slots) > len(keeper.table):
                raise EngineError(
                    f"request {rid} keeps {len(kept_slots)} host slots but is not running with them"
                )
