"""`Router`: a policy, the engines' load and the metrics, behind route / prefill_done /
finish / failed. The HTTP front (kvcm.router.server) and the trace replay
(bench/router_replay.py) drive the same object. Use from one event loop.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from kvcm.router.load import LoadTracker, Ticket
from kvcm.router.metrics import RouterMetrics
from kvcm.router.policy import (
    ConsistentHashPolicy,
    Decision,
    ImbalanceGuard,
    KvAwarePolicy,
    LeastLoadedPolicy,
    POLICIES,
    Policy,
    PrefixIndex,
    RoundRobinPolicy,
    RoutingRequest,
)

log = logging.getLogger(__name__)


def make_policy(name: str, engine_ids: Sequence[str], *, page_size: int, block_size: int,
                guard: ImbalanceGuard, index: Optional[PrefixIndex] = None,
                hash_prefix_pages: int = 1) -> Policy:
    """The policy called `name` (POLICIES); kv-aware needs `index`."""
    if name == "kv-aware":
        if index is None:
            raise ValueError("policy kv-aware: needs the manager (a prefix index)")
        return KvAwarePolicy(index, page_size=page_size, block_size=block_size, guard=guard)
    if name == "round-robin":
        return RoundRobinPolicy()
    if name == "least-loaded":
        return LeastLoadedPolicy()
    if name == "consistent-hash":
        return ConsistentHashPolicy(engine_ids, page_size, prefix_pages=hash_prefix_pages,
                                    guard=guard)
    raise ValueError(f"policy: {name!r} is not one of {', '.join(POLICIES)}")


@dataclass
class Routed:
    decision: Decision
    ticket: Ticket


class Router:
    """Chooses engines and accounts for what it sent them."""

    def __init__(self, policy: Policy, loads: LoadTracker,
                 metrics: Optional[RouterMetrics] = None,
                 engine_ids: Optional[Sequence[str]] = None) -> None:
        """Routes among `engine_ids` (default: all of `loads`'); several Routers may share
        one LoadTracker and metrics, each over its own engines (P/D: prefill, decode)."""
        self.policy = policy
        self.loads = loads
        self.metrics = metrics
        self.engine_ids = list(loads.engine_ids if engine_ids is None else engine_ids)
        if metrics is not None:
            metrics.init_engines(self.engine_ids)
            for e in self.engine_ids:
                metrics.engine_up.labels(e).set_function(self._up_function(e))
        self._last_fallback_log = float("-inf")

    def _up_function(self, engine_id: str) -> Callable[[], float]:
        return lambda: 1.0 if self.loads.is_up(engine_id) else 0.0

    async def route(self, request: RoutingRequest, endpoint: str = "") -> Routed:
        """Chooses an engine among the available ones and counts the request on it."""
        start = time.perf_counter()
        decision = await self.policy.choose(request, self.loads.available(self.engine_ids),
                                            self.loads)
        elapsed = time.perf_counter() - start
        ticket = self.loads.begin(decision.engine_id, len(request.tokens),
                                  decision.expected_cached_tokens)
        if decision.reason == "fallback":
            now = time.monotonic()
            if now - self._last_fallback_log > 10.0:  # at most one line per 10 s
                self._last_fallback_log = now
                log.warning("kv-aware: manager could not rank a request (%s); routing "
                            "least-loaded", decision.fallback_cause)
        m = self.metrics
        if m is not None:
            e = decision.engine_id
            m.route_seconds.labels(decision.policy).observe(elapsed)
            m.requests.labels(e, decision.policy, endpoint).inc()
            m.decisions.labels(decision.policy, decision.reason).inc()
            if decision.reason == "fallback":
                m.manager_fallbacks.labels(decision.fallback_cause).inc()
            m.prompt_tokens.labels(e).inc(len(request.tokens))
            m.expected_cached_tokens.labels(e).inc(decision.expected_cached_tokens)
            self._export(e)
        return Routed(decision, ticket)

    def prefill_done(self, ticket: Ticket) -> None:
        self.loads.prefill_done(ticket)
        self._export(ticket.engine_id)

    def finish(self, ticket: Ticket, cached_tokens: Optional[int] = None) -> None:
        """The engine answered; `cached_tokens` as its usage reported them, when it did."""
        self.loads.end(ticket)
        self.loads.mark_up(ticket.engine_id)
        if self.metrics is not None and cached_tokens is not None:
            self.metrics.engine_cached_tokens.labels(ticket.engine_id).inc(cached_tokens)
        self._export(ticket.engine_id)

    def failed(self, ticket: Ticket, code: str, *, engine_down: bool) -> float:
        """The request failed with `code`; an engine that did not answer is avoided for a
        while (returned, seconds; 0 when not marked down)."""
        self.loads.end(ticket)
        down_s = self.loads.mark_down(ticket.engine_id) if engine_down else 0.0
        if self.metrics is not None:
            self.metrics.upstream_errors.labels(ticket.engine_id, code).inc()
        self._export(ticket.engine_id)
        return down_s

    def abandon(self, ticket: Ticket) -> None:
        """The client went away before the answer: the request no longer counts."""
        self.loads.end(ticket)
        self._export(ticket.engine_id)

    def _export(self, engine_id: str) -> None:
        m = self.metrics
        if m is None:
            return
        m.in_flight.labels(engine_id).set(self.loads.in_flight(engine_id))
        m.queued_prefill_tokens.labels(engine_id).set(self.loads.queued_prefill_tokens(engine_id))


__all__ = ["Routed", "Router", "make_policy"]
