"""The connector's counters on vLLM's own metrics path (`KVConnectorStats`, `KVConnectorPromMetrics`).

vLLM calls the worker connector's `get_kv_connector_stats()` after every step and ships the result
to its front end (another process unless `VLLM_ENABLE_V1_MULTIPROCESSING=0`); tensor-parallel
workers' stats are merged with `aggregate`, and the front end's Prometheus logger passes the
merged payload to `KvtierPromMetrics.observe`, which adds it to counters labelled like vLLM's own
(model name, engine index). vLLM serves them on its `/metrics` (with `PROMETHEUS_MULTIPROC_DIR`
when the API server runs several processes) and in `LLM.get_metrics()`. The payload is the counter
growth since the previous step (`stats.delta`), so nothing is counted twice and a counter only
rises. Names and help texts: `stats.COUNTERS`, listed in docs/metrics.md.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvtier.integrations.vllm.stats import COUNTERS, metric_name


class KvtierConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """Counter growth over one or more steps (and workers): `{counter: amount}`."""

    def reset(self) -> None:
        self.data: dict[str, float] = {}

    def is_empty(self) -> bool:
        return not self.data

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, amount in other.data.items():
            self.data[name] = self.data.get(name, 0) + amount
        return self

    def reduce(self) -> dict[str, int | float]:
        """For vLLM's periodic log line ("KV Transfer metrics: ...")."""
        return {name: round(v, 4) if isinstance(v, float) else v for name, v in sorted(self.data.items())}


class KvtierPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """One Prometheus counter per `stats.COUNTERS` entry, per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name, help_text in COUNTERS.items():
            family = self._counter_cls(name=metric_name(name), documentation=help_text, labelnames=labelnames)
            self._counters[name] = {
                idx: family.labels(*values) for idx, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        per_engine = {name: c[engine_idx] for name, c in self._counters.items() if engine_idx in c}
        for name, amount in transfer_stats_data.items():
            counter = per_engine.get(name)
            if counter is not None and amount > 0:
                counter.inc(amount)
