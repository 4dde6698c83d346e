"""kvcm.aio.Client: the asyncio twin of kvcm.Client (grpc.aio), with the same methods,
semantics, retries and errors, as coroutines:

    async with kvcm.aio.Client("127.0.0.1:50051", insecure=True) as client:
        await client.register_model(ns, kvcm.ModelSpec.deepseek_v3())
        async with client.match_and_pin(ns, tokens) as prefix:
            ...

Use a client from the event loop it was created on.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any, AsyncIterator, Awaitable, Callable, Generator, Iterable, Optional
from typing import Sequence, TypeVar, Union

import grpc
import grpc.aio

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
from kvcm.client import RELEASE_DEADLINE_MS
from kvcm.errors import FailedPrecondition, InvalidArgument, KvcmError
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


class PinnedPrefix:
    """A pin on a matched prefix; `async with` releases it (best effort) when the block
    ends. Without it, await release(); a pin nobody releases lapses with its lease."""

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
        return self._match

    @property
    def pin_id(self) -> int:
        """0 when no pin is held (nothing matched, or released)."""
        return self._pin_id

    async def release(self, *, deadline_ms: Optional[int] = None) -> None:
        """Drops the pin now. Afterwards nothing is held, whatever the outcome."""
        if self._pin_id == 0:
            return
        pin_id, self._pin_id = self._pin_id, 0
        await self._client.release(self._ns, pin_id, deadline_ms=deadline_ms)

    async def renew(self, ttl_ms: int = 0, *, deadline_ms: Optional[int] = None) -> int:
        """Extends the lease (0: the manager's default); returns the new expiry, unix ms."""
        if self._pin_id == 0:
            raise FailedPrecondition("PinnedPrefix holds no pin")
        expiry = await self._client.renew_lease(
            self._ns, self._pin_id, ttl_ms, deadline_ms=deadline_ms
        )
        self._match = replace(self._match, lease_expiry_unix_ms=expiry)
        return expiry

    async def __aenter__(self) -> "PinnedPrefix":
        return self

    async def __aexit__(self, *exc: object) -> None:
        deadline = min(self._client.options.default_deadline_ms, RELEASE_DEADLINE_MS)
        try:
            await self.release(deadline_ms=deadline)
        except KvcmError:
            pass  # best effort: the lease lapses on its own


class _PinContext:
    """What match_and_pin returns: await it for a PinnedPrefix, or `async with` it to
    match on entry and release on exit."""

    def __init__(self, make: Callable[[], Awaitable[PinnedPrefix]]) -> None:
        self._make = make
        self._prefix: Optional[PinnedPrefix] = None

    def __await__(self) -> Generator[Any, None, PinnedPrefix]:
        return self._make().__await__()

    async def __aenter__(self) -> PinnedPrefix:
        self._prefix = await self._make()
        return self._prefix

    async def __aexit__(self, *exc: object) -> None:
        if self._prefix is not None:
            await self._prefix.__aexit__(*exc)


class EventStream:
    """A WatchEvents subscription: `async for event in stream`. No deadline, no retries.
    Raises ResourceExhausted (dropped as too slow) or Unavailable (connection lost); after
    cancel() iteration just stops."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self._cancelled = False

    async def __aiter__(self) -> AsyncIterator[CacheEvent]:
        try:
            async for event in self._call:
                yield _convert.event_from_proto(event)
        except asyncio.CancelledError:
            if self._cancelled:
                return
            raise
        except grpc.RpcError as e:
            if self._cancelled and e.code() == grpc.StatusCode.CANCELLED:
                return
            raise final_error(e, 1) from None

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()

    async def __aenter__(self) -> "EventStream":
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()


class Client(ClientCore):
    """Asynchronous client of the kvcm-manager; options as kvcm.Client."""

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
            self._channel = grpc.aio.insecure_channel(self.options.address, options=opts)
        else:
            self._channel = grpc.aio.secure_channel(self.options.address, creds, options=opts)
        self._stub = pb_grpc.CacheManagerStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- plumbing -----------------------------------------------------------------------

    async def _invoke(self, method: Callable[..., Any], request: Any, deadline: float) -> Any:
        self._count(calls=1)
        backoff = Backoff(self.options)
        attempts = 0
        while True:
            attempts += 1
            self._count(attempts=1)
            try:
                return await method(
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
                await asyncio.sleep(sleep)
                self._count(retries=1)

    def _deadline(self, deadline_ms: Optional[int]) -> float:
        return time.monotonic() + self._deadline_s(deadline_ms)

    async def _send_prompt(
        self,
        ns: Namespace,
        prompt: Prompt,
        deadline: float,
        send: Callable[[Optional[NamespaceKey]], Awaitable[T]],
    ) -> T:
        key = self._prompt_key(ns, prompt)
        try:
            return await send(key)
        except KvcmError as e:
            # Hashes the caller computed cannot be redone with a fresh key: their refusal
            # is the answer (as the C++ MatchHashes / InsertHashes).
            if key is None or prompt.page_hashes is not None or not is_stale_key(e):
                raise
            try:
                await self._register_until(ns, key.spec, key.max_page_age_s, deadline)
            except KvcmError as refresh:
                raise stale_refresh_error(e, ns, refresh) from None
            return await send(self._prompt_key(ns, prompt))

    async def _register_until(
        self, ns: Namespace, spec: ModelSpec, max_page_age_s: int, deadline: float
    ) -> RegisterModelResult:
        request = self._register_request(ns, spec, max_page_age_s)
        response = await self._invoke(self._stub.RegisterModel, request, deadline)
        return self._registered(ns, spec, max_page_age_s, response)

    # -- API (see kvcm.Client for each method's contract) -------------------------------

    async def register_model(
        self,
        ns: NamespaceLike,
        spec: ModelSpec,
        *,
        max_page_age_s: int = 0,
        deadline_ms: Optional[int] = None,
    ) -> RegisterModelResult:
        ns = as_namespace(ns)
        return await self._register_until(ns, spec, max_page_age_s, self._deadline(deadline_ms))

    async def match(
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
        ns = as_namespace(ns)
        prompt = Prompt.of(tokens, page_hashes)
        deadline = self._deadline(deadline_ms)

        async def send(key: Optional[NamespaceKey]) -> pb.MatchResponse:
            request = self._match_request(
                ns, key, prompt, requester_agent_id, pin, lease_ttl_ms, probe
            )
            return await self._invoke(self._stub.Match, request, deadline)

        return _convert.match_from_proto(await self._send_prompt(ns, prompt, deadline, send))

    def match_and_pin(
        self,
        ns: NamespaceLike,
        tokens: Any = None,
        *,
        page_hashes: Optional[PageHashesLike] = None,
        requester_agent_id: str = "",
        lease_ttl_ms: int = 0,
        deadline_ms: Optional[int] = None,
    ) -> _PinContext:
        """`async with client.match_and_pin(ns, tokens) as prefix:` (released on exit), or
        `prefix = await client.match_and_pin(ns, tokens)`."""
        namespace = as_namespace(ns)

        async def make() -> PinnedPrefix:
            match = await self.match(
                namespace,
                tokens,
                page_hashes=page_hashes,
                requester_agent_id=requester_agent_id,
                pin=True,
                lease_ttl_ms=lease_ttl_ms,
                deadline_ms=deadline_ms,
            )
            return PinnedPrefix(self, namespace, match)

        return _PinContext(make)

    async def route(
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
        ns = as_namespace(ns)
        prompt = Prompt.of(tokens, page_hashes)
        deadline = self._deadline(deadline_ms)

        async def send(key: Optional[NamespaceKey]) -> pb.RouteResponse:
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
            return await self._invoke(self._stub.Route, request, deadline)

        return _convert.route_from_proto(await self._send_prompt(ns, prompt, deadline, send))

    async def insert(
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
        if pool is None:
            raise InvalidArgument("pool: is required")
        ns = as_namespace(ns)
        prompt = Prompt.of(tokens, page_hashes)
        deadline = self._deadline(deadline_ms)
        block_ids = list(block_ids)

        async def send(key: Optional[NamespaceKey]) -> pb.InsertResponse:
            request = self._insert_request(
                ns, key, prompt, pool, block_ids, use_reservation, agent_epoch
            )
            return await self._invoke(self._stub.Insert, request, deadline)

        return _convert.insert_from_proto(await self._send_prompt(ns, prompt, deadline, send))

    async def release(
        self, ns: NamespaceLike, pin_id: int, *, deadline_ms: Optional[int] = None
    ) -> None:
        request = self._pin_request(as_namespace(ns), pin_id)
        await self._invoke(self._stub.Release, request, self._deadline(deadline_ms))

    async def renew_lease(
        self, ns: NamespaceLike, pin_id: int, ttl_ms: int = 0, *, deadline_ms: Optional[int] = None
    ) -> int:
        request = self._renew_request(as_namespace(ns), pin_id, ttl_ms)
        response = await self._invoke(self._stub.RenewLease, request, self._deadline(deadline_ms))
        return response.lease_expiry_unix_ms

    async def reserve(
        self, pool: PoolLike, nbytes: int, *, tenant: str = "", deadline_ms: Optional[int] = None
    ) -> int:
        request = self._reserve_request(pool, nbytes, tenant)
        response = await self._invoke(self._stub.Reserve, request, self._deadline(deadline_ms))
        return response.evicted_bytes

    async def unreserve(
        self, pool: PoolLike, nbytes: int, *, tenant: str = "", deadline_ms: Optional[int] = None
    ) -> None:
        request = self._reserve_request(pool, nbytes, tenant)
        await self._invoke(self._stub.Unreserve, request, self._deadline(deadline_ms))

    async def evict_from_pool(
        self, pool: PoolLike, nbytes: int, *, deadline_ms: Optional[int] = None
    ) -> EvictResult:
        request = self._evict_pool_request(pool, nbytes)
        response = await self._invoke(self._stub.Evict, request, self._deadline(deadline_ms))
        return _convert.evict_from_proto(response)

    async def evict_from_namespace(
        self, ns: NamespaceLike, nbytes: int, *, deadline_ms: Optional[int] = None
    ) -> EvictResult:
        request = self._evict_namespace_request(as_namespace(ns), nbytes)
        response = await self._invoke(self._stub.Evict, request, self._deadline(deadline_ms))
        return _convert.evict_from_proto(response)

    async def delete_namespace(
        self, ns: NamespaceLike, *, deadline_ms: Optional[int] = None
    ) -> DeleteNamespaceResult:
        ns = as_namespace(ns)
        response = await self._invoke(
            self._stub.DeleteNamespace, self._delete_request(ns), self._deadline(deadline_ms)
        )
        self._forget_key(ns)
        return DeleteNamespaceResult(response.removed_pages, response.dropped_pins)

    async def stats(self, *, deadline_ms: Optional[int] = None) -> Stats:
        response = await self._invoke(
            self._stub.Stats, pb.StatsRequest(), self._deadline(deadline_ms)
        )
        return _convert.stats_from_proto(response)

    def watch_events(self, ns: Optional[NamespaceLike] = None) -> EventStream:
        call = self._stub.WatchEvents(self._watch_request(ns), metadata=self._metadata)
        return EventStream(call)


__all__ = ["Client", "EventStream", "PinnedPrefix"]
