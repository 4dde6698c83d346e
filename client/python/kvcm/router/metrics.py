"""The router's Prometheus metrics, prefix `kvcm_router_`, on a registry of their own.

Labels are bounded: engine (the configured ids), policy, reason, cause, code (HTTP status,
a transport failure class, redirect or too-large), endpoint.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Route decisions take microseconds (round-robin) to a manager round trip (kv-aware).
_ROUTE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                  0.25, 0.5, 1.0)


class RouterMetrics:
    """Thread-safe (prometheus_client's metrics are)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvcm_router_requests", "Requests routed, by chosen engine and policy",
            ["engine", "policy", "endpoint"], registry=r)
        self.decisions = Counter(
            "kvcm_router_decisions",
            "Routing decisions by why the engine was chosen: policy (its first choice), "
            "imbalance-guard (the guard skipped that one), fallback (no prefix index)",
            ["policy", "reason"], registry=r)
        self.upstream_errors = Counter(
            "kvcm_router_upstream_errors",
            "Engine answers that were errors (code: HTTP status) or no answer (code: "
            "connect, timeout, disconnect)", ["engine", "code"], registry=r)
        self.route_seconds = Histogram(
            "kvcm_router_route_seconds", "Time to choose an engine (the manager's Route "
            "included for kv-aware)", ["policy"], buckets=_ROUTE_BUCKETS, registry=r)
        self.in_flight = Gauge(
            "kvcm_router_in_flight_requests", "Requests sent to an engine and not answered",
            ["engine"], registry=r)
        self.queued_prefill_tokens = Gauge(
            "kvcm_router_queued_prefill_tokens",
            "Prompt tokens sent to an engine and not yet prefilled, less the expected "
            "cache hits", ["engine"], registry=r)
        self.prompt_tokens = Counter(
            "kvcm_router_prompt_tokens", "Prompt tokens routed to each engine (the router's "
            "tokenizer)", ["engine"], registry=r)
        self.expected_cached_tokens = Counter(
            "kvcm_router_expected_cached_tokens",
            "Prompt tokens the manager's Route expected the engine to hold (cached_pages)",
            ["engine"], registry=r)
        self.engine_cached_tokens = Counter(
            "kvcm_router_engine_cached_tokens",
            "Cached prompt tokens the engines reported (usage.prompt_tokens_details."
            "cached_tokens)", ["engine"], registry=r)
        self.manager_fallbacks = Counter(
            "kvcm_router_manager_fallbacks",
            "kv-aware requests routed least-loaded because the manager could not rank them",
            ["cause"], registry=r)
        self.pd_prefill_fallbacks = Counter(
            "kvcm_router_pd_prefill_fallbacks",
            "P/D requests sent to a decode engine without their prefill, which failed "
            "(cause: HTTP status, or connect, timeout, disconnect)", ["cause"], registry=r)
        self.client_refusals = Counter(
            "kvcm_router_client_refusals",
            "Client requests refused by the tokens file (reason: missing, malformed, "
            "unknown: 401; role, tenant: 403)", ["reason"], registry=r)
        self.engine_up = Gauge(
            "kvcm_router_engine_up", "1 while the engine is not avoided after a failure",
            ["engine"], registry=r)

    def init_engines(self, engine_ids: list[str]) -> None:
        """Exports every engine's series from the start (zero), so dashboards see them."""
        for e in engine_ids:
            self.in_flight.labels(e)
            self.queued_prefill_tokens.labels(e)
            self.prompt_tokens.labels(e)
            self.expected_cached_tokens.labels(e)
            self.engine_cached_tokens.labels(e)


__all__ = ["RouterMetrics"]
