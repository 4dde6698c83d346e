"""Routing policies: which engine serves a request (docs/ROUTER.md, "Policies").

- `kv-aware`: the manager's Route (probe) over the engines, ranked by the prefill each saves
  (the leading pages its cache holds) minus the wait for the prefill the router already sent
  it; falls back to least-loaded when the manager cannot answer.
- `round-robin`, `least-loaded`: cache-blind baselines.
- `consistent-hash`: the prompt's first page(s) on a hash ring of engines, the usual
  cache-affinity baseline.

The affinity policies (kv-aware, consistent-hash) pass an `ImbalanceGuard`: an engine whose
in-flight count is too far above the least-loaded engine's is skipped for the next one in
the policy's own order, so one hot prefix cannot pin every request to one replica.
Policies are used from one event loop; none is thread-safe.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import struct
from dataclasses import dataclass
from typing import Dict, List, Optional, Protocol, Sequence, Tuple

from kvcm.router.load import LoadTracker
from kvcm.types import RankedAgent, RouteCandidate

log = logging.getLogger(__name__)

POLICIES = ("kv-aware", "round-robin", "consistent-hash", "least-loaded")


@dataclass(frozen=True)
class RoutingRequest:
    """What the policies see of a request: its prompt's token ids and the keys vLLM mixes
    into its block hashes."""

    tokens: Sequence[int]
    lora_name: Optional[str] = None
    cache_salt: Optional[str] = None
    # False when the engine hashes inputs the router cannot see (images): no prefix match.
    hashable: bool = True
    # P/D decode: the kvcm-agent known to hold the prompt's KV (the prefill engine's).
    kv_agent: Optional[str] = None


@dataclass(frozen=True)
class Decision:
    engine_id: str
    policy: str
    # "policy": the policy's first choice; "imbalance-guard": the guard skipped that one;
    # "fallback": the manager could not answer (kv-aware only).
    reason: str
    # Prompt tokens the chosen engine is expected to find in its prefix cache.
    expected_cached_tokens: int = 0
    # Why the fallback happened (a short class: "unavailable", "deadline", "no-key", ...).
    fallback_cause: str = ""


@dataclass(frozen=True)
class ImbalanceGuard:
    """An engine is acceptable while in_flight <= factor * least in_flight + margin.
    factor < 0 disables the guard."""

    factor: float = 2.0
    margin: int = 4

    def accepts(self, in_flight: int, least_in_flight: int) -> bool:
        if self.factor < 0:
            return True
        return in_flight <= self.factor * least_in_flight + self.margin

    def validate(self) -> None:
        if self.margin < 0:
            raise ValueError(f"imbalance_margin: must be >= 0, got {self.margin}")


class Policy(Protocol):
    name: str

    async def choose(self, request: RoutingRequest, engines: Sequence[str],
                     loads: LoadTracker) -> Decision:
        """An engine of `engines` (non-empty, the available ones in configuration order)."""
        ...


class RoundRobinPolicy:
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    async def choose(self, request: RoutingRequest, engines: Sequence[str],
                     loads: LoadTracker) -> Decision:
        engine = engines[self._next % len(engines)]
        self._next += 1
        return Decision(engine, self.name, "policy")


class LeastLoadedPolicy:
    """Fewest requests in flight, then fewest queued prefill tokens; ties rotate, so idle
    engines share the work."""

    name = "least-loaded"

    def __init__(self) -> None:
        self._next = 0

    def pick(self, engines: Sequence[str], loads: LoadTracker) -> str:
        n = len(engines)
        order = [engines[(self._next + i) % n] for i in range(n)]
        best = min(order, key=lambda e: (loads.in_flight(e), loads.queued_prefill_tokens(e)))
        self._next = (engines.index(best) + 1) % n
        return best

    async def choose(self, request: RoutingRequest, engines: Sequence[str],
                     loads: LoadTracker) -> Decision:
        return Decision(self.pick(engines, loads), self.name, "policy")


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class HashRing:
    """Engines on a 64-bit ring, `vnodes` points each. A key belongs to the first point
    clockwise from its hash; adding or removing an engine moves only the keys of its arcs."""

    def __init__(self, engine_ids: Sequence[str], vnodes: int = 160) -> None:
        if vnodes <= 0:
            raise ValueError(f"vnodes: must be > 0, got {vnodes}")
        points: List[Tuple[int, str]] = []
        for e in engine_ids:
            for i in range(vnodes):
                points.append((_hash64(f"{e}#{i}".encode()), e))
        points.sort()
        self._points = [p for p, _ in points]
        self._owners = [e for _, e in points]
        self._distinct = len(set(engine_ids))

    def walk(self, key: int) -> List[str]:
        """Every engine once, in ring order from `key`'s owner."""
        out: List[str] = []
        seen = set()
        n = len(self._points)
        start = bisect.bisect_left(self._points, key)
        for i in range(n):
            e = self._owners[(start + i) % n]
            if e not in seen:
                seen.add(e)
                out.append(e)
                if len(out) == self._distinct:
                    break
        return out

    def owner(self, key: int) -> str:
        i = bisect.bisect_left(self._points, key)
        return self._owners[i % len(self._owners)]


