"""Prefill/decode disaggregation (docs/ROUTER.md, "Prefill/decode disaggregation"): what the
router sends a prefill engine, how it chooses the decode engine, and how engines whose KV
lives in kvcm-agents (the kvcm vLLM connector) are ranked by their agents' pages.

A P/D request goes to a prefill engine (kv_producer) with `max_tokens: 1`; when that answer
is back, the engine's connector has stored the prompt's whole pages into its agent. The
original request then goes to a decode engine (kv_consumer), which loads those pages from
its own agent: decode engines on the prefill engine's agent come first.
Use from one event loop; nothing here is thread-safe.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Mapping, Optional, Sequence

from kvcm.router.load import LoadTracker
from kvcm.router.policy import (
    Decision,
    ImbalanceGuard,
    LeastLoadedPolicy,
    PrefixIndex,
    RoutingRequest,
    cacheable_tokens,
)
from kvcm.types import RankedAgent, RouteCandidate

# Sampling fields that make no sense with a single output token (min_tokens > 1 is refused
# by vLLM with max_tokens 1) or that would only repeat work the decode engine does.
_DROPPED_FOR_PREFILL = ("stream_options", "min_tokens", "best_of")


def prefill_body(body: Dict[str, Any], chat: bool) -> Dict[str, Any]:
    """The request a prefill engine gets: the same prompt and fields, one output token, one
    choice, not streamed. Chat uses max_completion_tokens (vLLM prefers it to max_tokens)."""
    out = copy.deepcopy(body)
    for key in _DROPPED_FOR_PREFILL:
        out.pop(key, None)
    out["stream"] = False
    out["n"] = 1
    if chat:
        out.pop("max_tokens", None)
        out["max_completion_tokens"] = 1
    else:
        out["max_tokens"] = 1
    return out


def agent_of(engine_agents: Mapping[str, str], engine_id: str) -> str:
    """The kvcm-agent holding an engine's KV; an engine not listed is its own agent (the
    bridge publishes an engine's cache as a pool named by the engine id)."""
    return engine_agents.get(engine_id, engine_id)


class AgentMappedIndex:
    """PrefixIndex over engines whose pages live in kvcm-agents: asks `index` once per
    distinct agent, then ranks each engine by its agent's cached pages (and the prefill they
    save) minus the engine's own queue wait, then by load, then candidate order."""

    def __init__(self, index: PrefixIndex, engine_agents: Mapping[str, str], *,
                 prefill_tokens_per_s: float) -> None:
        if prefill_tokens_per_s <= 0:
            raise ValueError("prefill_tokens_per_s: must be > 0")
        self._index = index
        self._engine_agents = dict(engine_agents)
        self._rate = prefill_tokens_per_s

    async def rank(self, request: RoutingRequest,
                   candidates: Sequence[RouteCandidate]) -> List[RankedAgent]:
        # One candidate per agent, carrying its least-loaded engine's load.
        agents: Dict[str, RouteCandidate] = {}
        for c in candidates:
            a = agent_of(self._engine_agents, c.agent_id)
            best = agents.get(a)
            if best is None or (c.load, c.queued_prefill_tokens) < (
                    best.load, best.queued_prefill_tokens):
                agents[a] = RouteCandidate(a, load=c.load,
                                           queued_prefill_tokens=c.queued_prefill_tokens)
        by_agent = {r.agent_id: r for r in await self._index.rank(request,
                                                                   list(agents.values()))}
        out = []
        for c in candidates:
            r = by_agent.get(agent_of(self._engine_agents, c.agent_id))
            queue_ms = c.queued_prefill_tokens / self._rate * 1000.0
            if r is None:
                out.append(RankedAgent(c.agent_id, 0, 0, 0, 0.0, 0.0, 0.0, c.load, queue_ms))
            else:
                out.append(RankedAgent(c.agent_id, r.cached_pages, r.fetch_pages,
                                       r.recompute_pages, r.transfer_ms, r.saved_prefill_ms,
                                       r.link_gbps, c.load, queue_ms))
        position = {c.agent_id: i for i, c in enumerate(candidates)}
        out.sort(key=lambda r: (-(r.saved_prefill_ms - r.queue_ms), r.load,
                                position[r.agent_id]))
        return out


class DecodePolicy:
    """P/D decode engine: among the engines on the agent that holds the prompt's KV
    (`request.kv_agent`, the prefill engine's), the least loaded one the imbalance guard
    accepts; otherwise (no such engine, all too loaded, or no prefill) the least loaded."""

    name = "pd-decode"

    def __init__(self, engine_agents: Mapping[str, str], *, block_size: int,
                 guard: Optional[ImbalanceGuard] = None) -> None:
        self._engine_agents = dict(engine_agents)
        self._block_size = block_size
        self._guard = guard or ImbalanceGuard(factor=-1)
        self._near_least = LeastLoadedPolicy()
        self._least = LeastLoadedPolicy()

    async def choose(self, request: RoutingRequest, engines: Sequence[str],
                     loads: LoadTracker) -> Decision:
        near = [e for e in engines
                if request.kv_agent is not None
                and agent_of(self._engine_agents, e) == request.kv_agent]
        # The decode engine loads every whole block before the last token from its agent.
        cached = cacheable_tokens(len(request.tokens), self._block_size)
        if near:
            least = min(loads.in_flight(e) for e in engines)
            e = self._near_least.pick(near, loads)
            if self._guard.accepts(loads.in_flight(e), least):
                return Decision(e, self.name, "policy", expected_cached_tokens=cached)
        e = self._least.pick(engines, loads)
        return Decision(e, self.name, "imbalance-guard" if near else "policy",
                        expected_cached_tokens=cached if e in near else 0)


__all__ = ["AgentMappedIndex", "DecodePolicy", "agent_of", "prefill_body"]
