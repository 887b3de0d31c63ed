"""Per-request records of a replay, for checking that a simulator speedup changes no decision.

:func:`fingerprint` replays the bench's Mooncake trace (the first ``requests`` requests, one
overloaded H100) under a policy and returns its finished requests' records in finish order — arrival,
first token, finish, hit tokens per tier, worst token gap, matched blocks — with the step and
preemption counts; :func:`digest` hashes them exactly (``repr`` of every float). The committed
fixture ``tests/fixtures/sim_records.json`` holds what the code before issue 20's data-structure
change printed (``python tests/sim_records.py``); ``rotasched`` and ``composed`` were re-recorded
when a budget left out became the node's own B_xfer (kvtier.sim.xfer) instead of 2400 blocks of
any size."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from kvtier.bench.sim import config
from kvtier.sim.compiled import running_build
from kvtier.sim.metrics import RequestRecord
from kvtier.sim.run import build, replay, workload

FIXTURE = Path(__file__).parent / "fixtures" / "sim_records.json"
REQUESTS = 320
#: Every per-engine policy that runs on the bench's config with its defaults (dualpath has its own
#: P/D simulator, outside this change).
POLICIES = (
    "fcfs",
    "lmcache",
    "hicache",
    "strata",
    "strata_sched",
    "strata_io",
    "shadowserve_async",
    "cachegen_async",
    "rotasched",
    "waiting_first",
    "swapped_first",
    "lmcache_lp",
    "lmcache_lp_async",
    "unified_pool",
    "composed",
)


def fingerprint(policy: str, requests: int = REQUESTS) -> dict[str, Any]:
    cfg = config(requests, policy)
    sim = build(cfg)
    finished: list[RequestRecord] = []
    sim.metrics.records = finished  # kept by Metrics itself: nothing patched (a compiled build's is native)
    sim.cluster.feed(workload(cfg))
    replay(sim, cfg.max_sim_s)  # raises where the replay stalls (kvtier.sim.stall)
    records: list[list[Any]] = [
        [r.arrival_s, r.first_token_s, r.finish_s, list(r.hit_tokens), r.max_tbt_s, r.matched_blocks]
        for r in finished
    ]
    return {
        "requests": len(records),
        "steps": sim.metrics.steps,
        "preemptions": sim.metrics.preemptions,
        "events": sim.loop.events_run,
        "digest": digest(records),
        "first": [[repr(x) for x in rec[:3]] for rec in records[:5]],
    }


def digest(records: list[list[Any]]) -> str:
    return hashlib.sha256(repr(records).encode()).hexdigest()


if __name__ == "__main__" and sys.argv[1:2] == ["--print"]:
    # The records of the policies named (all without names) as one JSON line, and the simulator
    # build they came from: tests/test_sim_compiled.py runs this in the compiled copy's process.
    names = sys.argv[2:] or list(POLICIES)
    print(json.dumps({"build": running_build(), "records": {p: fingerprint(p) for p in names}}))
elif __name__ == "__main__":  # policies named: only theirs are re-recorded, the others kept
    out = json.loads(FIXTURE.read_text()) if sys.argv[1:] else {}
    out.update({p: fingerprint(p) for p in (sys.argv[1:] or POLICIES)})
    FIXTURE.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
