"""A request as the simulator and the workloads see it.

``block_keys`` identify the prompt's KV blocks in order (``block_tokens`` tokens each, the run's
cache block size); equal leading keys mean an equal prefix, so equal KV. They cover
``ceil(prompt_tokens / block_tokens)`` blocks: the last may be partial, and a workload gives a
partial tail a key of its own unless it is shared by construction (the Mooncake trace's
``hash_ids`` follow the same rule).

``finish_keys`` (optional) key every full block of the prompt followed by the output.

Open-loop requests arrive at ``arrival_s``. A closed-loop request (the next turn of a chat, the next
step of an agent) names ``parent_id``: it arrives ``think_time_s`` after its parent finishes, and
``arrival_s`` is ignored until then.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.errors import SimError


@dataclass(slots=True)
class Request:
    req_id: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    block_keys: tuple[int, ...]
    session_id: int = -1
    parent_id: int | None = None
    think_time_s: float = 0.0
    # Keys of every full block of prompt + output, when the workload knows its outputs' tokens (a
    # replay of a real run): the finished request leaves them in the device prefix cache, as a real
    # engine does, so a next turn that re-sends the reply hits it. Empty: only prompt blocks are.
    finish_keys: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1:
            raise SimError(f"request {self.req_id}: prompt_tokens is {self.prompt_tokens}; expected >= 1")
        if self.output_tokens < 1:
            raise SimError(f"request {self.req_id}: output_tokens is {self.output_tokens}; expected >= 1")
        if self.arrival_s < 0 or self.think_time_s < 0:
            raise SimError(f"request {self.req_id}: negative arrival or think time")
