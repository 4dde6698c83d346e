"""kvcm.Client: the synchronous client of the kvcm-manager (the C++ kvcm::Client's twin).

Every call runs under a deadline (default_deadline_ms unless the call passes deadline_ms)
that covers all its retries; only UNAVAILABLE is retried, with exponential backoff and
jitter, at most max_attempts times. A failure raises the kvcm.KvcmError subclass of its
gRPC code. A retried call whose first reply was lost may run twice on the manager: Insert is
idempotent, a duplicated pin lapses with its lease, a retried Release may answer NotFound.

After register_model, prompts of that namespace are hashed locally and travel as page
hashes; otherwise as tokens, which the manager hashes. When the manager refuses the hashes
as stale (its secret changed, or it restarted and forgot the namespace), the client
re-registers with the spec it registered and sends once more, within the same deadline.

Thread-safe: one Client may be shared by any number of threads.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, TypeVar, Union

import grpc

from kvcm import _convert
from kvcm._core import (
    Backoff,
    ClientCore,
    NamespaceKey,
    PageHashesLike,
    Prompt,
    channel_credentials,
    channel_options,
    final_error,
    is_stale_key,
    stale_refresh_error,
)
from kvcm._proto.v1 import cache_manager_pb2 as pb
from kvcm._proto.v1 import cache_manager_pb2_grpc as pb_grpc
from kvcm.errors import FailedPrecondition, InvalidArgument, KvcmError, error_for
from kvcm.types import (
    CacheEvent,
    DeleteNamespaceResult,
    EvictResult,
    InsertResult,
    MatchResult,
    ModelSpec,
    Namespace,
    NamespaceLike,
    PoolLike,
    RegisterModelResult,
    RouteCandidate,
    RoutePolicy,
    RouteResult,
    Stats,
    as_namespace,
)

T = TypeVar("T")

# Deadline of the best-effort release when a PinnedPrefix's `with` block ends.
RELEASE_DEADLINE_MS = 1000


class PinnedPrefix:
    """A pin on a matched prefix; `with` releases it (best effort) when the block ends.

    Without `with`, call release(); a pin nobody releases lapses with its lease. Not
    thread-safe: one owner at a time.
    """

    def __init__(self, client: "Client", ns: Namespace, match: MatchResult) -> None:
        self._client = client
        self._ns = ns
        self._match = match
        self._pin_id = match.pin_id

    @property
    def namespace(self) -> Namespace:
        return self._ns

    @property
    def match(self) -> MatchResult:
        """The match the pin was taken on (lease expiry updated by renew())."""
        return self._match

    @property
    def pin_id(self) -> int:
        """0 when no pin is held (nothing matched, or released)."""
        return self._pin_id

    def release(self, *, deadline_ms: Optional[int] = None) -> None:
        """Drops the pin now. Afterwards nothing is held, whatever the outcome."""
        if self._pin_id == 0:
            return
        pin_id, self._pin_id = self._pin_id, 0
        self._client.release(self._ns, pin_id, deadline_ms=deadline_ms)

    def renew(self, ttl_ms: int = 0, *, deadline_ms: Optional[int] = None) -> int:
        """Extends the lease to now + ttl_ms (0: the manager's default); returns the new
        expiry (unix ms). FailedPrecondition when no pin is held; Aborted when it expired."""
        if self._pin_id == 0:
            raise FailedPrecondition("PinnedPrefix holds no pin")
        expiry = self._client.renew_lease(self._ns, self._pin_id, ttl_ms, deadline_ms=deadline_ms)
        self._match = replace(self._match, lease_expiry_unix_ms=expiry)
        return expiry

    def __enter__(self) -> "PinnedPrefix":
        return self

    def __exit__(self, *exc: object) -> None:
        deadline = min(self._client.options.default_deadline_ms, RELEASE_DEADLINE_MS)
        try:
            self.release(deadline_ms=deadline)
        except KvcmError:
            pass  # best effort: a pin the manager did not hear about lapses with its lease

    def __repr__(self) -> str:
        return (
            f"PinnedPrefix(ns={self._ns}, pin_id={self._pin_id}, "
            f"matched_pages={self._match.matched_pages})"
        )


class EventStream:
    """A WatchEvents subscription: iterate it for CacheEvents. No deadline, no retries;
    after the stream ends (an exception other than after cancel()), subscribe again.

    Iteration raises ResourceExhausted when the manager dropped a slow subscriber and
    Unavailable when the connection was lost; after cancel() it just stops.
    cancel() may be called from any thread.
    """

    def __init__(self, call: Any) -> None:
        self._call = call
        self._cancelled = False

    def __iter__(self) -> Iterator[CacheEvent]:
        try:
            for event in self._call:
                yield _convert.event_from_proto(event)
        except grpc.RpcError as e:
            if self._cancelled and e.code() == grpc.StatusCode.CANCELLED:
                return
            raise final_error(e, 1) from None

    def cancel(self) -> None:
        """Ends the stream; iteration stops."""
        self._cancelled = True
        self._call.cancel()

    def __enter__(self) -> "EventStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


class Client(ClientCore):
    """Synchronous client of the kvcm-manager's CacheManager service.

        client = kvcm.Client("kvcm:50051", ca_file="ca.pem", token_file="worker.token")

    Give insecure=True (plaintext) or ca_file (TLS; with cert_file and key_file for mutual
    TLS). The bearer token comes from token, else token_file, else $KVCM_TOKEN. Bad options
    raise InvalidArgument naming the field. Connects lazily: the first call connects and
    is retried while the manager is unavailable.
    """

    def __init__(
        self,
        address: str = "127.0.0.1:50051",
        *,
        insecure: bool = False,
        ca_file: Optional[str] = None,
        cert_file: Optional[str] = None,
        key_file: Optional[str] = None,
        token: Optional[str] = None,
        token_file: Optional[str] = None,
        default_deadline_ms: int = 5000,
        max_attempts: int = 5,
        initial_backoff_ms: int = 20,
        max_backoff_ms: int = 1000,
        backoff_multiplier: float = 2.0,
    ) -> None:
        super().__init__(
            address,
            insecure=insecure,
            ca_file=ca_file,
            cert_file=cert_file,
            key_file=key_file,
            token=token,
            token_file=token_file,
            default_deadline_ms=default_deadline_ms,
            max_attempts=max_attempts,
            initial_backoff_ms=initial_backoff_ms,
            max_backoff_ms=max_backoff_ms,
            backoff_multiplier=backoff_multiplier,
        )
        creds = channel_credentials(self.options)
        opts = channel_options(self.options)
        if creds is None:
            self._channel = grpc.insecure_channel(self.options.address, options=opts)
        else:
            self._channel = grpc.secure_channel(self.options.address, creds, options=opts)
        self._stub = pb_grpc.CacheManagerStub(self._channel)

    def close(self) -> None:
        """Closes the channel; calls in flight are cancelled."""
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing -----------------------------------------------------------------------

    def _invoke(self, method: Callable[..., T], request: Any, deadline: float) -> T:
        """Calls `method` until `deadline` (time.monotonic()), retrying UNAVAILABLE."""
        self._count(calls=1)
        backoff = Backoff(self.options)
        attempts = 0
        while True:
            attempts += 1
            self._count(attempts=1)
            try:
                return method(
                    request,
                    timeout=max(deadline - time.monotonic(), 0.0),
                    metadata=self._metadata,
                )
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or attempts >= self.options.max_attempts:
                    raise final_error(e, attempts) from None
                sleep = backoff.next_sleep_s()
                if time.monotonic() + sleep >= deadline:
                    raise final_error(e, attempts) from None
                time.sleep(sleep)
                self._count(retries=1)

    def _deadline(self, deadline_ms: Optional[int]) -> float:
        return time.monotonic() + self._deadline_s(deadline_ms)

    def _send_prompt(
        self, ns: Namespace, prompt: Prompt, deadline: float, send: Callable[[Any], T]
    ) -> T:
        """send(key) with the namespace's cached key; when tokens were hashed with a stale
        key, re-registers once and sends again."""
        key = self._prompt_key(ns, prompt)
        try:
            return send(key)
        except KvcmError as e:
            # Hashes the caller computed cannot be redone with a fresh key: their refusal
            # is the answer (as the C++ MatchHashes / InsertHashes).
            if key is None or prompt.page_hashes is not None or not is_stale_key(e):
                raise
            try:
                self._register_until(ns, key.spec, key.max_page_age_s, deadline)
            except KvcmError as refresh:
                raise stale_refresh_error(e, ns, refresh) from None
            return send(self._prompt_key(ns, prompt))

    def _register_until(
        self, ns: Namespace, spec: ModelSpec, max_page_age_s: int, deadline: float
    ) -> RegisterModelResult:
        request = self._register_request(ns, spec, max_page_age_s)
        response = self._invoke(self._stub.RegisterModel, request, deadline)
        return self._registered(ns, spec, max_page_age_s, response)

    # -- API ----------------------------------------------------------------------------

    def register_model(
        self,
        ns: NamespaceLike,
        spec: ModelSpec,
        *,
        max_page_age_s: int = 0,
        deadline_ms: Optional[int] = None,
    ) -> RegisterModelResult:
        """Creates or confirms namespace `ns` and caches its hash key, so later calls on
        `ns` hash prompts locally. max_page_age_s (retention, seconds) only tightens."""
        ns = as_namespace(ns)
        return self._register_until(ns, spec, max_page_age_s, self._deadline(deadline_ms))

    def match(
        self,
        ns: NamespaceLike,
        tokens: Any = None,
        *,
        page_hashes: Optional[PageHashesLike] = None,
        requester_agent_id: str = "",
        pin: bool = False,
        lease_ttl_ms: int = 0,
        probe: bool = False,
        deadline_ms: Optional[int] = None,
    ) -> MatchResult:
        """Longest cached prefix of a prompt (tokens, or page_hashes from hash_prompt), and
        every replica of every matched page. pin takes a lease-bound pin; probe changes
        nothing (no recency, no pin, no counters)."""
        ns = as_namespace(ns)
        prompt = Prompt.of(tokens, page_hashes)
        deadline = self._deadline(deadline_ms)

        def send(key: Optional[NamespaceKey]) -> pb.MatchResponse:
            request = self._match_request(
                ns, key, prompt, requester_agent_id, pin, lease_ttl_ms, probe
            )
            return self._invoke(self._stub.Match, request, deadline)

        return _convert.match_from_proto(self._send_prompt(ns, prompt, deadline, send))

    def match_and_pin(
        self,
        ns: NamespaceLike,
        tokens: Any = None,
        *,
        page_hashes: Optional[PageHashesLike] = None,
        requester_agent_id: str = "",
        lease_ttl_ms: int = 0,
        deadline_ms: Optional[int] = None,
    ) -> PinnedPrefix:
        """match(pin=True) wrapped in a PinnedPrefix that `with` releases:

        with client.match_and_pin(ns, tokens) as prefix:
            prefix.match.pages ...
        """
        ns = as_namespace(ns)
        match = self.match(
            ns,
            tokens,
            page_hashes=page_hashes,
            requester_agent_id=requester_agent_id,
            pin=True,
            lease_ttl_ms=lease_ttl_ms,
            deadline_ms=deadline_ms,
        )
        return PinnedPrefix(self, ns, match)

    def route(
        self,
        ns: NamespaceLike,
        tokens: Any = None,
        *,
        page_hashes: Optional[PageHashesLike] = None,
        candidates: Sequence[Union[RouteCandidate, str]] = (),
        policy: RoutePolicy = RoutePolicy.PREFILL_SAVED,
        prefill_tokens_per_s: float = 0.0,
        probe: bool = False,
        pin: bool = False,
        lease_ttl_ms: int = 0,
        deadline_ms: Optional[int] = None,
    ) -> RouteResult:
        """Candidate agents ranked by the prefill each would save (or a cache-blind
        policy), and the match for the best. Empty candidates: every live agent."""
        ns = as_namespace(ns)
        prompt = Prompt.of(tokens, page_hashes)
        deadline = self._deadline(deadline_ms)

        def send(key: Optional[NamespaceKey]) -> pb.RouteResponse:
            request = self._route_request(
                ns,
                key,
                prompt,
                candidates,
                policy,
                prefill_tokens_per_s,
                probe,
                pin,
                lease_ttl_ms,
            )
            return self._invoke(self._stub.Route, request, deadline)

        return _convert.route_from_proto(self._send_prompt(ns, prompt, deadline, send))

    def insert(
        self,
        ns: NamespaceLike,
        tokens: Any = None,
        pool: Optional[PoolLike] = None,
        block_ids: Iterable[int] = (),
        *,
        page_hashes: Optional[PageHashesLike] = None,
        use_reservation: bool = False,
        agent_epoch: int = 0,
        deadline_ms: Optional[int] = None,
    ) -> InsertResult:
        """Records that `pool` holds the whole pages of the prompt in `block_ids` (one per
        whole page, distinct). Idempotent. In an agent's pool the blocks must be allocated
        to `ns` in `agent_epoch` (BlockAgent.Allocate); see CacheManager.Insert."""
        if pool is None:
            raise InvalidArgument("pool: is required")
        ns = as_namespace(ns)
        prompt = Prompt.of(tokens, page_hashes)
        deadline = self._deadline(deadline_ms)
        block_ids = list(block_ids)

        def send(key: Optional[NamespaceKey]) -> pb.InsertResponse:
            request = self._insert_request(
                ns, key, prompt, pool, block_ids, use_reservation, agent_epoch
            )
            return self._invoke(self._stub.Insert, request, deadline)

        return _convert.insert_from_proto(self._send_prompt(ns, prompt, deadline, send))

    def release(self, ns: NamespaceLike, pin_id: int, *, deadline_ms: Optional[int] = None) -> None:
        """Drops a pin. NotFound for an unknown pin, Aborted for an expired one."""
        request = self._pin_request(as_namespace(ns), pin_id)
        self._invoke(self._stub.Release, request, self._deadline(deadline_ms))

    def renew_lease(
        self, ns: NamespaceLike, pin_id: int, ttl_ms: int = 0, *, deadline_ms: Optional[int] = None
    ) -> int:
        """Extends a pin's lease to now + ttl_ms (0: the manager's default); returns the new
        expiry in unix milliseconds."""
        request = self._renew_request(as_namespace(ns), pin_id, ttl_ms)
        response = self._invoke(self._stub.RenewLease, request, self._deadline(deadline_ms))
        return response.lease_expiry_unix_ms

    def reserve(
        self, pool: PoolLike, nbytes: int, *, tenant: str = "", deadline_ms: Optional[int] = None
    ) -> int:
        """Makes `nbytes` of `pool` free (evicting exactly the shortfall) and holds them for
        `tenant` (a worker: its own; "" an admin's operator reservation). Returns the bytes
        evicted. ResourceExhausted, nothing changed, when pins leave too little."""
        request = self._reserve_request(pool, nbytes, tenant)
        response = self._invoke(self._stub.Reserve, request, self._deadline(deadline_ms))
        return response.evicted_bytes

    def unreserve(
        self, pool: PoolLike, nbytes: int, *, tenant: str = "", deadline_ms: Optional[int] = None
    ) -> None:
        """Gives reserved headroom back. OutOfRange beyond what `tenant` reserved there."""
        request = self._reserve_request(pool, nbytes, tenant)
        self._invoke(self._stub.Unreserve, request, self._deadline(deadline_ms))

    def evict_from_pool(
        self, pool: PoolLike, nbytes: int, *, deadline_ms: Optional[int] = None
    ) -> EvictResult:
        """Evicts at least `nbytes` of unpinned pages from `pool`, all or nothing."""
        request = self._evict_pool_request(pool, nbytes)
        return _convert.evict_from_proto(
            self._invoke(self._stub.Evict, request, self._deadline(deadline_ms))
        )

    def evict_from_namespace(
        self, ns: NamespaceLike, nbytes: int, *, deadline_ms: Optional[int] = None
    ) -> EvictResult:
        """Evicts at least `nbytes` of unpinned pages of `ns`, all or nothing."""
        request = self._evict_namespace_request(as_namespace(ns), nbytes)
        return _convert.evict_from_proto(
            self._invoke(self._stub.Evict, request, self._deadline(deadline_ms))
        )

    def delete_namespace(
        self, ns: NamespaceLike, *, deadline_ms: Optional[int] = None
    ) -> DeleteNamespaceResult:
        """Operator (role admin): removes a namespace with its pages and pins. This client
        forgets its hash key, so it does not re-create the namespace by itself."""
        ns = as_namespace(ns)
        response = self._invoke(
            self._stub.DeleteNamespace, self._delete_request(ns), self._deadline(deadline_ms)
        )
        self._forget_key(ns)
        return DeleteNamespaceResult(response.removed_pages, response.dropped_pins)

    def stats(self, *, deadline_ms: Optional[int] = None) -> Stats:
        """Pools, namespaces, agents, tenants, counters and limits."""
        response = self._invoke(self._stub.Stats, pb.StatsRequest(), self._deadline(deadline_ms))
        return _convert.stats_from_proto(response)

    def watch_events(self, ns: Optional[NamespaceLike] = None) -> EventStream:
        """Subscribes to index changes of `ns` (every namespace when None)."""
        call = self._stub.WatchEvents(self._watch_request(ns), metadata=self._metadata)
        return EventStream(call)


__all__ = ["Client", "EventStream", "PinnedPrefix", "RELEASE_DEADLINE_MS", "error_for"]
