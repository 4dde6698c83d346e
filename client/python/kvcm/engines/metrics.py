"""Prometheus metrics of kvcm-bridge (`--metrics_address`), per engine. The prefix stays
kvcm_vllm_bridge_ for every engine kind, so dashboards made before SGLang keep working.

The collector reads each EngineBridge's `metrics` snapshot (rebuilt by its loop about once a
second), so a scrape never touches state the loop is changing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

P = "kvcm_vllm_bridge_"


class _HasMetrics(Protocol):
    id: str
    metrics: dict[str, Any]


# (name, help, path in the snapshot)
_COUNTERS = [
    ("batches", "Event batches applied", ("stream", "batches")),
    ("gaps", "Sequence gaps seen on the live stream", ("stream", "gaps")),
    ("replays", "Replay requests sent to the engine (probes included)", ("stream", "replays")),
    ("probes", "Liveness probes sent", ("stream", "probes")),
    ("replay_timeouts", "Replay requests left unanswered", ("stream", "replay_timeouts")),
    ("replay_holes", "Replays that skipped batches, asked again", ("stream", "replay_holes")),
    ("resyncs", "Full resyncs (mirror rebuilt from the engine's buffer)", ("stream", "resyncs")),
    ("restarts", "Publisher restarts or reconnects detected", ("stream", "restarts")),
    ("bad_payloads", "Batches that did not decode", ("stream", "bad_payloads")),
    ("lost_batches", "Batches nothing could bring back", ("stream", "lost_batches")),
    ("stale_batches", "Live batches ahead of everything the engine holds, dropped",
     ("stream", "stale_batches")),
    ("ignored_batches", "Batches of another data-parallel rank", ("ignored_batches",)),
    ("foreign_batches", "Bind mode: batches from a publisher connection other than the "
     "engine's, refused", ("foreign_batches",)),
    ("loop_failures", "Bridge loops restarted after an unexpected error", ("failures",)),
    ("blocks_stored", "Blocks stored by the engine's events", ("mirror", "blocks_stored")),
    ("blocks_removed", "Blocks removed by the engine's events", ("mirror", "blocks_removed")),
    ("unknown_removals", "Removals of blocks the mirror did not hold",
     ("mirror", "unknown_removals")),
    ("conflicts", "Known block hashes stored again with other content", ("mirror", "conflicts")),
    ("restored_blocks", "BlockStored of blocks already held (report mode): not new copies",
     ("mirror", "restored_blocks")),
    ("shared_pages", "Pages two or more held vLLM blocks map to", ("mirror", "shared_pages")),
    ("unkeyed_blocks", "Blocks of a release that publishes no extra keys (vLLM < 0.17)",
     ("mirror", "unkeyed_blocks")),
    ("bad_frames", "Messages in none of vLLM's frame forms", ("bad_frames",)),
    ("publish_requests", "PublishEngineEvents requests that succeeded", ("session", "requests")),
    ("heartbeats", "Empty PublishEngineEvents requests", ("session", "heartbeats")),
    ("sessions", "Sessions started with the manager", ("session", "sessions")),
    ("manager_stored_pages", "Page-locations the manager added", ("session", "stored_pages")),
    ("manager_removed_pages", "Page-locations the manager removed",
     ("session", "removed_pages")),
    ("truncated_chains", "Chains cut at the manager's pages-per-request limit",
     ("session", "truncated_chains")),
    ("dropped_changes", "Changes dropped (outbox overflow, too long)",
     ("session", "dropped_changes")),
]
_GAUGES = [
    ("up", "1 while the engine answers", ("up",)),
    ("synced", "1 while a session with the manager is open", ("synced",)),
    ("orphan_blocks", "Blocks whose chain to a prompt start is unknown", ("mirror", "orphans")),
    ("known_blocks", "Blocks whose content the mirror knows", ("mirror", "known_blocks")),
    ("outbox_pages", "Pages waiting to be published", ("outbox_pages",)),
]
# (name, help, path, label)
_LABELLED_COUNTERS = [
    ("events", "Events applied, by type", ("mirror", "events"), "type"),
    ("refused_blocks", "Blocks refused, by reason", ("mirror", "refused_blocks"), "reason"),
    ("ignored_events", "Events ignored, by reason", ("mirror", "ignored_events"), "reason"),
    ("ignored_fields", "Event fields that do not change what a block holds, by name",
     ("mirror", "ignored_fields"), "field"),
    ("unknown_fields", "Event fields this bridge does not know, by name",
     ("mirror", "unknown_fields"), "field"),
    ("publish_errors", "Failed manager calls, by gRPC code", ("session", "errors"), "code"),
]
_LABELLED_GAUGES = [
    ("held_blocks", "Blocks the engine holds, by tier", ("mirror", "held_blocks"), "tier"),
    ("visible_pages", "Pages published to the manager, by tier", ("mirror", "visible_pages"),
     "tier"),
]


def _get(snap: dict[str, Any], path: Sequence[str]) -> Any:
    v: Any = snap
    for k in path:
        if not isinstance(v, dict) or k not in v:
            return None
        v = v[k]
    return v


class BridgeCollector(Collector):
    def __init__(self, engines: Sequence[_HasMetrics]):
        self._engines = engines

    def collect(self) -> Iterable[Any]:
        snaps = [(e.id, e.metrics) for e in self._engines]
        for name, doc, path in _COUNTERS:
            m = CounterMetricFamily(P + name, doc, labels=["engine"])
            for eid, s in snaps:
                v = _get(s, path)
                if v is not None:
                    m.add_metric([eid], v)
            yield m
        for name, doc, path in _GAUGES:
            g = GaugeMetricFamily(P + name, doc, labels=["engine"])
            for eid, s in snaps:
                v = _get(s, path)
                if v is not None:
                    g.add_metric([eid], v)
            yield g
        for family, table in ((CounterMetricFamily, _LABELLED_COUNTERS),
                              (GaugeMetricFamily, _LABELLED_GAUGES)):
            for name, doc, path, label in table:
                f = family(P + name, doc, labels=["engine", label])
                for eid, s in snaps:
                    for k, v in (_get(s, path) or {}).items():
                        f.add_metric([eid, str(k)], v)
                yield f


def registry_for(engines: Sequence[_HasMetrics]) -> CollectorRegistry:
    reg = CollectorRegistry()
    reg.register(BridgeCollector(engines))
    return reg


def serve_metrics(engines: Sequence[_HasMetrics], address: str, port: int) -> None:
    """Serves /metrics from a daemon thread."""
    start_http_server(port, addr=address, registry=registry_for(engines))