def prefix_key(request: RoutingRequest, tokens: int) -> int:
    """64-bit hash of the first `tokens` tokens (all when shorter), the LoRA and the salt."""
    head = list(request.tokens[:tokens])
    data = struct.pack(f"<{len(head)}i", *head)
    extra = f"{request.lora_name or ''}\0{request.cache_salt or ''}".encode()
    return _hash64(struct.pack("<I", len(extra)) + extra + data)


class ConsistentHashPolicy:
    """The owner on the ring of the prompt's first `prefix_pages` pages; with the guard, the
    first engine clockwise that it accepts (consistent hashing with bounded loads)."""

    name = "consistent-hash"

    def __init__(self, engine_ids: Sequence[str], page_size: int, *, prefix_pages: int = 1,
                 vnodes: int = 160, guard: Optional[ImbalanceGuard] = None) -> None:
        if page_size <= 0 or prefix_pages <= 0:
            raise ValueError("page_size and prefix_pages: must be > 0")
        self._ring = HashRing(engine_ids, vnodes)
        self._prefix_tokens = page_size * prefix_pages
        self._guard = guard or ImbalanceGuard(factor=-1)

    async def choose(self, request: RoutingRequest, engines: Sequence[str],
                     loads: LoadTracker) -> Decision:
        allowed = set(engines)
        order = [e for e in self._ring.walk(prefix_key(request, self._prefix_tokens))
                 if e in allowed]
        least = min(loads.in_flight(e) for e in engines)
        for i, e in enumerate(order):
            if self._guard.accepts(loads.in_flight(e), least):
                return Decision(e, self.name, "policy" if i == 0 else "imbalance-guard")
        raise AssertionError("the least-loaded engine is always accepted")


class IndexUnavailable(Exception):
    """The prefix index cannot rank this request; `cause` is a short class for metrics."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause


class PrefixIndex(Protocol):
    """Ranks candidate engines for a request (kvcm.router.manager_index.ManagerIndex asks
    the manager's Route; tests use fakes). Raises IndexUnavailable."""

    async def rank(self, request: RoutingRequest,
                   candidates: Sequence[RouteCandidate]) -> List[RankedAgent]: ...


def cacheable_tokens(prompt_tokens: int, block_size: int) -> int:
    """The most prompt tokens vLLM takes from its cache: whole blocks, leaving at least the
    last token to compute."""
    return max(0, (prompt_tokens - 1) // block_size) * block_size


class KvAwarePolicy:
    """The index's ranking (most prefill saved minus queue wait first), guarded against
    imbalance; least-loaded when the index is unavailable."""

    name = "kv-aware"

    def __init__(self, index: PrefixIndex, *, page_size: int, block_size: int,
                 guard: Optional[ImbalanceGuard] = None) -> None:
        self._index = index
        self._page_size = page_size
        self._block_size = block_size
        self._guard = guard or ImbalanceGuard(factor=-1)
        self._fallback = LeastLoadedPolicy()
        self._turn = 0

    async def choose(self, request: RoutingRequest, engines: Sequence[str],
                     loads: LoadTracker) -> Decision:
        # Route breaks full ties by candidate order: rotate it, so that requests nobody
        # holds a prefix of share idle engines.
        n = len(engines)
        rotated = [engines[(self._turn + i) % n] for i in range(n)]
        self._turn += 1
        candidates = [RouteCandidate(e, load=loads.in_flight(e),
                                     queued_prefill_tokens=loads.queued_prefill_tokens(e))
                      for e in rotated]
        try:
            if not request.hashable:
                raise IndexUnavailable("unhashable", "the prompt has non-text inputs")
            ranked = await self._index.rank(request, candidates)
        except IndexUnavailable as unavailable:
            engine = self._fallback.pick(engines, loads)
            return Decision(engine, self.name, "fallback", fallback_cause=unavailable.cause)
        by_id: Dict[str, RankedAgent] = {r.agent_id: r for r in ranked}
        least = min(loads.in_flight(e) for e in engines)
        order = [r.agent_id for r in ranked if r.agent_id in engines]
        order += [e for e in engines if e not in by_id]  # never happens with a sane index
        cap = cacheable_tokens(len(request.tokens), self._block_size)
        for i, e in enumerate(order):
            if self._guard.accepts(loads.in_flight(e), least):
                r = by_id.get(e)
                cached = min(r.cached_pages * self._page_size, cap) if r else 0
                return Decision(e, self.name, "policy" if i == 0 else "imbalance-guard",
                                expected_cached_tokens=cached)
        raise AssertionError("the least-loaded engine is always accepted")


__all__ = [
    "ConsistentHashPolicy",
    "Decision",
    "HashRing",
    "ImbalanceGuard",
    "IndexUnavailable",
    "KvAwarePolicy",
    "LeastLoadedPolicy",
    "POLICIES",
    "Policy",
    "PrefixIndex",
    "RoundRobinPolicy",
    "RoutingRequest",
    "cacheable_tokens",
    "prefix_key",
]
