"""The kv-aware policy's prefix index: kvcm-manager's Route, probing, over engine pools.

A request is hashed as the bridge hashes the engine's blocks (kvcm.engines.hash_request: the
namespace key, LoRA and cache salt mixed in), so it only ever matches pages cached for the
same adapter and salt. The key comes from RegisterModel, with the router's token or a
separate register token (a `router` role may only probe). Without a key, unsalted base-model
requests go to the manager as tokens (the manager hashes them the same way) and the others
cannot be ranked.

Engines the manager has no live session for (their bridge not yet, or no longer, publishing)
hold nothing as far as routing goes: they are ranked locally at zero cached pages.
Use from one event loop.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Callable, Dict, List, Optional, Sequence

import grpc

from kvcm.aio import Client
from kvcm.errors import KvcmError
from kvcm.router.policy import IndexUnavailable, RoutingRequest
from kvcm.types import ModelSpec, Namespace, RankedAgent, RouteCandidate, RoutePolicy
from kvcm.engines import hash_request

log = logging.getLogger(__name__)

_CANDIDATE = re.compile(r"candidates\[(\d+)\]")


def _adopt_key(source: Client, target: Client, ns: Namespace) -> bytes:
    """Copies the namespace key `source` registered into `target`'s key cache (so `target`
    may send page hashes), and returns it. Both are kvcm clients of this package."""
    key = source._cached_key(ns)
    if key is None:
        raise IndexUnavailable("no-key", f"RegisterModel of {ns} gave no usable hash key")
    if target is not source:
        with target._lock:
            target._keys[ns] = key
    return key.key


class ManagerIndex:
    """PrefixIndex over Route(probe=True, policy=PREFILL_SAVED).

    `prefill_tokens_per_s` is sent with every Route (the queue charge uses the same rate
    when an engine is ranked locally). A manager that fails with UNAVAILABLE or a deadline
    is not asked again for `retry_s` (requests fall back at once meanwhile)."""

    def __init__(self, client: Client, ns: Namespace, spec: ModelSpec, *, block_size: int,
                 prefill_tokens_per_s: float, route_deadline_ms: int = 200,
                 register_client: Optional[Client] = None, retry_s: float = 1.0,
                 not_live_s: float = 0.25,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if spec.page_size_tokens % block_size != 0:
            raise ValueError(
                f"page_size: {spec.page_size_tokens} tokens is not a multiple of the engine "
                f"block_size {block_size}")
        if prefill_tokens_per_s <= 0:
            raise ValueError("prefill_tokens_per_s: must be > 0")
        self.client = client
        self.namespace = ns
        self.spec = spec
        self.page_size = spec.page_size_tokens
        self.block_size = block_size
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.route_deadline_ms = route_deadline_ms
        self._register_client = register_client or client
        self._retry_s = retry_s
        self._not_live_s = not_live_s
        self._clock = clock
        self._key: Optional[bytes] = None
        self._next_register = 0.0
        self._skip_until = 0.0
        self._not_live: Dict[str, float] = {}  # engine id -> monotonic time to ask again

    @property
    def has_key(self) -> bool:
        return self._key is not None

    async def register(self) -> bool:
        """RegisterModel for the key; False (logged) when refused or unreachable."""
        self._next_register = self._clock() + 5.0
        try:
            await self._register_client.register_model(self.namespace, self.spec)
            self._key = _adopt_key(self._register_client, self.client, self.namespace)
            return True
        except (KvcmError, IndexUnavailable) as e:
            log.warning("kv-aware routing: no hash key for %s (%s); only unsalted base-model "
                        "requests are ranked by the manager", self.namespace, e)
            self._key = None
            return False

    def hash(self, request: RoutingRequest) -> List[bytes]:
        """The request's page hashes as the bridge publishes them (needs the key)."""
        assert self._key is not None
        return hash_request(self._key, request.tokens, self.page_size, self.block_size,
                            lora_name=request.lora_name, cache_salt=request.cache_salt)

    async def rank(self, request: RoutingRequest,
                   candidates: Sequence[RouteCandidate]) -> List[RankedAgent]:
        now = self._clock()
        pages = len(request.tokens) // self.page_size
        live = [c for c in candidates if self._not_live.get(c.agent_id, 0.0) <= now]
        if pages == 0 or not live:
            return self._merge([], candidates, pages)
        if now < self._skip_until:
            raise IndexUnavailable("unavailable", "manager failed recently; not asked")
        if self._key is None and now >= self._next_register:
            await self.register()
        tokens: Optional[List[int]] = None
        hashes: Optional[bytes] = None
        if self._key is not None:
            hashes = b"".join(self.hash(request))
        elif request.lora_name or request.cache_salt:
            raise IndexUnavailable("no-key", "a salted or LoRA request needs the namespace key")
        else:
            tokens = list(request.tokens[:pages * self.page_size])
        while live:
            try:
                result = await self.client.route(
                    self.namespace, tokens, page_hashes=hashes, candidates=live,
                    policy=RoutePolicy.PREFILL_SAVED,
                    prefill_tokens_per_s=self.prefill_tokens_per_s, probe=True,
                    deadline_ms=self.route_deadline_ms)
                return self._merge(result.ranked, candidates, pages)
            except KvcmError as e:
                gone = self._not_found_candidate(e, live)
                if gone is None:
                    raise self._unavailable(e) from None
                self._not_live[gone] = self._clock() + self._not_live_s
                live = [c for c in live if c.agent_id != gone]
        return self._merge([], candidates, pages)

    def _not_found_candidate(self, e: KvcmError, live: Sequence[RouteCandidate]) -> Optional[str]:
        if e.code != grpc.StatusCode.NOT_FOUND:
            return None
        m = _CANDIDATE.search(e.message)
        if m is None or int(m.group(1)) >= len(live):
            return None
        return live[int(m.group(1))].agent_id

    def _unavailable(self, e: KvcmError) -> IndexUnavailable:
        code = e.code
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            self._skip_until = self._clock() + self._retry_s
        if code == grpc.StatusCode.FAILED_PRECONDITION or code == grpc.StatusCode.NOT_FOUND:
            self._key = None  # the manager's key or namespace changed: register again
            self._next_register = 0.0
        cause = {
            grpc.StatusCode.UNAVAILABLE: "unavailable",
            grpc.StatusCode.DEADLINE_EXCEEDED: "deadline",
            grpc.StatusCode.UNAUTHENTICATED: "auth",
            grpc.StatusCode.PERMISSION_DENIED: "auth",
            grpc.StatusCode.FAILED_PRECONDITION: "stale-key",
            grpc.StatusCode.NOT_FOUND: "not-found",
        }.get(code, "error")
        return IndexUnavailable(cause, f"Route: {code.name}: {e.message}")

    def _merge(self, ranked: Sequence[RankedAgent], candidates: Sequence[RouteCandidate],
               pages: int) -> List[RankedAgent]:
        """The manager's ranking plus the candidates it did not rank (no live session: zero
        cached pages), in Route's order: saved - queue, then load, then candidate order."""
        known = {r.agent_id: r for r in ranked}
        position = {c.agent_id: i for i, c in enumerate(candidates)}
        out = list(ranked)
        for c in candidates:
            if c.agent_id not in known:
                queue_ms = c.queued_prefill_tokens / self.prefill_tokens_per_s * 1000.0
                out.append(RankedAgent(c.agent_id, 0, 0, pages, 0.0, 0.0, 0.0, c.load,
                                       queue_ms))
        out.sort(key=lambda r: (-(r.saved_prefill_ms - r.queue_ms), r.load,
                                position.get(r.agent_id, 0)))
        return out


__all__ = ["ManagerIndex"]
